//! The needle binary on the real default model: retrieval at 1K and 2K tokens with and
//! without offload (and token-for-token agreement), a repeats run in one process, exact
//! haystack lengths, and clear errors for bad arguments.

mod common;

use std::process::Command;

use strata::model::Model;
use strata::needle::{Case, NeedleKind};

fn needle(args: &[&str]) -> (bool, String, String) {
    needle_on(&common::require_default_model(), args)
}

fn needle_on(model: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_needle"))
        .arg("--model")
        .arg(model)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn found_at_every_depth_with_and_without_offload() {
    let (ok, stdout, stderr) = needle(&[
        "--input-len",
        "1024,2048",
        "--depth",
        "0.1,0.5,0.9",
        "--compare-offload",
        "--block-size",
        "128",
        "--json",
    ]);
    let v: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout} {stderr}"));
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 6);
    for c in cases {
        assert_eq!(c["passed"], true, "{c}");
        assert_eq!(c["tokens_agree"], true, "{c}");
        assert_eq!(c["max_logprob_diff"], 0.0, "{c}");
        assert!(
            c["answer"]
                .as_str()
                .unwrap()
                .contains(c["value"].as_str().unwrap()),
            "{c}"
        );
    }
    assert!(ok, "{stderr}");
}

#[test]
fn repeats_in_one_process_pass() {
    let (ok, stdout, stderr) = needle(&[
        "--input-len",
        "1024",
        "--depth",
        "0.2,0.8",
        "--enable-offload",
        "--repeats",
        "3",
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("6 passed, 0 failed"), "{stdout}");
}

#[test]
fn haystacks_have_exactly_the_asked_length() {
    let (_, tok) = Model::load(&common::require_default_model(), false).unwrap();
    for kind in [
        NeedleKind::MagicNumber,
        NeedleKind::Uuid,
        NeedleKind::MultiKey,
    ] {
        for len in [300, 1024, 3001] {
            for depth in [0.0, 0.5, 1.0] {
                let p = Case {
                    input_len: len,
                    depth,
                    kind,
                    seed: 7,
                }
                .build(&tok)
                .unwrap();
                assert_eq!(p.ids.len(), len, "{kind:?} {len} {depth}");
                let text = tok.decode(&p.ids, false).unwrap();
                assert!(
                    text.contains(&format!("for {} is: {}.", p.key, p.value)),
                    "needle missing"
                );
                // The needle sits near the asked depth of the haystack.
                // The needle sits at the asked depth of the filler, snapped to a sentence end.
                assert!(p.haystack.contains(&p.needle_at));
                let frac = p.filler_before as f64 / p.filler_total as f64;
                assert!(
                    (frac - depth).abs() <= 8.0 / p.filler_total as f64,
                    "{kind:?} {len}: needle at {frac:.2}, asked {depth}"
                );
            }
        }
    }
}

#[test]
fn bad_arguments_are_refused_clearly() {
    for (args, expect) in [
        (
            vec!["--input-len", "2000", "--max-model-len", "1024"],
            "leaves no room",
        ),
        (
            vec!["--input-len", "9000"],
            "exceeds the model's context of 8192",
        ),
        (vec!["--depth", "1.5"], "1.5 is not in [0, 1]"),
        (
            vec!["--needle-kind", "haystack"],
            "invalid value 'haystack'",
        ),
        (vec!["--input-len", "40"], "is too small"),
        (vec!["--sanitize"], "add --enable-offload"),
    ] {
        let (ok, _, stderr) = needle(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(stderr.contains(expect), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// `--device cuda` runs the cases on the CUDA model (its path is tested on the kernel
/// emulator in tests/kernel_emulator.rs); without a driver, one line and exit 1.
#[test]
fn cuda_without_a_driver_is_one_line() {
    if strata::device::cuda::probe().is_ok() {
        return; // a GPU machine: nothing to refuse
    }
    for extra in [&[][..], &["--compare-offload"][..]] {
        let mut args = vec!["--device", "cuda", "--input-len", "256"];
        args.extend_from_slice(extra);
        let (ok, stdout, stderr) = needle(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(stdout.is_empty(), "{stdout}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains("no CUDA driver found"), "{stderr}");
    }
}

/// Sparse decode (#15) on the default model: a 512-token budget (half of 1K, a quarter of
/// 2K) still finds the needle at the standard depths (the same cases as full attention's
/// test); the hit rate is reported. (The full grid
/// 1K–8K at 1/8 is in docs/benchmarks.md.)
#[test]
fn sparse_budget_finds_the_needle() {
    let (ok, stdout, stderr) = needle(&[
        "--input-len",
        "1024,2048",
        "--depth",
        "0.1,0.5,0.9",
        "--enable-offload",
        "--block-size",
        "128",
        "--sparse-budget",
        "512",
        "--json",
    ]);
    let v: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout} {stderr}"));
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 6);
    for c in cases {
        assert_eq!(c["passed"], true, "{c}");
        assert_eq!(c["sparse_budget"], 512, "{c}");
        let hit = c["sparse_hit_rate"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit), "{c}");
    }
    assert!(ok, "{stderr}");
}

/// Gemma 3 270M's real weights at 8K tokens, 16 times its 512-token window: found in the
/// middle, and with `--enable-offload` (full layers offloaded, windowed layers holding
/// their window's ring) token for token and log-prob for log-prob the resident run (whose
/// windowed layers hold their ring too).
#[test]
fn gemma3_finds_the_needle_at_8k_with_and_without_offload() {
    let Some(model) = common::gemma3_model() else {
        return;
    };
    let args = [
        "--input-len",
        "8192",
        "--depth",
        "0.5",
        "--compare-offload",
        "--json",
    ];
    let (ok, stdout, stderr) = needle_on(&model, &args);
    let v: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout} {stderr}"));
    let c = &v["cases"][0];
    assert_eq!(c["passed"], true, "{c}");
    assert_eq!(c["tokens_agree"], true, "{c}");
    assert_eq!(c["max_logprob_diff"], 0.0, "{c}");
    assert!(ok, "{stderr}");
}
