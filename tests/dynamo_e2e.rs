//! NVIDIA Dynamo's frontend and KV router in front of two strata workers
//! (integrations/dynamo) on the default model, on one machine (tests/dynamo_e2e.py): the
//! KV router, fed by strata's own KV-cache events, sends ≥ 90% of follow-ups to the
//! worker caching their prefix (each strata's prefix-hit counters say so) and round-robin
//! clearly fewer; greedy text through Dynamo equals `strata generate`; killing one worker
//! mid-stream ends every stream cleanly and the other goes on serving.
//!
//! Needs Dynamo (`ai-dynamo`, `ai-dynamo-runtime` 1.6.1 and their dependencies; .ci/run
//! installs them, pinned) in `python3`, or in `$STRATA_TEST_PYTHON`. Without it the test
//! fails under CI=true and is skipped, loudly, elsewhere.

mod common;

use std::process::Command;

#[test]
fn the_kv_router_sends_follow_ups_to_the_worker_caching_their_prefix_and_survives_a_dead_worker() {
    let model = common::require_default_model();
    let Some(python) = common::python_with(
        "dynamo.frontend, dynamo.common.backend, aiohttp",
        "install Dynamo as .ci/run does (docs/distributed.md)",
    ) else {
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
