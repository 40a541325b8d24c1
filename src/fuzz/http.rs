//! The `http` target: structure-aware HTTP/1.1 requests against a live server in this
//! process (`server::spawn_in_process`, on the fuzzer's tiny model, its chat template from
//! the model's own files), over real sockets so connection-level behaviour is exercised
//! too: half-closed clients, pipelined requests, broken framing.
//!
//! A case is the raw bytes of what the client sends (`request`), and `half_close` when
//! the client shuts its side after sending. The contract checked after each case — any
//! breach is a panic, which the fuzzer records as a finding:
//! - the server answers a complete request head with a status line (or closes without a
//!   word only when the head never completed);
//! - a 4xx/5xx the server itself writes is an OpenAI error object (the HTTP parser's own
//!   refusals of unparseable heads, 400/414/431/505 with an empty body, aside);
//! - no 500 (an engine step failing on some input) and no answer slower than the limits;
//! - `/health` still answers 200 after the case (so no case keeps a connection slot: the
//!   server allows 8), and no task of the server panicked.
//!
//! The `http-pipelined` target (`run_pipelined`) sends several of those requests back to
//! back on one keep-alive connection, then either reads every answer or closes without
//! reading any (`no_read`). Besides each answer's contract: answers are whole and in
//! order, and a pipeline of valid requests is answered in full (a shorter run of answers
//! must end in an error or a `Connection: close`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rand::{rngs::StdRng, Rng};
use serde_json::{json, Value as J};

use super::{mutate, Case};

/// The served model name the base requests use.
const MODEL: &str = "fuzz";
/// Longest a case may take to be answered: beyond the server's own timeouts (1 s).
const ANSWER_WITHIN: Duration = Duration::from_secs(8);

/// The in-process server, started on first use.
fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| start_server().expect("starting the in-process server"))
}

fn start_server() -> Result<SocketAddr> {
    use clap::Parser;
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        serve: crate::server::ServeArgs,
    }
    let dir = std::env::temp_dir().join(format!("strata-fuzz-http-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    for (name, bytes) in &super::corpus::safetensors_cases()[0].files {
        std::fs::write(dir.join(name), bytes)?;
    }
    let args = Wrap::try_parse_from([
        "serve",
        "--port",
        "0",
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "64",
        "--max-num-seqs",
        "4",
        "--max-pending-requests",
        "64",
        // Few, so a connection slot never given back shows within a few cases.
        "--max-connections",
        "8",
        "--header-read-timeout",
        "1",
        "--body-read-timeout",
        "1",
    ])?
    .serve;
    let addr = crate::server::spawn_in_process(args, dir.clone())?;
    let start = Instant::now();
    while exchange(addr, GET_HEALTH, false)?.status != 200 {
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(60),
            "the in-process server never became ready"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Loaded (weights mapped, tokenizer and template read): the files can go, so no run
    // leaves a model directory behind in the temp dir.
    let _ = std::fs::remove_dir_all(&dir);
    Ok(addr)
}

const GET_HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

/// A request with a JSON body, its framing correct.
fn post(path: &str, body: &J) -> Vec<u8> {
    let body = body.to_string();
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Valid requests of every endpoint: the mutations start from each.
pub fn http_cases() -> Vec<Case> {
    let chat = |extra: J| {
        let mut b = json!({"model": MODEL, "max_tokens": 3,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello 🦀"}]});
        merge(&mut b, extra);
        post("/v1/chat/completions", &b)
    };
    let completion = |extra: J| {
        let mut b = json!({"model": MODEL, "max_tokens": 3, "prompt": "Once upon"});
        merge(&mut b, extra);
        post("/v1/completions", &b)
    };
    let requests = vec![
        chat(json!({})),
        chat(json!({"stream": true, "temperature": 0.7, "top_p": 0.9, "seed": 3})),
        chat(json!({"stop": ["\n", "."], "return_token_ids": true})),
        completion(json!({})),
        completion(json!({"prompt": [1, 2, 3], "stream": true})),
        completion(json!({"ignore_eos": true, "top_k": 5, "n": 1})),
        completion(json!({"logprobs": 5, "echo": true, "stream": true})),
        completion(json!({"prompt": [1, 2, 3], "max_tokens": 0, "echo": true, "logprobs": 1})),
        chat(json!({"logprobs": true, "top_logprobs": 3, "temperature": 0.5})),
        GET_HEALTH.to_vec(),
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
        b"GET /v1/strata/model_card HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
    ];
    requests
        .into_iter()
        .map(|r| Case {
            files: vec![("request".into(), r)],
        })
        .collect()
}

fn merge(into: &mut J, extra: J) {
    if let (Some(a), J::Object(b)) = (into.as_object_mut(), extra) {
        a.extend(b);
    }
}

/// The parts of a request the structure-aware mutations work on.
struct Parts {
    method: String,
    path: String,
    version: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    chunked: bool,
}

impl Parts {
    fn parse(raw: &[u8]) -> Option<Self> {
        let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = std::str::from_utf8(&raw[..end]).ok()?;
        let mut lines = head.split("\r\n");
        let mut first = lines.next()?.splitn(3, ' ');
        let (method, path, version) = (first.next()?, first.next()?, first.next()?);
        let headers = lines
            .filter_map(|l| l.split_once(": "))
            .filter(|(k, _)| !k.eq_ignore_ascii_case("content-length"))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Some(Self {
            method: method.into(),
            path: path.into(),
            version: version.into(),
            headers,
            body: raw[end + 4..].to_vec(),
            chunked: false,
        })
    }

    /// The bytes again, with a correct `Content-Length` (or chunked framing).
    fn to_bytes(&self, rng: &mut StdRng) -> Vec<u8> {
        let mut out = format!("{} {} {}\r\n", self.method, self.path, self.version);
        for (k, v) in &self.headers {
            out += &format!("{k}: {v}\r\n");
        }
        if self.chunked {
            out += "Transfer-Encoding: chunked\r\n\r\n";
            let mut out = out.into_bytes();
            let mut rest = &self.body[..];
            while !rest.is_empty() {
                let n = rng.random_range(1..=rest.len().min(64));
                out.extend_from_slice(format!("{n:x}\r\n").as_bytes());
                out.extend_from_slice(&rest[..n]);
                out.extend_from_slice(b"\r\n");
                rest = &rest[n..];
            }
            out.extend_from_slice(b"0\r\n\r\n");
            return out;
        }
        if !self.body.is_empty() || self.method == "POST" {
            out += &format!("Content-Length: {}\r\n", self.body.len());
        }
        out += "\r\n";
        let mut out = out.into_bytes();
        out.extend_from_slice(&self.body);
        out
    }
}

const METHODS: [&str; 6] = ["GET", "POST", "PUT", "DELETE", "OPTIONS", "BREW"];
const PATHS: [&str; 9] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/v1/../health",
    "/v1/completions?x=%00",
    "//v1/models",
    "*",
];
const HEADERS: [(&str, &str); 8] = [
    ("Authorization", "Bearer x"),
    ("Content-Type", "text/plain"),
    ("Expect", "100-continue"),
    ("Connection", "keep-alive"),
    ("Content-Encoding", "gzip"),
    ("Transfer-Encoding", "identity"),
    ("Content-Length", "18446744073709551615"),
    ("Content-Length", "-1"),
];

pub fn mutate_http(case: &mut Case, rng: &mut StdRng) {
    let raw = case.get("request").unwrap_or_default().to_vec();
    let out = match Parts::parse(&raw) {
        Some(mut p) if rng.random_range(0..10) < 9 => {
            match rng.random_range(0..10) {
                0..=4 => {
                    // The JSON body, structure-aware (most reach the handlers).
                    if let Ok(mut v) = serde_json::from_slice::<J>(&p.body) {
                        mutate::mutate_json(&mut v, rng);
                        p.body = v.to_string().into_bytes();
                    } else {
                        mutate::mutate_bytes(&mut p.body, rng);
                    }
                }
                5 => p.method = METHODS[rng.random_range(0..METHODS.len())].into(),
                6 => p.path = PATHS[rng.random_range(0..PATHS.len())].into(),
                7 => {
                    let (k, v) = HEADERS[rng.random_range(0..HEADERS.len())];
                    p.headers.push((k.into(), v.into()));
                }
                8 => p.chunked = true,
                _ => {
                    // A big body: a long string where the prompt or content was.
                    let big = "word ".repeat(rng.random_range(1..40_000));
                    if let Ok(mut v) = serde_json::from_slice::<J>(&p.body) {
                        if let Some(o) = v.as_object_mut() {
                            o.insert("prompt".into(), J::from(big));
                        }
                        p.body = v.to_string().into_bytes();
                    }
                }
            }
            p.to_bytes(rng)
        }
        _ => {
            // Raw framing: anything from a flipped byte to a cut head.
            let mut raw = raw;
            mutate::mutate_bytes(&mut raw, rng);
            raw
        }
    };
    case.set("request", out);
    if rng.random_range(0..8) == 0 {
        case.set("half_close", Vec::new());
    }
}

/// What came back on one connection.
struct Answer {
    status: u16,
    body: Vec<u8>,
    /// Bytes received at all.
    received: usize,
}

/// Sends `request` on a fresh connection and reads the answer (to the end of its body, or
/// until the server closes).
fn exchange(addr: SocketAddr, request: &[u8], half_close: bool) -> Result<Answer> {
    let mut s = TcpStream::connect(addr).context("connecting")?;
    s.set_read_timeout(Some(ANSWER_WITHIN))?;
    // The server may answer and close before reading all of a refused body.
    let _ = s.write_all(request);
    if half_close {
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
    let start = Instant::now();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 << 10];
    loop {
        if let Some(done) = complete(&buf) {
            buf.truncate(done);
            break;
        }
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::ConnectionReset) => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                anyhow::bail!("no answer within {:?}: {e}", start.elapsed())
            }
        }
    }
    let status = std::str::from_utf8(&buf[..buf.len().min(12)])
        .ok()
        .and_then(|l| {
            l.strip_prefix("HTTP/1.1 ")
                .or_else(|| l.strip_prefix("HTTP/1.0 "))
        })
        .and_then(|l| l.get(..3))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(Vec::new(), |e| buf[e + 4..].to_vec());
    Ok(Answer {
        status,
        body,
        received: buf.len(),
    })
}

/// The length of a complete response in `buf` (by Content-Length, or a chunked body's
/// last chunk), if it is complete.
fn complete(buf: &[u8]) -> Option<usize> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    if let Some(len) = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        return (buf.len() >= end + len).then_some(end + len);
    }
    if head.contains("transfer-encoding: chunked") {
        return buf[end..]
            .windows(5)
            .position(|w| w == b"0\r\n\r\n")
            .map(|p| end + p + 5);
    }
    None
}

/// Whether `request` holds a whole head and the whole body its head announces, as a
/// lenient reader sees it (chunked wins over a length; a bad length counts as complete: the
/// server refuses it at once).
fn framing_complete(request: &[u8]) -> bool {
    let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&request[..end]).to_ascii_lowercase();
    let body = &request[end + 4..];
    if head.contains("transfer-encoding") && head.contains("chunked") {
        return body.ends_with(b"0\r\n\r\n");
    }
    head.lines()
        .filter_map(|l| l.strip_prefix("content-length:"))
        .all(|v| v.trim().parse::<usize>().map_or(true, |n| body.len() >= n))
}

/// Runs one case and checks the contract (a breach panics: a finding).
pub fn run_http(case: &Case) -> Result<()> {
    let addr = server();
    let panics_before = super::panics_seen();
    let request = case.get("request").unwrap_or_default();
    let head_complete = request.windows(4).any(|w| w == b"\r\n\r\n");
    // A client that stops mid-head or mid-body says so by closing its side: the read
    // timeouts (tested on their own in tests/server_hostile.rs) would otherwise cost a
    // second a case, 1% of the cases taking 90% of the time.
    let half_close = case.get("half_close").is_some() || !framing_complete(request);
    let answer = exchange(addr, request, half_close);
    let answer = match answer {
        Ok(a) => a,
        Err(e) => panic!("the server did not answer: {e}"),
    };
    if answer.received == 0 {
        assert!(!head_complete, "a complete request head got no answer");
    } else {
        check_answer(answer.status, &answer.body);
    }
    check_health(addr);
    super::assert_no_panic_since(panics_before);
    Ok(())
}

/// One answer's contract: a status line, no 500, and a 4xx/5xx the server itself writes
/// is an OpenAI error object (the HTTP parser's own refusals of unparseable heads, with
/// an empty body, aside).
fn check_answer(status: u16, body: &[u8]) {
    assert!((100..600).contains(&status), "no status line in the answer");
    assert!(status != 500, "500: {}", String::from_utf8_lossy(body));
    if status >= 400 {
        let parser_refusal = body.is_empty() && matches!(status, 400 | 414 | 431 | 505);
        if !parser_refusal {
            let v: J = serde_json::from_slice(body).unwrap_or_else(|_| {
                panic!(
                    "{status} without a JSON error: {:?}",
                    String::from_utf8_lossy(body)
                )
            });
            assert!(
                v["error"]["message"].is_string()
                    && v["error"]["code"].as_u64() == Some(status as u64),
                "{status} is not an OpenAI error object: {v}"
            );
        }
    }
}

/// `/health` answers 200 after a case. A connection the case left behind may hold its
/// slot a moment longer (a generation finishing for a client that left): a 503 is
/// retried for a while; a slot never given back makes it permanent.
fn check_health(addr: SocketAddr) {
    let start = Instant::now();
    loop {
        let health = exchange(addr, GET_HEALTH, false).expect("health after a case");
        if health.status == 200 {
            return;
        }
        assert!(
            health.status == 503 && start.elapsed() < ANSWER_WITHIN,
            "the server stopped answering /health ({})",
            health.status
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

// ---------------------------------------------------------------------------------------
// pipelined requests

/// The base requests without `Connection: close`: valid keep-alive requests, each of which
/// must be answered wherever it stands in a pipeline.
fn keep_alive_requests() -> &'static [Vec<u8>] {
    static R: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    R.get_or_init(|| {
        http_cases()
            .iter()
            .filter_map(|c| c.get("request"))
            .map(|r| {
                String::from_utf8_lossy(r)
                    .replace("Connection: close\r\n", "")
                    .into_bytes()
            })
            .collect()
    })
}

/// The requests of a pipelined case, in order (`request0`, `request1`, ...).
fn pipeline(case: &Case) -> Vec<Vec<u8>> {
    (0..)
        .map_while(|i| case.get(&format!("request{i}")).map(<[u8]>::to_vec))
        .collect()
}

fn pipeline_case(requests: &[Vec<u8>]) -> Case {
    let mut c = Case::default();
    for (i, r) in requests.iter().enumerate() {
        c.set(&format!("request{i}"), r.clone());
    }
    c
}

/// Pipelines of the base requests: cheap ones, generations, streams, and both mixed.
pub fn pipelined_cases() -> Vec<Case> {
    let r = keep_alive_requests();
    // Indices into `http_cases()`: chats 0-2, completions 3-5, health, models, metrics, card.
    [
        &[6usize, 7, 8][..],
        &[0, 4, 6],
        &[3, 1, 9, 2],
        &[5, 5, 8, 7, 6],
    ]
    .iter()
    .map(|idx| pipeline_case(&idx.iter().map(|&i| r[i].clone()).collect::<Vec<_>>()))
    .collect()
}

/// Most requests in one pipeline.
const MAX_PIPELINE: usize = 64;

pub fn mutate_pipelined(case: &mut Case, rng: &mut StdRng) {
    let mut requests = pipeline(case);
    let no_read = case.get("no_read").is_some();
    let n = requests.len();
    match rng.random_range(0..10) {
        0..5 if n > 0 => {
            // One request changed as the `http` target changes it.
            let at = rng.random_range(0..n);
            let mut one = Case::default();
            one.set("request", std::mem::take(&mut requests[at]));
            mutate_http(&mut one, rng);
            requests[at] = one.get("request").unwrap_or_default().to_vec();
        }
        5 => {
            let good = keep_alive_requests();
            let at = rng.random_range(0..=n);
            requests.insert(at, good[rng.random_range(0..good.len())].clone());
        }
        6 if n > 1 => {
            requests.remove(rng.random_range(0..n));
        }
        7 if n > 0 => {
            // The same request many times over.
            let at = rng.random_range(0..n);
            let times = rng.random_range(2..=MAX_PIPELINE / 2);
            let again = vec![requests[at].clone(); times];
            requests.splice(at..at, again);
        }
        8 if n > 1 => {
            let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
            requests.swap(a, b);
        }
        _ => {
            let mut c = pipeline_case(&requests);
            if !no_read {
                c.set("no_read", Vec::new());
            }
            *case = c;
            return;
        }
    }
    requests.truncate(MAX_PIPELINE);
    let mut c = pipeline_case(&requests);
    if no_read {
        c.set("no_read", Vec::new());
    }
    *case = c;
}

/// Runs one pipelined case and checks the contract (module doc).
pub fn run_pipelined(case: &Case) -> Result<()> {
    let addr = server();
    let panics_before = super::panics_seen();
    let requests = pipeline(case);
    let mut s = TcpStream::connect(addr).context("connecting")?;
    s.set_read_timeout(Some(ANSWER_WITHIN))?;
    // The server may answer and close before reading all of it (a refusal).
    let _ = s.write_all(&requests.concat());
    if case.get("no_read").is_some() {
        drop(s);
    } else {
        let _ = s.shutdown(std::net::Shutdown::Write);
        let received = super::read_until_closed(&mut s, ANSWER_WITHIN)
            .unwrap_or_else(|e| panic!("the server did not finish the pipeline: {e}"));
        check_pipeline(&requests, &received);
    }
    check_health(addr);
    super::assert_no_panic_since(panics_before);
    Ok(())
}

/// The length of the whole answer at the front of `buf`: an interim `1xx` is its head.
fn answer_len(buf: &[u8]) -> Option<usize> {
    let interim = buf.starts_with(b"HTTP/1.1 1") || buf.starts_with(b"HTTP/1.0 1");
    match buf.windows(4).position(|w| w == b"\r\n\r\n") {
        Some(end) if interim => Some(end + 4),
        _ => complete(buf),
    }
}

/// The answers to a pipeline: whole, each within its contract, and as many as the
/// requests where every request was a valid keep-alive one.
fn check_pipeline(requests: &[Vec<u8>], received: &[u8]) {
    let mut rest = received;
    // (status, whether its head says the connection closes)
    let mut answers: Vec<(u16, bool)> = Vec::new();
    while !rest.is_empty() {
        let len = answer_len(rest).unwrap_or_else(|| {
            panic!(
                "a cut answer after {} whole ones: {:?}",
                answers.len(),
                String::from_utf8_lossy(&rest[..rest.len().min(200)])
            )
        });
        let (answer, tail) = rest.split_at(len);
        let head_end = answer
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or(0);
        let head = String::from_utf8_lossy(&answer[..head_end]).to_ascii_lowercase();
        let status = head
            .strip_prefix("http/1.1 ")
            .or_else(|| head.strip_prefix("http/1.0 "))
            .and_then(|l| l.get(..3))
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        check_answer(status, &answer[head_end + 4..]);
        if status >= 200 {
            answers.push((status, head.contains("\r\nconnection: close")));
        }
        rest = tail;
    }
    let good = keep_alive_requests();
    let valid = requests.iter().take_while(|r| good.contains(r)).count();
    let answered_all_so_far = answers
        .iter()
        .take(valid)
        .all(|&(st, close)| st < 400 && !close);
    assert!(
        answers.len() >= valid || !answered_all_so_far,
        "{} of the pipeline's first {valid} valid requests answered, the last without an \
         error or a close",
        answers.len()
    );
}

#[cfg(test)]
mod tests {
    use super::{check_pipeline, framing_complete, keep_alive_requests};

    #[test]
    fn a_valid_pipeline_answered_short_without_a_reason_is_a_breach() {
        let good = keep_alive_requests();
        let three = [good[6].clone(), good[7].clone(), good[8].clone()];
        let ok = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        let closed = "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}";
        let interim = "HTTP/1.1 100 Continue\r\n\r\n";
        check_pipeline(&three, ok.repeat(3).as_bytes());
        check_pipeline(&three, format!("{interim}{ok}{closed}").as_bytes());
        for bad in [ok.repeat(2), format!("{ok}{}", &ok[..ok.len() - 1])] {
            let r = std::panic::catch_unwind(|| check_pipeline(&three, bad.as_bytes()));
            assert!(r.is_err(), "{bad:?} passed");
        }
        // A mutated request in the middle excuses what follows it.
        let mutated = [
            good[6].clone(),
            b"BREW / HTTP/1.1\r\n\r\n".to_vec(),
            good[8].clone(),
        ];
        check_pipeline(&mutated, ok.as_bytes());
    }

    #[test]
    fn framing_is_complete_only_with_the_whole_announced_body() {
        let h = "POST / HTTP/1.1\r\nHost: x\r\n";
        let with = |extra: &str, body: &str| format!("{h}{extra}\r\n{body}").into_bytes();
        assert!(!framing_complete(b"POST / HTTP/1.1\r\nHost: x\r\n"));
        assert!(framing_complete(&with("", "")));
        assert!(framing_complete(&with("Content-Length: 2\r\n", "{}")));
        assert!(!framing_complete(&with("Content-Length: 3\r\n", "{}")));
        assert!(!framing_complete(&with(
            "Content-Length: 2\r\nContent-Length: 9\r\n",
            "{}"
        )));
        assert!(framing_complete(&with("Content-Length: -1\r\n", "")));
        let chunked = "Transfer-Encoding: chunked\r\nContent-Length: 1\r\n";
        assert!(!framing_complete(&with(chunked, "2\r\n{}\r\n")));
        assert!(framing_complete(&with(chunked, "2\r\n{}\r\n0\r\n\r\n")));
    }
}
