//! `strata bench serve --compare` on the real default model: with GPU blocks for a third of
//! the working set, preemption happens, and every request's tokens equal the unconstrained
//! run's, with host offload and with recomputation.

mod common;

use std::process::Command;

fn bench(extra: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["bench", "serve", "--model"])
        .arg(common::require_default_model())
        .args([
            "--num-seqs",
            "6",
            "--input-len",
            "32:96",
            "--output-len",
            "8:16",
            "--num-gpu-blocks",
            "12",
        ])
        .args(["--compare", "--json"])
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&stdout).unwrap()
}

#[test]
fn smollm2_tokens_survive_preemption_with_offload_and_recompute() {
    let offload = bench(&["--max-cpu-offload-blocks", "1000"]);
    assert_eq!(offload["compare_mismatches"], 0);
    assert!(offload["preemptions"].as_u64().unwrap() > 0, "{offload}");
    assert!(offload["blocks_stored"].as_u64().unwrap() > 0, "{offload}");
    assert_eq!(offload["recomputations"], 0);

    let recompute = bench(&["--max-cpu-offload-blocks", "0"]);
    assert_eq!(recompute["compare_mismatches"], 0);
    assert!(
        recompute["recomputations"].as_u64().unwrap() > 0,
        "{recompute}"
    );
    assert_eq!(recompute["blocks_stored"], 0);
}

#[test]
fn bad_ranges_are_one_line_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["bench", "serve", "--input-len", "5:2"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("A:B"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn shared_prefix_is_served_from_the_prefix_cache() {
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["bench", "serve", "--model"])
        .arg(common::require_default_model())
        .args([
            "--num-seqs",
            "4",
            "--input-len",
            "140:200",
            "--output-len",
            "4:8",
            "--shared-prefix",
            "128",
        ])
        .args(["--compare", "--json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    // Requests admitted together wait one round for the first one's shared chunk.
    assert!(v["prefix_hit_blocks"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["compare_mismatches"], 0);
}
