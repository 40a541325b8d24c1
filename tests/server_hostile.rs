//! `strata serve` under attack: a model file's hostile chat template, connection-level
//! abuse (idle and half-open connections, bodies that never end, half-closed clients) and
//! floods of huge prompts. After each, the server is alive and answers (docs/server.md
//! "Limits", docs/errors.md).

mod common;
mod live_server;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{free_port, scratch_dir, TinySpec};
use live_server::{HttpResponse, Server};
use serde_json::json;

/// The tiny model's context is 512 tokens.
const TINY_ARGS: &[&str] = &["--max-model-len", "256"];

/// The tiny model with `template` as its chat template (a file beside the model).
fn tiny_with_template(name: &str, template: &str) -> std::path::PathBuf {
    let dir = scratch_dir(name);
    TinySpec::llama().write(&dir, 5);
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "</s>"}"#,
    )
    .unwrap();
    std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
    dir
}

fn assert_serving(server: &Server) {
    assert_eq!(server.get("/health").status, 200);
    let r = server.post_json(
        "/v1/completions",
        &json!({"model": server.model_name, "prompt": "hello", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_template_nesting_values_past_any_stack_is_a_400_and_the_server_keeps_serving() {
    // 2.4 million list levels within the fuel and memory budgets: printing or dropping
    // them overflows a 256 MiB stack. In-process this killed the server.
    let nested = format!(
        "{{% set ns = namespace(x=[1]) %}}{{% for i in range(80) %}}{{% for j in range(100) %}}{{% set ns.x = ns.x{} %}}{{% endfor %}}{{% endfor %}}{{{{ ns.x }}}}",
        "|batch(1)".repeat(300)
    );
    let server = Server::start(&tiny_with_template("hostile_tpl", &nested), TINY_ARGS);
    for _ in 0..3 {
        let r = server.post_json(
            "/v1/chat/completions",
            &json!({"model": server.model_name, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}),
        );
        let msg = r.expect_error(400);
        assert!(msg.contains("crashed its renderer"), "{msg}");
        assert_serving(&server);
    }
}

/// Reads until the server closes (or `limit` passes: then whatever arrived).
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = Vec::new();
    let closed = s.read_to_end(&mut buf).is_ok();
    (buf, closed)
}

#[test]
fn idle_and_half_open_connections_are_closed_and_the_cap_answers_503() {
    let args = [
        TINY_ARGS,
        &["--max-connections", "8", "--header-read-timeout", "1"],
    ]
    .concat();
    let server = Server::start(&tiny_with_template("conn_cap", "{{ 'x' }}"), &args);
    // Once the server has let the health check of `start` go, all 8 slots are free. Fill
    // them with connections that send nothing, or half a request head.
    server.wait_held(0);
    let mut idle: Vec<TcpStream> = (0..8).map(|_| server.connect()).collect();
    idle[0]
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    server.wait_held(8);
    // One more is told why, at once, with an OpenAI-style error.
    let mut extra = server.connect();
    let (buf, closed) = read_until_closed(&mut extra, Duration::from_secs(5));
    assert!(closed, "the connection over the cap was left open");
    let r = HttpResponse::parse(&buf);
    assert!(r.expect_error(503).contains("--max-connections"));
    // The idle ones are closed by the header-read timeout...
    let start = Instant::now();
    for s in &mut idle {
        let (_, closed) = read_until_closed(s, Duration::from_secs(5));
        assert!(
            closed,
            "an idle connection outlived the header-read timeout"
        );
    }
    assert!(start.elapsed() < Duration::from_secs(3));
    // ...and a kept-alive connection idle between requests too.
    let mut kept = server.connect();
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (buf, closed) = read_until_closed(&mut kept, Duration::from_secs(5));
    assert!(closed, "a kept-alive connection outlived the idle timeout");
    assert_eq!(HttpResponse::parse(&buf).status, 200);
    assert_serving(&server);
}

#[test]
fn bodies_that_never_end_are_refused_and_half_closed_clients_answered() {
    let args = [TINY_ARGS, &["--body-read-timeout", "1"]].concat();
    let server = Server::start(&tiny_with_template("bodies", "{{ 'x' }}"), &args);
    let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n";
    // A declared length past the limit: 413 before any byte of the body (2^64 - 1 itself
    // is refused by the HTTP parser, hyper, with a 4xx of its own).
    for (length, status) in [("10000000000", Some(413)), ("18446744073709551615", None)] {
        let mut s = server.connect();
        s.write_all(format!("{head}Content-Length: {length}\r\n\r\n").as_bytes())
            .unwrap();
        let (buf, closed) = read_until_closed(&mut s, Duration::from_secs(5));
        assert!(closed, "Content-Length {length} was waited on");
        let r = HttpResponse::parse(&buf);
        match status {
            Some(code) => drop(r.expect_error(code)),
            None => assert!((400..500).contains(&r.status), "{r:?}"),
        }
    }
    // A chunk announcing 2^64 - 1 bytes, then silence: 408 when the body timeout is up.
    let mut s = server.connect();
    s.write_all(
        format!("{head}Transfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n{{\"model\"")
            .as_bytes(),
    )
    .unwrap();
    let start = Instant::now();
    let (buf, closed) = read_until_closed(&mut s, Duration::from_secs(10));
    assert!(closed && start.elapsed() < Duration::from_secs(5));
    HttpResponse::parse(&buf).expect_error(408);
    // A chunked body that keeps coming: 413 once it passes 1 MiB.
    let mut s = server.connect();
    s.write_all(format!("{head}Transfer-Encoding: chunked\r\n\r\n").as_bytes())
        .unwrap();
    let chunk = format!("{:x}\r\n{}\r\n", 64 << 10, "a".repeat(64 << 10));
    for _ in 0..20 {
        if s.write_all(chunk.as_bytes()).is_err() {
            break;
        }
    }
    let (buf, _) = read_until_closed(&mut s, Duration::from_secs(5));
    HttpResponse::parse(&buf).expect_error(413);
    // A client that half-closes after a complete request still gets its answer.
    let body = json!({"model": server.model_name, "prompt": "hello", "max_tokens": 2}).to_string();
    let mut s = server.connect();
    s.write_all(&live_server::request_bytes(
        "POST",
        "/v1/completions",
        &[],
        body.as_bytes(),
    ))
    .unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let (buf, _) = read_until_closed(&mut s, Duration::from_secs(30));
    let r = HttpResponse::parse(&buf);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_serving(&server);
}

#[test]
fn huge_prompts_are_tokenized_inside_admission_control() {
    let args = [TINY_ARGS, &["--max-pending-requests", "2"]].concat();
    let server = Server::start(&tiny_with_template("floods", "{{ 'x' }}"), &args);
    // 16 prompts of ~1 MiB at once: at most 2 are admitted to tokenization; the rest are
    // told 429 before any of their text is tokenized (before, every one was tokenized, then
    // refused 400 as too long, and none ever got 429).
    let prompt = "hello world ".repeat((1 << 20) / 12 - 100);
    let body = json!({"model": server.model_name, "prompt": prompt, "max_tokens": 1}).to_string();
    let statuses: Vec<u16> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..16)
            .map(|_| {
                scope.spawn(|| {
                    server
                        .request("POST", "/v1/completions", &[], body.as_bytes())
                        .status
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let overloaded = statuses.iter().filter(|&&s| s == 429).count();
    assert!(
        statuses.iter().all(|&s| s == 429 || s == 400),
        "{statuses:?}"
    );
    assert!(
        overloaded >= 8,
        "only {overloaded} of 16 were refused 429: {statuses:?}"
    );
    assert_serving(&server);
}

/// A copy of the default model served with `flags`, then cut to a tenth of its length.
fn serve_then_truncate(name: &str, flags: &[&str]) -> Server {
    let dir = scratch_dir(name);
    let model = dir.join("model.gguf");
    std::fs::copy(common::require_default_model(), &model).unwrap();
    let server = Server::start(&model, flags);
    assert_serving(&server);
    let len = std::fs::metadata(&model).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&model)
        .unwrap()
        .set_len(len / 10)
        .unwrap();
    server
}

#[test]
fn a_model_file_truncated_while_mapped_is_a_503_not_a_sigbus() {
    // `stored` computes on the file's mapped pages: after the cut, the next forward reads
    // pages the file no longer has.
    let mut server = serve_then_truncate("truncated_model", &["--dtype", "stored"]);
    let r = server.post_json(
        "/v1/completions",
        &json!({"model": server.model_name, "prompt": "hello", "max_tokens": 4}),
    );
    assert!(r.expect_error(503).contains("truncated"), "{r:?}");
    let health = server.get("/health");
    assert_eq!(health.status, 503);
    // Alive: it still answers, and exits cleanly on a signal.
    assert_eq!(server.get("/v1/models").status, 503);
    unsafe { libc::kill(server.pid() as i32, libc::SIGTERM) };
    let status = server.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}");
}

#[test]
fn the_default_mode_serves_on_after_its_model_file_is_truncated() {
    // `q8` (the CPU default) repacks every matrix of the default model at load and closes
    // the map: the file is not read again, so cutting it changes nothing.
    let server = serve_then_truncate("truncated_model_q8", &[]);
    let r = server.post_json(
        "/v1/completions",
        &json!({"model": server.model_name, "prompt": "hello", "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(server.get("/health").status, 200);
}

/// A connection that pipelines `n` requests for /metrics (several KB each, cheap to make)
/// and never reads a byte of the answers (its receive buffer shrunk; the server's send
/// buffer may grow to 4 MiB, so `n` must ask for far more than that for its writes to
/// stall).
fn pipeline_without_reading(server: &Server, n: usize) -> TcpStream {
    use std::os::fd::AsRawFd;
    let mut s = server.connect();
    let small: libc::c_int = 2048;
    // SAFETY: a valid socket and an int option of the right size.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    s.write_all(&b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(n))
        .unwrap();
    s
}

#[test]
fn clients_that_pipeline_and_never_read_lose_their_slots_after_the_timeout() {
    let args = [
        TINY_ARGS,
        &["--max-connections", "2", "--header-read-timeout", "1"],
    ]
    .concat();
    let server = Server::start(&tiny_with_template("pipeline", "{{ 'x' }}"), &args);
    server.wait_held(0);
    let _held: Vec<TcpStream> = (0..2)
        .map(|_| pipeline_without_reading(&server, 5000))
        .collect();
    server.wait_held(2);
    // Their answers (tens of MB each: far more than the buffers hold) fill the buffers,
    // the writes stall, and after the timeout (1 s) the server closes them.
    let start = Instant::now();
    loop {
        let mut s = server.connect();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let (buf, _) = read_until_closed(&mut s, Duration::from_secs(5));
        if HttpResponse::parse(&buf).status == 200 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "clients that never read held every connection slot for 20 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_serving(&server);
}

#[test]
fn clients_that_never_read_cannot_delay_shutdown_past_its_timeout() {
    // A stall timeout far longer than the shutdown's: the shutdown's bound alone must end
    // the connections.
    let args = [
        TINY_ARGS,
        &["--header-read-timeout", "120", "--shutdown-timeout", "1"],
    ]
    .concat();
    let mut server = Server::start(&tiny_with_template("pipeline_stop", "{{ 'x' }}"), &args);
    server.wait_held(0);
    let _held: Vec<TcpStream> = (0..4)
        .map(|_| pipeline_without_reading(&server, 5000))
        .collect();
    server.wait_held(4);
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: signalling the child we spawned.
    unsafe { libc::kill(server.pid() as libc::pid_t, libc::SIGTERM) };
    let start = Instant::now();
    assert!(server.wait_exit(Duration::from_secs(30)).success());
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "shutdown took {:?} with --shutdown-timeout 1",
        start.elapsed()
    );
}

#[test]
fn serve_outlives_a_closed_stdout_and_stderr() {
    use std::process::{Command, Stdio};
    // `strata serve | true` (and its log's reader gone too): the listening line and every
    // log line meet a closed pipe; the server must serve on regardless.
    let port = free_port();
    let model = tiny_with_template("closed_stdout", "{{ 'x' }}");
    let mut child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .arg("serve")
            .arg("--model")
            .arg(&model)
            .args(["--max-model-len", "256", "--port", &port.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    drop(child.0.stdout.take());
    drop(child.0.stderr.take());
    let addr = format!("127.0.0.1:{port}");
    let health = || {
        let mut s = TcpStream::connect(&addr).ok()?;
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .ok()?;
        let (buf, _) = read_until_closed(&mut s, Duration::from_secs(5));
        Some(HttpResponse::parse(&buf).status)
    };
    let start = Instant::now();
    while health() != Some(200) {
        assert!(child.0.try_wait().unwrap().is_none(), "serve died");
        assert!(start.elapsed() < Duration::from_secs(60), "never ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A request, and a shutdown, each of which logs.
    let mut s = TcpStream::connect(&addr).unwrap();
    let body = json!({"model": "closed_stdout", "prompt": "hi", "max_tokens": 2}).to_string();
    s.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .unwrap();
    let (buf, _) = read_until_closed(&mut s, Duration::from_secs(30));
    assert_eq!(HttpResponse::parse(&buf).status, 200);
    // SAFETY: signalling the child we spawned.
    unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

#[test]
fn chat_keeps_working_after_the_binary_is_replaced_on_disk() {
    use std::os::unix::fs::PermissionsExt;
    use std::process::{Command, Stdio};
    // An upgrade in place: the server's executable is deleted (or replaced) while it runs.
    // Template workers are the server's own image (`/proc/self/exe`), not the file at its
    // old path, so chat requests still render (they were 400s, with /health 200).
    let dir = scratch_dir("replaced_binary");
    let bin = dir.join("strata-copy");
    std::fs::copy(env!("CARGO_BIN_EXE_strata"), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let model = tiny_with_template("replaced_binary_model", "{{ messages[0]['content'] }}");
    let port = free_port();
    let child = KillOnDrop(
        Command::new(&bin)
            .arg("serve")
            .arg("--model")
            .arg(&model)
            .args(["--max-model-len", "256", "--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let addr = format!("127.0.0.1:{port}");
    let ask = |path: &str, body: &str| {
        let mut s = TcpStream::connect(&addr).ok()?;
        s.write_all(
            format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .ok()?;
        let (buf, _) = read_until_closed(&mut s, Duration::from_secs(30));
        Some(HttpResponse::parse(&buf))
    };
    let start = Instant::now();
    loop {
        let mut s = TcpStream::connect(&addr).ok();
        let ok = s.as_mut().is_some_and(|s| {
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .is_ok()
                && HttpResponse::parse(&read_until_closed(s, Duration::from_secs(5)).0).status
                    == 200
        });
        if ok {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "never ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::remove_file(&bin).unwrap();
    let chat = r#"{"model": "replaced_binary_model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}"#;
    // The idle workers started before are killed, so each rendering starts a new one.
    for _ in 0..3 {
        kill_children(child.0.id());
        let r = ask("/v1/chat/completions", chat).expect("an answer");
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

/// A server process ended with its test, failed or not.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Kills every child process of `pid` (its template workers).
fn kill_children(pid: u32) {
    let children = || -> Vec<i32> {
        let mut all = Vec::new();
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
            let path = task.unwrap().path().join("children");
            let text = std::fs::read_to_string(path).unwrap_or_default();
            all.extend(
                text.split_whitespace()
                    .filter_map(|c| c.parse::<i32>().ok()),
            );
        }
        all
    };
    for c in children() {
        // SAFETY: signalling a process by id.
        unsafe { libc::kill(c, libc::SIGKILL) };
    }
    // (They stay listed as zombies until the server reaps them: no waiting for that.)
    std::thread::sleep(Duration::from_millis(50));
}
