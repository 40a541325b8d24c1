//! `strata serve` over raw HTTP on the default model: malformed requests get OpenAI-style
//! JSON errors with the right status and the server keeps serving; SSE framing; API keys;
//! overload; a client that disconnects mid-stream frees every GPU page and host slot;
//! SIGTERM with requests in flight finishes them (or cancels them after the grace period)
//! and exits 0.

mod common;
mod live_server;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use live_server::{request_bytes, Server};
use serde_json::json;

fn chat_body(model: &str, content: &str, max_tokens: usize, stream: bool) -> serde_json::Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
}

/// Opens a streaming request and returns the reader once the response headers (and,
/// with `first_data`, the first `data:` line) have arrived.
fn open_stream(
    server: &Server,
    body: &serde_json::Value,
    first_data: bool,
) -> BufReader<TcpStream> {
    let mut s = server.connect();
    s.write_all(&request_bytes(
        "POST",
        "/v1/completions",
        &[],
        body.to_string().as_bytes(),
    ))
    .unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    if first_data {
        loop {
            line.clear();
            assert!(r.read_line(&mut line).unwrap() > 0, "stream ended early");
            if line.contains("data:") {
                break;
            }
        }
    }
    r
}

/// Reads a stream to its end and returns its `data:` payloads.
fn read_stream(mut r: BufReader<TcpStream>) -> Vec<String> {
    let mut out = Vec::new();
    let mut line = String::new();
    while r.read_line(&mut line).unwrap() > 0 {
        if let Some(i) = line.find("data:") {
            out.push(line[i + 5..].trim().to_string());
        }
        line.clear();
    }
    out
}

#[test]
fn malformed_requests_get_openai_errors_and_the_server_keeps_serving() {
    let server = Server::start(&common::require_default_model(), &[]);
    let m = server.model_name.clone();
    let chat = "/v1/chat/completions";
    let comp = "/v1/completions";

    // Malformed JSON, empty and non-UTF-8 bodies.
    for body in [&b"{\"model\": "[..], b"", b"\xff\xfe{}", b"[1, 2]"] {
        server.request("POST", chat, &[], body).expect_error(400);
    }
    // Wrong types and missing fields.
    for (path, body) in [
        (chat, json!({"model": m, "messages": "hi"})),
        (chat, json!({"model": m})),
        (
            chat,
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            chat,
            json!({"model": m, "messages": [{"content": "no role"}]}),
        ),
        (
            chat,
            json!({"model": m, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        ),
        (comp, json!({"model": m})),
        (comp, json!({"model": m, "prompt": 42})),
        (
            comp,
            json!({"model": m, "prompt": "x", "max_tokens": "ten"}),
        ),
        (comp, json!({"model": m, "prompt": "x", "max_tokens": -5})),
        (
            comp,
            json!({"model": m, "prompt": "x", "temperature": "hot"}),
        ),
        (comp, json!({"model": m, "prompt": "x", "stream": "yes"})),
        (comp, json!({"model": m, "prompt": "x", "stop": 7})),
        (comp, json!({"model": m, "prompt": "x", "n": 3})),
        (comp, json!({"model": m, "prompt": ""})),
        (comp, json!({"model": m, "prompt": ["a", "b"]})),
    ] {
        let r = server.post_json(path, &body);
        assert_eq!(r.status, 400, "{body} -> {}", r.text());
        r.expect_error(400);
    }
    // Log-probability fields out of range or of the wrong shape: a 400 naming the field,
    // never a 200 that drops them (a harness would read that as a missing score).
    for (path, body, param) in [
        (
            comp,
            json!({"model": m, "prompt": "x", "logprobs": 21}),
            "logprobs",
        ),
        (
            comp,
            json!({"model": m, "prompt": "x", "logprobs": true}),
            "logprobs",
        ),
        (
            comp,
            json!({"model": m, "prompt": "x", "echo": "yes", "max_tokens": 1}),
            "echo",
        ),
        (
            comp,
            json!({"model": m, "prompt": "x", "max_tokens": 0, "logprobs": 1}),
            "max_tokens",
        ),
        (
            chat,
            json!({"model": m, "messages": [{"role": "user", "content": "hi"}],
                   "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            chat,
            json!({"model": m, "messages": [{"role": "user", "content": "hi"}],
                   "top_logprobs": 3}),
            "top_logprobs",
        ),
        (
            chat,
            json!({"model": m, "messages": [{"role": "user", "content": "hi"}],
                   "echo": true}),
            "echo",
        ),
    ] {
        let r = server.post_json(path, &body);
        r.expect_error(400);
        let v: serde_json::Value = serde_json::from_str(&r.text()).unwrap();
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
    }
    // Prompt + max_tokens over the context: 400 naming both numbers.
    let msg = server
        .post_json(
            comp,
            &json!({"model": m, "prompt": "Hello there", "max_tokens": 1023}),
        )
        .expect_error(400);
    assert!(msg.contains("1023") && msg.contains("1024"), "{msg}");
    // Unknown model: 404. Unknown route: 404. Wrong method: 405.
    server
        .post_json(chat, &chat_body("gpt-4", "hi", 4, false))
        .expect_error(404);
    server.get("/v1/nothing").expect_error(404);
    server.get(chat).expect_error(405);
    // A body over the limit (1 MiB): 413, as JSON, and no hang.
    let huge = format!(
        "{{\"model\": \"{m}\", \"prompt\": \"{}\"}}",
        "a".repeat(2 << 20)
    );
    server
        .request("POST", comp, &[], huge.as_bytes())
        .expect_error(413);

    // Still serving, and SSE framing as OpenAI clients expect.
    let r = server.post_json(chat, &chat_body(&m, "Say hi", 6, true));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<serde_json::Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
    assert!(chunks[0]["choices"][0]["delta"]["role"] == "assistant");
    assert!(chunks[1..]
        .iter()
        .all(|c| c["choices"][0]["delta"].get("role").is_none()));
    let reasons: Vec<&serde_json::Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .collect();
    assert!(reasons[..reasons.len() - 1].iter().all(|r| r.is_null()));
    assert!(reasons.last().unwrap().is_string());
    assert_eq!(server.get("/health").status, 200);
}

#[test]
fn api_key_is_required_on_v1_when_set_and_overload_is_answered_429() {
    let server = Server::start(
        &common::require_default_model(),
        &["--api-key", "s3cret", "--max-pending-requests", "1"],
    );
    server.get("/v1/models").expect_error(401);
    server
        .request(
            "GET",
            "/v1/models",
            &[("Authorization", "Bearer wrong")],
            b"",
        )
        .expect_error(401);
    let ok = server.request(
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer s3cret")],
        b"",
    );
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json()["data"][0]["id"], server.model_name.as_str());
    assert_eq!(server.get("/health").status, 200, "health needs no key");

    // One request in flight fills the server: the next one gets 429 at once.
    let body = json!({"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 200, "stream": true});
    let mut s = server.connect();
    s.write_all(&request_bytes(
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer s3cret")],
        body.to_string().as_bytes(),
    ))
    .unwrap();
    let mut first = BufReader::new(s);
    let mut line = String::new();
    first.read_line(&mut line).unwrap();
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    let r = server.request(
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer s3cret")],
        body.to_string().as_bytes(),
    );
    r.expect_error(429);
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_every_page_and_slot() {
    // 64 pages of 16 tokens: two ~570-token prompts cannot both be resident, so the second
    // is preempted and offloaded to the host tier while the first streams.
    let server = Server::start(
        &common::require_default_model(),
        &["--num-gpu-blocks", "64", "--max-cpu-offload-blocks", "64"],
    );
    let body = |word: &str| {
        json!({"model": server.model_name, "prompt": format!("{word} {}", "the ".repeat(560)),
               "max_tokens": 400, "temperature": 0, "stream": true})
    };
    let a = open_stream(&server, &body("apple"), false);
    let b = open_stream(&server, &body("banana"), false);
    let t = Instant::now();
    loop {
        let m = server.metrics();
        let generated = m[&server.vllm("vllm:generation_tokens_total")];
        if m["strata:kv_blocks_stored_total"] > 0.0 && generated > 0.0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no offload happened: {m:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(a);
    drop(b);
    let t = Instant::now();
    let m = loop {
        let m = server.metrics();
        let (running, waiting) = (
            m[&server.vllm("vllm:num_requests_running")],
            m[&server.vllm("vllm:num_requests_waiting")],
        );
        if running == 0.0 && waiting == 0.0 {
            break m;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "requests not cancelled: {m:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(m["strata:num_requests_cancelled_total"], 2.0, "{m:?}");
    assert_eq!(m["strata:kv_cache_usage_perc{tier=\"gpu\"}"], 0.0, "{m:?}");
    assert_eq!(m["strata:kv_cache_usage_perc{tier=\"cpu\"}"], 0.0, "{m:?}");
    assert_eq!(
        m["strata:kv_cache_free_blocks{tier=\"gpu\"}"], 64.0,
        "{m:?}"
    );
    assert_eq!(
        m["strata:kv_cache_free_blocks{tier=\"cpu\"}"], 64.0,
        "{m:?}"
    );
    // And the engine still serves.
    let r = server.post_json(
        "/v1/completions",
        &json!({"model": server.model_name, "prompt": "Hello", "max_tokens": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn sigterm_finishes_requests_in_flight_then_exits_zero() {
    let mut server = Server::start(&common::require_default_model(), &[]);
    let body = json!({"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 12,
                      "temperature": 0, "stream": true});
    let r = open_stream(&server, &body, true);
    unsafe { libc::kill(server.pid() as i32, libc::SIGTERM) };
    let data = read_stream(r);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let last: serde_json::Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert!(
        matches!(
            last["choices"][0]["finish_reason"].as_str(),
            Some("length" | "stop")
        ),
        "{last}"
    );
    let status = server.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}");
}

#[test]
fn sigterm_cancels_what_is_still_running_after_the_grace_period_and_exits_zero() {
    let mut server = Server::start(
        &common::require_default_model(),
        &["--shutdown-timeout", "0"],
    );
    let body = json!({"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 900,
                      "temperature": 0, "stream": true});
    let r = open_stream(&server, &body, true);
    unsafe { libc::kill(server.pid() as i32, libc::SIGTERM) };
    let data = read_stream(r);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let last: serde_json::Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "abort", "{last}");
    let status = server.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}");
}
