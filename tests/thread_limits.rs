//! `strata serve` under a process/thread limit (`RLIMIT_NPROC`): every limit ends in one of
//! two truthful states — the server refuses to start with one `error: cannot start a
//! thread …` line (exit 1, no panic, no hang), or it serves and `/health` says exactly
//! what it can do: 200 only when chat and completions both answer, 503 (not "still
//! loading" for ever, not a 400) when they cannot. Before, a low limit left a panicked
//! loader and a server "still loading" for ever, or a health of 200 over requests that all
//! failed.
//!
//! The limit counts every thread of the user, and root ignores it: the server runs as
//! `nobody` (uid 65534) through `setpriv`, from copies of the binary and a tiny model
//! that user can read. Where that is not possible (not root, no `setpriv`) the test says
//! so and does nothing, except under `CI=true`, where it fails.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, TinySpec};

const NOBODY: &str = "65534";

fn can_drop_to_nobody() -> bool {
    // SAFETY: geteuid reads the process's own id.
    let root = unsafe { libc::geteuid() } == 0;
    let setpriv = Command::new("setpriv")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    root && setpriv
}

/// A world-readable directory holding a copy of the binary and the tiny model.
fn world_readable_copy() -> (PathBuf, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("strata-nproc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    TinySpec::llama().write(&model, 5);
    std::fs::write(
        model.join("tokenizer_config.json"),
        r#"{"eos_token": "</s>", "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}"#,
    )
    .unwrap();
    let bin = dir.join("strata");
    std::fs::copy(env!("CARGO_BIN_EXE_strata"), &bin).unwrap();
    for p in [&dir, &model] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    for e in std::fs::read_dir(&model).unwrap() {
        let p = e.unwrap().path();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    (bin, model)
}

/// `(status, body)` of one request, `None` if the server does not answer.
fn request(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

/// Runs the server as nobody under `--nproc n` and checks the contract; returns what it
/// saw, for the summary.
fn check_limit(bin: &Path, model: &Path, n: usize) -> String {
    let port = free_port();
    let mut child = Command::new("setpriv")
        .args(["--reuid", NOBODY, "--regid", NOBODY, "--clear-groups", "--"])
        .arg("prlimit")
        .arg(format!("--nproc={n}"))
        .arg(bin)
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--max-model-len", "128", "--port", &port.to_string()])
        .env("RUST_BACKTRACE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let health = loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            assert!(!err.contains("panicked"), "nproc {n}: {err}");
            assert_eq!(status.code(), Some(1), "nproc {n}: {err}");
            let lines: Vec<&str> = err.lines().collect();
            assert_eq!(lines.len(), 1, "nproc {n}: {err}");
            assert!(
                lines[0].starts_with("error: cannot start a thread"),
                "nproc {n}: {err}"
            );
            return "refused to start".into();
        }
        match request(port, "GET", "/health", "") {
            Some((200, _)) => break 200,
            Some((503, body)) if !body.contains("still loading") => break 503,
            _ => {}
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "nproc {n}: neither serving nor refusing after 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let chat = request(
        port,
        "POST",
        "/v1/chat/completions",
        r#"{"model": "model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}"#,
    );
    let completion = request(
        port,
        "POST",
        "/v1/completions",
        r#"{"model": "model", "max_tokens": 2, "prompt": "hi"}"#,
    );
    let (chat, completion) = (chat.map(|c| c.0), completion.map(|c| c.0));
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "nproc {n}: {err}");
    if health == 200 {
        assert_eq!(
            (chat, completion),
            (Some(200), Some(200)),
            "nproc {n}: healthy but not serving"
        );
    } else {
        assert_ne!(chat, Some(200), "nproc {n}: 503 health over a working chat");
        assert_ne!(
            chat,
            Some(400),
            "nproc {n}: the server's condition answered as a 400"
        );
    }
    format!("health {health}, chat {chat:?}, completions {completion:?}")
}

#[test]
fn under_any_thread_limit_serve_refuses_in_one_line_or_serves_with_a_truthful_health() {
    if !can_drop_to_nobody() {
        let why = "needs root and setpriv to run the server as another user";
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{why}");
        eprintln!("skipped: {why}");
        return;
    }
    let (bin, model) = world_readable_copy();
    let mut seen = Vec::new();
    for n in 1..=24 {
        seen.push(format!("nproc {n}: {}", check_limit(&bin, &model, n)));
    }
    let _ = std::fs::remove_dir_all(bin.parent().unwrap());
    eprintln!("{}", seen.join("\n"));
    // The sweep crosses from refusing to start, to serving in full.
    assert!(
        seen.first().unwrap().ends_with("refused to start"),
        "{seen:?}"
    );
    assert!(seen.last().unwrap().contains("health 200"), "{seen:?}");
}
