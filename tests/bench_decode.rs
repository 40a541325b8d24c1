//! `strata bench decode` on a tiny model: the bytes a decode token reads are the model's
//! tensors (counted here from the tensors written, not from the loader) plus its K and V at
//! the context; the achieved bandwidth and its fraction follow from them; a context past
//! the model's is one line before anything loads.

mod common;

use std::process::Command;

use common::{scratch_dir, TinySpec};

const STRATA: &str = env!("CARGO_BIN_EXE_strata");

/// In every KV element: the KV bytes follow the element's size (f16 is the CPU default).
#[test]
fn decode_bench_counts_the_bytes_a_token_reads() {
    for (kv_dtype, kv_elem_bytes) in [("f32", 4), ("f16", 2), ("bf16", 2)] {
        decode_bench_counts_the_bytes_of(kv_dtype, kv_elem_bytes);
    }
}

fn decode_bench_counts_the_bytes_of(kv_dtype: &str, kv_elem_bytes: usize) {
    let dir = scratch_dir(&format!("bench_decode_model_{kv_dtype}"));
    let spec = TinySpec::llama();
    let tensors = spec.write(&dir, 3);
    // Tied embeddings: the table is read whole, as the head. Every tensor is f32.
    let weight_bytes: usize = tensors.values().map(|t| t.elem_count() * 4).sum();
    let out = Command::new(STRATA)
        .args(["bench", "decode", "--json", "--context", "40,100"])
        .args([
            "--decode-steps",
            "5",
            "--rounds",
            "2",
            "--kv-dtype",
            kv_dtype,
            "--model",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every `cargo test` binary runs the stream-ordering checker: the report says so.
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the stream-ordering checker is on"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let read = v["read_gbps"].as_f64().unwrap();
    assert!(read > 0.0);
    assert!(v["read_gbps_one_thread"].as_f64().unwrap() > 0.0);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (row, context) in rows.iter().zip([40.0, 100.0]) {
        assert_eq!(
            row["weight_bytes_per_token"].as_u64(),
            Some(weight_bytes as u64)
        );
        // Positions context..context+5 attend over context+1 ..= context+5 rows: a mean of
        // context + 3, of K and V in every layer, kv_dim elements each.
        let kv_row = 2 * spec.layers * spec.kv_heads * spec.head_dim * kv_elem_bytes;
        let kv = (context + 3.0) * kv_row as f64;
        assert_eq!(
            row["kv_bytes_per_token"].as_u64(),
            Some(kv as u64),
            "--kv-dtype {kv_dtype}"
        );
        let tps = row["decode_tokens_per_s"].as_f64().unwrap();
        assert!(tps > 0.0);
        assert_eq!(
            row["decode_tokens_per_s_per_round"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        let achieved = (weight_bytes as f64 + kv) * tps / 1e9;
        let got = row["achieved_gbps"].as_f64().unwrap();
        assert!(
            (got - achieved).abs() <= 1e-9 * achieved.max(1.0),
            "{got} vs {achieved}"
        );
        // Each round's fraction is its own GB/s over the probe taken right before it; the
        // row's is their median (2 rounds: the mean of the two).
        let floats = |k: &str| -> Vec<f64> {
            row[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        };
        let (rounds, probes) = (
            floats("decode_tokens_per_s_per_round"),
            floats("read_gbps_per_round"),
        );
        assert_eq!(probes.len(), 2);
        assert!(probes.iter().all(|&p| p > 0.0));
        let fracs = floats("bandwidth_fraction_per_round");
        for ((tps, probe), frac) in rounds.iter().zip(&probes).zip(&fracs) {
            let want = (weight_bytes as f64 + kv) * tps / 1e9 / probe;
            assert!(
                (frac - want).abs() <= 1e-9 * want.max(1.0),
                "{frac} vs {want}"
            );
        }
        let frac = row["bandwidth_fraction"].as_f64().unwrap();
        let want = (fracs[0] + fracs[1]) / 2.0;
        assert!((frac - want).abs() <= 1e-9, "{frac} vs {want}");
    }
}

#[test]
fn a_context_past_the_models_is_one_line_before_loading() {
    let dir = scratch_dir("bench_decode_long");
    TinySpec::llama().write(&dir, 3);
    let out = Command::new(STRATA)
        .args([
            "bench",
            "decode",
            "--context",
            "510",
            "--decode-steps",
            "3",
            "--model",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("--context 510 + --decode-steps 3 is more than the model's context (512)"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}
