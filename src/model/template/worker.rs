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
use super::RendererUnavailable;

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
/// Why the last rendering could not run, and when; `None` after one that ran.
static UNAVAILABLE: Mutex<Option<(Instant, String)>> = Mutex::new(None);

fn set_unavailable(why: Option<String>) {
    *UNAVAILABLE.lock().unwrap_or_else(|p| p.into_inner()) = why.map(|w| (Instant::now(), w));
}

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
    /// The rendering could not run at all (`RendererUnavailable`: no thread for it).
    #[serde(default)]
    unavailable: bool,
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
            .and_then(|r| super::render_here(r.template, minijinja::Value::from_serialize(&r.ctx)));
        let unavailable = rendered
            .as_ref()
            .is_err_and(|e| e.is::<RendererUnavailable>());
        let retiring = crate::bounded::abandoned() > 0;
        let reply = Reply {
            rendered: rendered.map_err(|e| match e.downcast_ref::<RendererUnavailable>() {
                Some(r) => r.0.clone(),
                None => format!("{e:#}"),
            }),
            retiring,
            unavailable,
        };
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
    /// Starts a worker; a failure is `RendererUnavailable` (remembered for `available`).
    fn start(exe: &Path) -> Result<Self> {
        let started = Command::new(exe)
            .arg(WORKER_ARG)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // A dying worker's own message (e.g. a stack overflow) is reported here, once.
            .stderr(Stdio::null())
            .spawn();
        let mut child = started.map_err(|e| {
            let why = format!(
                "no template worker could be started: {e} ({})",
                exe.display()
            );
            set_unavailable(Some(why.clone()));
            anyhow::Error::new(RendererUnavailable(why))
        })?;
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
        Ok(reply) if reply.unavailable => {
            worker.discard();
            let why = reply.rendered.err().unwrap_or_default();
            set_unavailable(Some(why.clone()));
            Err(anyhow::Error::new(RendererUnavailable(why)))
        }
        Ok(reply) => {
            set_unavailable(None);
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

/// Whether templates can be rendered: `Err(why)` while workers cannot be started. After a
/// failed start it tries again (at most once a second), so the answer recovers with the
/// condition, not only when the next chat request comes.
pub fn available() -> Result<(), String> {
    let Some(exe) = exe() else {
        return Ok(()); // rendering on a thread of this process
    };
    // The first call probes, so the answer is true before any request has failed.
    static PROBED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let first = !PROBED.swap(true, std::sync::atomic::Ordering::AcqRel);
    let failed = UNAVAILABLE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    match failed {
        None if !first => Ok(()),
        None => probe(exe),
        Some((at, why)) if at.elapsed() < Duration::from_secs(1) => Err(why),
        Some(_) => probe(exe),
    }
}

/// A trivial rendering through a worker, as a request's would run.
fn probe(exe: &Path) -> Result<(), String> {
    render(exe, "ok", &minijinja::Value::UNDEFINED)
        .map(drop)
        .map_err(|e| match e.downcast_ref::<RendererUnavailable>() {
            Some(r) => r.0.clone(),
            None => format!("{e:#}"),
        })
}

/// The executable workers run: this process's own image. On Linux `/proc/self/exe`, which
/// names the running file even after it was replaced or deleted on disk (an upgrade in
/// place), and keeps workers at the server's own version; elsewhere its path.
fn own_executable() -> Option<PathBuf> {
    let proc_exe = Path::new("/proc/self/exe");
    if proc_exe.exists() {
        return Some(proc_exe.to_path_buf());
    }
    std::env::current_exe().ok()
}

/// The first thing a binary that renders for others does: run as a template worker when
/// started as one (returns its exit code), else render this process's templates in
/// workers that are this executable.
pub fn enter() -> Option<ExitCode> {
    if std::env::args_os().nth(1).is_some_and(|a| a == WORKER_ARG) {
        return Some(serve_requests());
    }
    if let Some(exe) = own_executable() {
        use_workers(exe);
    }
    None
}
