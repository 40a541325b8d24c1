//! `strata serve --kv-events-endpoint`: a subscriber written from vLLM's wire format alone
//! (tests/kv_events_subscriber.py, pyzmq + msgpack) decodes strata's KV-cache events: a
//! prompt of k full blocks yields BlockStored events carrying those blocks' token ids in
//! order with the configured block size, a shared prefix chains to the same hashes,
//! evictions yield BlockRemoved, shutdown AllBlocksCleared.
//!
//! Needs `pip install pyzmq msgpack` (.ci/run installs pinned versions). Without them the
//! test fails under CI=true and is skipped, loudly, elsewhere.

mod common;
mod live_server;

use std::io::Write;
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use live_server::Server;

/// Starts `strata serve` publishing KV events, lets `before_subscriber` do what it will
/// to the event port, then runs the vLLM-format subscriber against it and checks it
/// passes and the server stops cleanly.
fn subscriber_passes_after(before_subscriber: impl FnOnce(&str, &Server)) {
    let model = common::require_default_model();
    let Some(python) = common::python_with("zmq, msgpack", "pip install pyzmq msgpack") else {
        return;
    };
    // 40 pages of 16 tokens: a handful of 128-token prompts fills them.
    let gpu_blocks = "40";
    let mut server = Server::start(
        &model,
        &[
            "--max-model-len",
            "512",
            "--num-gpu-blocks",
            gpu_blocks,
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-topic",
            "strata-test",
        ],
    );
    let models = server.get("/v1/models").json();
    let info = &models["data"][0];
    let endpoint = info["kv_events"]["endpoint"].as_str().unwrap().to_string();
    assert_eq!(info["kv_events"]["topic"], "strata-test");
    assert_eq!(info["kv_cache_block_size"], 16);
    before_subscriber(&endpoint, &server);
    let out = Command::new(&python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/kv_events_subscriber.py"
        ))
        .args(["--events", &endpoint, "--topic", "strata-test"])
        .args(["--base-url", &format!("http://{}", server.addr)])
        .args(["--model", &server.model_name, "--block-size", "16"])
        .args(["--gpu-blocks", gpu_blocks])
        .args(["--pid", &server.pid().to_string()])
        .output()
        .expect("running python3");
    assert!(
        out.status.success(),
        "kv_events_subscriber.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(server.wait_exit(Duration::from_secs(30)).success());
}

#[test]
fn a_vllm_format_subscriber_sees_stored_blocks_in_order_evictions_and_the_final_clear() {
    subscriber_passes_after(|_, _| {});
}

/// A ZMTP 3 greeting (NULL mechanism) as a subscriber sends it.
fn zmtp_greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

#[test]
fn hostile_peers_on_the_event_port_neither_kill_the_server_nor_keep_a_subscriber_out() {
    // What aborted or starved `strata serve` when its PUB socket was the zeromq crate's:
    // 73 bytes declaring a 2^62-byte frame, 300 silent connections held open, and
    // subscriptions of 1 MiB each. The server must live, stay healthy and serve the
    // subscriber that comes after them, while the silent connections are still open.
    let mut held = Vec::new();
    subscriber_passes_after(|endpoint, server| {
        let addr = endpoint.strip_prefix("tcp://").unwrap();
        let mut packet = zmtp_greeting();
        packet.push(0x06);
        packet.extend_from_slice(&(1u64 << 62).to_be_bytes());
        assert_eq!(packet.len(), 73);
        let mut bomb = TcpStream::connect(addr).unwrap();
        bomb.write_all(&packet).unwrap();
        for _ in 0..300 {
            held.push(TcpStream::connect(addr).unwrap());
        }
        let mut flood = TcpStream::connect(addr).unwrap();
        flood.write_all(&zmtp_greeting()).unwrap();
        flood
            .write_all(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB")
            .unwrap();
        let mut sub = vec![0x02];
        sub.extend_from_slice(&((1u64 << 20) + 1).to_be_bytes());
        sub.push(1);
        sub.extend(vec![b'x'; 1 << 20]);
        for _ in 0..16 {
            if flood.write_all(&sub).is_err() {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(server.get("/health").status, 200);
        let m = server.metrics();
        assert!(m["strata:kv_event_peers"] <= 64.0, "{m:?}");
        assert!(
            m["strata:kv_event_peers_disconnected_total"] >= 2.0,
            "{m:?}"
        );
    });
}

#[test]
fn a_publisher_connects_to_a_libzmq_subscriber_that_bound_where_vllm_would() {
    // `--kv-events-endpoint tcp://127.0.0.1:PORT` names one host: vLLM's PUB connects
    // there, to a SUB that bound it (a central collector); strata's does too. The SUB
    // here is libzmq's (pyzmq), so the dialling side's handshake is checked against it.
    let model = common::require_default_model();
    let Some(python) = common::python_with("zmq, msgpack", "pip install pyzmq msgpack") else {
        return;
    };
    let script = r#"
import json, sys, msgpack, zmq
s = zmq.Context.instance().socket(zmq.SUB)
s.setsockopt(zmq.SUBSCRIBE, b"")
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
if not s.poll(60000):
    sys.exit("no message within 60 s")
topic, seq, payload = s.recv_multipart()
ts, events, rank = msgpack.unpackb(payload)
print(json.dumps(events[0]), flush=True)
"#;
    let mut sub = Command::new(&python)
        .args(["-c", script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("running python");
    let mut out = std::io::BufReader::new(sub.stdout.take().unwrap());
    let mut port = String::new();
    std::io::BufRead::read_line(&mut out, &mut port).unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", port.trim());
    let server = Server::start(
        &model,
        &["--max-model-len", "512", "--kv-events-endpoint", &endpoint],
    );
    let info = server.get("/v1/models").json();
    assert_eq!(info["data"][0]["kv_events"]["endpoint"], endpoint.as_str());
    let prompt: Vec<u32> = (1000..1040).collect();
    let r = server.post_json(
        "/v1/completions",
        &serde_json::json!({"model": server.model_name, "prompt": prompt, "max_tokens": 1}),
    );
    assert_eq!(r.status, 200);
    let mut first = String::new();
    std::io::BufRead::read_line(&mut out, &mut first).unwrap();
    assert!(sub.wait().unwrap().success(), "the SUB got nothing");
    let event: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert_eq!(event["type"], "BlockStored", "{event}");
    assert_eq!(
        event["token_ids"],
        serde_json::json!(prompt[..32]),
        "{event}"
    );
}

/// vLLM's replay protocol from a libzmq DEALER (tests/kv_events_replay.py) against a
/// server keeping `buffer` batches.
fn replay_passes_with_buffer(buffer: usize) {
    let model = common::require_default_model();
    let Some(python) = common::python_with("zmq", "pip install pyzmq") else {
        return;
    };
    let buffer = buffer.to_string();
    let server = Server::start(
        &model,
        &[
            "--max-model-len",
            "512",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-topic",
            "replayed",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-replay-buffer",
            &buffer,
        ],
    );
    let models = server.get("/v1/models").json();
    let kv = &models["data"][0]["kv_events"];
    let replay = kv["replay_endpoint"]
        .as_str()
        .expect("the replay endpoint is listed");
    assert!(
        replay.starts_with("tcp://127.0.0.1:") && !replay.ends_with(":0"),
        "{kv}"
    );
    let out = Command::new(&python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/kv_events_replay.py"
        ))
        .args([
            "--events",
            kv["endpoint"].as_str().unwrap(),
            "--replay",
            replay,
        ])
        .args(["--topic", "replayed", "--model", &server.model_name])
        .args([
            "--base-url",
            &format!("http://{}", server.addr),
            "--buffer",
            &buffer,
        ])
        .output()
        .expect("running python3");
    assert!(
        out.status.success(),
        "kv_events_replay.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_libzmq_dealer_replays_what_the_publisher_sent_as_vllm_s_replay_socket_answers() {
    replay_passes_with_buffer(10_000);
}

#[test]
fn the_replay_buffer_keeps_only_the_newest_batches() {
    replay_passes_with_buffer(3);
}
