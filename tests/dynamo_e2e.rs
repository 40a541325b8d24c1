//! NVIDIA Dynamo's frontend and KV router in front of two strata workers
//! (integrations/dynamo) on the default model, on one machine (tests/dynamo_e2e.py): the
//! KV router, fed by strata's own KV-cache events, sends follow-ups to the worker caching
//! their prefix (each strata's prefix-hit counters say so) and round-robin clearly fewer;
//! on the operator's workload (10 documents × 5 questions, 4 concurrent sessions) ≥ 90% of
//! follow-ups land on the holder, no worker takes > 65%, and follow-up TTFT p90 beats
//! round-robin's ≥ 2×; greedy text through Dynamo equals `strata generate`; a hung strata's
//! worker leaves the pool by itself; killing a worker or its strata under load ends every
//! stream cleanly and no request fails later than 3 s after the kill.
//!
//! Needs Dynamo (`ai-dynamo`, `ai-dynamo-runtime` 1.6.1 and their dependencies; .ci/run
//! installs them, pinned) in `python3`, or in `$STRATA_TEST_PYTHON`. Without it the test
//! fails under CI=true and is skipped, loudly, elsewhere.

mod common;

use std::process::Command;

/// Held by each test for its whole run: the two start Dynamo stacks and strata servers of
/// their own, and on a 2-core machine the second one's load made the first one's routing
/// numbers a measure of the contention (33/40 follow-ups on the holder while the
/// walkthrough ran beside it, 40/40 alone).
static ONE_STACK_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A Python with Dynamo (see the module's note), or `None` (then the test is skipped).
fn dynamo_python() -> Option<String> {
    common::python_with(
        "dynamo.frontend, dynamo.common.backend, aiohttp",
        "install Dynamo as .ci/run does (docs/distributed.md)",
    )
}

#[test]
fn the_kv_router_keeps_follow_ups_on_their_prefix_holder_balances_and_survives_dead_workers() {
    let _alone = ONE_STACK_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let model = common::require_default_model();
    let Some(python) = dynamo_python() else {
        return;
    };
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new(&python)
        .arg(format!("{root}/tests/dynamo_e2e.py"))
        .args(["--strata", env!("CARGO_BIN_EXE_strata")])
        .arg("--model")
        .arg(&model)
        .args(["--integration", &format!("{root}/integrations/dynamo")])
        .output()
        .expect("running the Dynamo end-to-end script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "dynamo_e2e.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The measured routing numbers, for the log (docs/distributed.md quotes them).
    for line in stdout.lines().filter(|l| l.starts_with("RESULT ")) {
        eprintln!("{line}");
    }
}

#[test]
fn the_one_script_walkthrough_serves_a_request_and_leaves_nothing_behind() {
    // integrations/dynamo/run-local.sh --once, as the README runs it, with the test's
    // Dynamo environment instead of a fresh virtual environment (the install is .ci/run's,
    // from the same pinned requirement files).
    let _alone = ONE_STACK_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let model = common::require_default_model();
    let Some(python) = dynamo_python() else {
        return;
    };
    let root = env!("CARGO_MANIFEST_DIR");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = Command::new(format!("{root}/integrations/dynamo/run-local.sh"))
        .args(["--once", "--port", &port.to_string()])
        .arg("--model")
        .arg(&model)
        .env("STRATA_DYNAMO_PYTHON", &python)
        .output()
        .expect("running run-local.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "run-local.sh failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("ready: model"), "{stdout}");
    let answer = stdout
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no completion in:\n{stdout}"));
    let v: serde_json::Value = serde_json::from_str(answer).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 16, "{v}");
    assert!(stdout.contains("nothing left running"), "{stdout}");
    // Its state directory (named in the output) is gone, and nothing listens on its port.
    let state = stdout
        .split("(logs: ")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .expect("the state directory is named");
    assert!(!std::path::Path::new(state).exists(), "{state} left behind");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the frontend still listens on {port}"
    );
}
