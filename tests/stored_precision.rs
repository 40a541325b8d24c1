//! Weights computed in their stored precision against the f32 reference mode
//! (`WeightDtype::F32`, every tensor widened at load through candle's dequantizer, an
//! implementation we did not write). Stored-precision kernels dequantize exactly and keep
//! the f32 path's reduction order, so the stated tolerance is **zero**: logits are bitwise
//! equal, for every block format, on tiny GGUF models written here and on the default model.

mod common;

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use common::gguf::write_gguf_as;
use common::{max_abs_diff, require_default_model, scratch_dir, TinySpec};
use strata::kv::ContiguousKv;
use strata::model::weights::WeightDtype;
use strata::model::Model;

/// Logits of a 9-token prefill and 6 greedy decode steps, and the tokens chosen.
fn run(model: &Arc<Model>) -> (Vec<u32>, Vec<Vec<f32>>) {
    let c = &model.cfg;
    let mut kv = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, 64);
    let prompt = [5, 9, 200, 17, 3, 44, 120, 7, 250];
    let mut logits = vec![model.forward(&prompt, 0, &mut kv).unwrap()];
    let mut toks = Vec::new();
    for i in 0..6 {
        let t = argmax(logits.last().unwrap());
        toks.push(t);
        logits.push(model.forward(&[t], prompt.len() + i, &mut kv).unwrap());
    }
    (toks, logits)
}

fn argmax(x: &[f32]) -> u32 {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b }) as u32
}

fn bits(v: &[Vec<f32>]) -> Vec<u32> {
    v.iter().flatten().map(|x| x.to_bits()).collect()
}

/// Writes the tiny model with matrices in `dtype_of(name)` (vectors f32) and loads it
/// both ways.
fn load_both(name: &str, dtype_of: &dyn Fn(&str) -> GgmlDType) -> (Arc<Model>, Arc<Model>) {
    let dir = scratch_dir(name);
    let s = TinySpec::llama_wide();
    let w = s.write(&dir, 21);
    let path = dir.join("model.gguf");
    let matrix_dtype = |n: &str| {
        if n.ends_with("norm.weight") {
            GgmlDType::F32
        } else {
            dtype_of(n)
        }
    };
    write_gguf_as(&s, &w, &path, "llama-bpe", &matrix_dtype);
    let stored = Model::load(&path, false).unwrap().0;
    let f32_mode = Model::load_as(&path, false, WeightDtype::F32).unwrap().0;
    (stored, f32_mode)
}

#[test]
fn every_block_format_gives_the_f32_modes_logits_bitwise() {
    use GgmlDType as G;
    for (dtype, bits_per_value) in [
        (G::Q4_0, 4.5),
        (G::Q4_1, 5.0),
        (G::Q5_0, 5.5),
        (G::Q5_1, 6.0),
        (G::Q8_0, 8.5),
        (G::Q2K, 2.625),
        (G::Q3K, 3.4375),
        (G::Q4K, 4.5),
        (G::Q5K, 5.5),
        (G::Q6K, 6.5625),
        (G::F16, 16.0),
        (G::BF16, 16.0),
    ] {
        let (stored, f32_mode) = load_both(&format!("stored_{dtype:?}"), &|_| dtype);
        // Held as stored, not widened: the matrices' bytes are the format's size.
        let values: usize = stored
            .weights
            .matrices()
            .map(|m| m.shape().out_features * m.shape().in_features)
            .sum();
        let matrix_bytes: usize = stored.weights.matrices().map(|m| m.bytes()).sum();
        assert_eq!(
            matrix_bytes as f64,
            values as f64 * bits_per_value / 8.0,
            "{dtype:?}"
        );
        assert!(
            f32_mode.weight_bytes() > 3 * stored.weight_bytes() / 2,
            "{dtype:?}"
        );
        let (toks_s, logits_s) = run(&stored);
        let (toks_f, logits_f) = run(&f32_mode);
        assert_eq!(toks_s, toks_f, "{dtype:?}");
        assert!(
            bits(&logits_s) == bits(&logits_f),
            "{dtype:?}: logits differ by up to {}",
            max_abs_diff(&logits_s.concat(), &logits_f.concat())
        );
    }
}

/// Q, K and V (and gate/up) in different formats, as llama.cpp's mixed files have them:
/// the fused matrices read each part in its own format.
#[test]
fn mixed_formats_in_one_fused_matrix_give_the_f32_modes_logits_bitwise() {
    let dtype_of = |n: &str| {
        use GgmlDType as G;
        match () {
            _ if n.contains("q_proj") || n.contains("gate") => G::Q4_1,
            _ if n.contains("k_proj") || n.contains("up_proj") => G::Q8_0,
            _ if n.contains("v_proj") || n.contains("down") => G::Q6K,
            _ if n.contains("embed") => G::Q4K,
            _ => G::Q5_0,
        }
    };
    let (stored, f32_mode) = load_both("stored_mixed", &dtype_of);
    let (toks_s, logits_s) = run(&stored);
    let (toks_f, logits_f) = run(&f32_mode);
    assert_eq!(toks_s, toks_f);
    assert!(bits(&logits_s) == bits(&logits_f));
}

/// The default model (Q4_1, Q8_0 embedding... whatever the file holds): greedy
/// continuations of fixed prompts are token-for-token and logit-for-logit equal in both
/// modes, and the stored mode holds a fraction of the f32 mode's bytes.
#[test]
fn default_model_stored_precision_matches_the_f32_mode_bitwise() {
    let path = require_default_model();
    let (stored, tok) = Model::load(&path, false).unwrap();
    let f32_mode = Model::load_as(&path, false, WeightDtype::F32).unwrap().0;
    assert!(stored.weight_bytes() * 4 < f32_mode.weight_bytes());
    for prompt in ["The capital of France is", "def fibonacci(n):"] {
        let ids = tok.encode(prompt, true).unwrap();
        let c = &stored.cfg;
        let mut kv_s = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, 64);
        let mut kv_f = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, 64);
        let mut ls = stored.forward(&ids, 0, &mut kv_s).unwrap();
        let mut lf = f32_mode.forward(&ids, 0, &mut kv_f).unwrap();
        for step in 0..12 {
            assert!(
                bits(&[ls.clone()]) == bits(&[lf.clone()]),
                "{prompt:?} step {step}"
            );
            let t = argmax(&ls);
            let pos = ids.len() + step;
            ls = stored.forward(&[t], pos, &mut kv_s).unwrap();
            lf = f32_mode.forward(&[t], pos, &mut kv_f).unwrap();
        }
    }
}

/// `--dtype` on `strata bench serve` (and `strata serve`, which shares the flag's type):
/// the f32 mode holds the widened weights, the default holds them as stored, and both
/// generate the same tokens (`--compare` checks each run against its own unconstrained
/// run; equal token counts across the two modes check they stopped alike). A bad value is
/// a one-line error naming the choices, on both commands.
#[test]
fn dtype_on_bench_serve_and_serve() {
    let model = require_default_model();
    let bench = |dtype: &str| -> serde_json::Value {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["bench", "serve", "--model"])
            .arg(&model)
            .args([
                "--num-seqs",
                "2",
                "--input-len",
                "8:16",
                "--output-len",
                "4:8",
            ])
            .args(["--seed", "3", "--json", "--dtype", dtype])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str(&stdout).unwrap()
    };
    let (stored, f32_mode) = (bench("stored"), bench("f32"));
    let bytes = |v: &serde_json::Value| v["weights_bytes"].as_f64().unwrap();
    assert!(
        bytes(&f32_mode) > 4.0 * bytes(&stored),
        "{stored}\n{f32_mode}"
    );
    assert_eq!(stored["generated_tokens"], f32_mode["generated_tokens"]);
    for cmd in [&["bench", "serve"][..], &["serve"][..]] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(cmd)
            .args(["--dtype", "f16"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{cmd:?}");
        assert!(
            stderr.contains("stored") && stderr.contains("f32") && !stderr.contains("panicked"),
            "{cmd:?}: {stderr}"
        );
    }
}
