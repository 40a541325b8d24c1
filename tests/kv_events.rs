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

use std::process::Command;
use std::time::Duration;

use live_server::Server;

#[test]
fn a_vllm_format_subscriber_sees_stored_blocks_in_order_evictions_and_the_final_clear() {
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
