//! Chat templates rendered in worker processes: nothing a template does — a stack
//! overflow in minijinja's recursive printing or drop of a value nested millions deep,
//! built within every budget — can take the calling process down. A worker's death, its
//! silence past the deadline or a malformed reply is one more clean error; the next
//! rendering starts a fresh worker.
//!
//! A worker is this executable run with `WORKER_ARG`: it reads one request per line on
//! stdin (`Request`, JSON), renders it with `render_here` (the same budgets), and writes
//! one reply per line. Idle workers are kept for the next rendering (`MAX_IDLE`), so a
//! rendering costs one round trip through two pipes, not a process start.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::template_limits::{MAX_OUTPUT_BYTES, MAX_SECONDS};

/// The argument that makes a binary of this crate a template worker (see `serve_requests`).
pub const WORKER_ARG: &str = "__template-worker";
/// Idle workers kept for reuse.
const MAX_IDLE: usize = 4;
/// Longest request line a worker reads: a template (256 KiB) and its context (a request
/// body of at most a few MiB, JSON-escaped).
const MAX_REQUEST_BYTES: usize = 64 << 20;
/// Longest reply line: the rendered text JSON-escaped (at most 6 bytes a byte) and a frame.
const MAX_REPLY_BYTES: usize = 6 * MAX_OUTPUT_BYTES + 4096;

static EXE: OnceLock<PathBuf> = OnceLock::new();
static IDLE: Mutex<Vec<Worker>> = Mutex::new(Vec::new());

/// Renders every template of this process in workers started from `exe` (a binary that
/// calls `serve_requests` when run with `WORKER_ARG`). Called once at start by binaries
/// that render for others; without it templates render on a thread of the caller.
pub fn use_workers(exe: PathBuf) {
    let _ = EXE.set(exe);
}

pub(super) fn exe() -> Option<&'static Path> {
    EXE.get().map(PathBuf::as_path)
}

#[derive(Serialize, Deserialize)]
struct Request {
    template: String,
    ctx: serde_json::Value,
}

#[derive(Serialize, Deserialize)]
struct Reply {
    rendered: std::result::Result<String, String>,
    /// The worker exits after this reply (a rendering left a parked thread behind).
    retiring: bool,
}

/// The worker's main loop: requests on stdin, replies on stdout, until stdin closes.
pub fn serve_requests() -> ExitCode {
    let mut input = std::io::stdin().lock();
    let mut out = std::io::stdout().lock();
    loop {
        let mut line = Vec::new();
        match std::io::BufRead::read_until(
            &mut (&mut input).take(MAX_REQUEST_BYTES as u64 + 1),
            b'\n',
            &mut line,
        ) {
            Ok(0) => return ExitCode::SUCCESS,
            Ok(_) if line.len() > MAX_REQUEST_BYTES => return ExitCode::FAILURE,
            Ok(_) => {}
            Err(_) => return ExitCode::FAILURE,
        }
        let rendered = serde_json::from_slice::<Request>(&line)
            .context("malformed request")
            .and_then(|r| super::render_here(r.template, minijinja::Value::from_serialize(&r.ctx)))
            .map_err(|e| format!("{e:#}"));
        let retiring = crate::bounded::abandoned() > 0;
        let reply = Reply { rendered, retiring };
        let Ok(mut bytes) = serde_json::to_vec(&reply) else {
            return ExitCode::FAILURE;
        };
        bytes.push(b'\n');
        if out.write_all(&bytes).and_then(|()| out.flush()).is_err() || retiring {
            return ExitCode::SUCCESS;
        }
    }
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
}

impl Worker {
    fn start(exe: &Path) -> Result<Self> {
        let mut child = Command::new(exe)
            .arg(WORKER_ARG)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // A dying worker's own message (e.g. a stack overflow) is reported here, once.
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting a template worker ({})", exe.display()))?;
        let stdin = child.stdin.take().context("worker stdin")?;
        let stdout = child.stdout.take().context("worker stdout")?;
        Ok(Self {
            child,
            stdin,
            stdout,
        })
    }

    /// Ends the worker for good (after a failure: it may be stuck or dead).
    fn discard(mut self) -> Option<std::process::ExitStatus> {
        let _ = self.child.kill();
        self.child.wait().ok()
    }

    /// One round trip; `Err` leaves the worker unusable.
    fn ask(&mut self, request: &[u8], deadline: Instant) -> Result<Reply, Failure> {
        self.stdin.write_all(request).map_err(|_| Failure::Died)?;
        self.stdin.flush().map_err(|_| Failure::Died)?;
        let mut reply = Vec::new();
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            if let Some(end) = reply.iter().position(|&b| b == b'\n') {
                reply.truncate(end);
                return serde_json::from_slice(&reply).map_err(|_| Failure::Garbled);
            }
            if reply.len() > MAX_REPLY_BYTES {
                return Err(Failure::Garbled);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !readable(&self.stdout, left) {
                return Err(Failure::Timeout);
            }
            match self.stdout.read(&mut chunk) {
                Ok(0) | Err(_) => return Err(Failure::Died),
                Ok(n) => reply.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

enum Failure {
    Died,
    Timeout,
    Garbled,
}

/// Whether `pipe` has bytes (or end of file) to read within `timeout`.
fn readable(pipe: &ChildStdout, timeout: Duration) -> bool {
    let mut fd = libc::pollfd {
        fd: pipe.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    loop {
        // SAFETY: one valid pollfd, owned by this frame, for the duration of the call.
        let r = unsafe { libc::poll(&mut fd, 1, ms) };
        if r >= 0 {
            return r > 0;
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return false;
        }
    }
}

/// Renders `template` with `ctx` in a worker; errors are the cause alone (the caller names
/// the template's source).
pub(super) fn render(exe: &Path, template: &str, ctx: &minijinja::Value) -> Result<String> {
    let mut request = serde_json::to_vec(&Request {
        template: template.to_string(),
        ctx: serde_json::to_value(ctx).context("the template's context")?,
    })?;
    request.push(b'\n');
    // One second beyond the worker's own deadline, for its start and the round trip.
    let deadline = Instant::now() + Duration::from_secs(MAX_SECONDS + 1);
    // An idle worker may have died since (killed, or retired): one retry on a fresh one.
    let pooled = IDLE.lock().unwrap_or_else(|p| p.into_inner()).pop();
    let from_pool = pooled.is_some();
    let mut worker = match pooled {
        Some(w) => w,
        None => Worker::start(exe)?,
    };
    let mut reply = worker.ask(&request, deadline);
    if matches!(reply, Err(Failure::Died)) && from_pool {
        worker.discard();
        worker = Worker::start(exe)?;
        reply = worker.ask(&request, deadline);
    }
    match reply {
        Ok(reply) => {
            if !reply.retiring {
                let mut idle = IDLE.lock().unwrap_or_else(|p| p.into_inner());
                if idle.len() < MAX_IDLE {
                    idle.push(worker);
                    return reply.rendered.map_err(anyhow::Error::msg);
                }
            }
            worker.discard();
            reply.rendered.map_err(anyhow::Error::msg)
        }
        Err(Failure::Timeout) => {
            worker.discard();
            bail!("took longer than {MAX_SECONDS} s")
        }
        Err(Failure::Garbled) => {
            worker.discard();
            bail!("its renderer replied with something malformed")
        }
        Err(Failure::Died) => {
            let status = worker.discard();
            bail!(
                "crashed its renderer ({}): values nested too deep to print or free",
                status.map_or("no status".into(), |s| s.to_string())
            )
        }
    }
}

/// The first thing a binary that renders for others does: run as a template worker when
/// started as one (returns its exit code), else render this process's templates in
/// workers that are this executable.
pub fn enter() -> Option<ExitCode> {
    if std::env::args_os().nth(1).is_some_and(|a| a == WORKER_ARG) {
        return Some(serve_requests());
    }
    if let Ok(exe) = std::env::current_exe() {
        use_workers(exe);
    }
    None
}
