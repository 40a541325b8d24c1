//! The `q8` weight mode (`--dtype q8`: activations quantised to 8 bits per block of 32,
//! integer dots on Q4_0/Q4_1/Q8_0 rows). It is not bitwise equal to `stored`, but it is
//! batch-invariant: a row's result never depends on what it is computed with.

mod common;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::gguf::write_gguf_as;
use common::{require_default_model, scratch_dir, TinySpec};
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::device::cpu::fused::StoredRows;
use strata::device::cpu::ops::{self, ActivationMode, Q8Part, WeightRows};
use strata::device::cpu::packed::{self, Packed};
use strata::device::cpu::quant::Format;
use strata::kv::ContiguousKv;
use strata::model::weights::WeightDtype;
use strata::model::Model;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(x: &[f32]) -> u32 {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b }) as u32
}

/// A stored matrix `[n, k]` whose inputs `linear` quantises (the q8 mode's weights).
struct Q8Matrix {
    format: Format,
    bytes: Vec<u8>,
    n: usize,
    k: usize,
    /// The rows repacked for the integer kernels, if they are (`packed.rs`).
    packed: Option<Packed>,
}

impl WeightRows for Q8Matrix {
    fn out_in(&self) -> (usize, usize) {
        (self.n, self.k)
    }
    fn rows_f32<'s>(
        &'s self,
        rows: std::ops::Range<usize>,
        scratch: &'s mut Vec<f32>,
    ) -> &'s [f32] {
        let rb = self.format.row_bytes(self.k).unwrap();
        scratch.resize(rows.len() * self.k, 0.0);
        strata::device::cpu::quant::dequantize(
            self.format,
            &self.bytes[rows.start * rb..rows.end * rb],
            scratch,
        );
        scratch
    }
    fn stored_rows(&self, rows: std::ops::Range<usize>) -> Option<StoredRows<'_>> {
        let rb = self.format.row_bytes(self.k).unwrap();
        Some(StoredRows {
            format: self.format,
            bytes: &self.bytes[rows.start * rb..rows.end * rb],
            cols: self.k,
        })
    }
    fn activations(&self) -> ActivationMode {
        ActivationMode::Q8
    }
    fn q8_parts(&self) -> Vec<Q8Part<'_>> {
        vec![Q8Part {
            rows: 0..self.n,
            packed: self.packed.as_ref().map(Packed::as_rows),
        }]
    }
}

/// `linear` in the q8 mode: every row of a batch (sizes 1 to 33, so every register block
/// and edge) is bitwise the row computed alone, for each integer format and for a format
/// without an integer kernel (Q3_K: the f32 path); the rows repacked (53 = 6 groups of 8
/// and a padded one) give the same bits as the rows as stored; and a q8 result is within
/// the 8-bit activation error of the f32 path's.
#[test]
fn a_q8_linear_row_is_the_same_alone_and_in_any_batch() {
    let mut rng = StdRng::seed_from_u64(3);
    for (format, k) in [
        (Format::Q4_0, 96),
        (Format::Q4_1, 576),
        (Format::Q8_0, 160),
        (Format::Q5_0, 96),
        (Format::Q5_1, 576),
        (Format::Q4K, 256),
        (Format::Q5K, 512),
        (Format::Q6K, 768),
        (Format::Q3K, 256),
    ] {
        let n = 53;
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let t = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
        let bytes = QTensor::quantize(&t, format.ggml().expect("a candle format"))
            .unwrap()
            .data()
            .unwrap()
            .into_owned();
        let packed = packed::supports(format).then(|| Packed::pack(format, &bytes, n, k));
        let w = Q8Matrix {
            format,
            bytes: bytes.clone(),
            n,
            k,
            packed: None,
        };
        let wp = Q8Matrix {
            format,
            bytes,
            n,
            k,
            packed,
        };
        for m in [1, 2, 3, 5, 8, 17, 33] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
            let mut batch = vec![f32::NAN; m * n];
            ops::linear_weight(&x, &w, None, &mut batch, m);
            let mut repacked = vec![f32::NAN; m * n];
            ops::linear_weight(&x, &wp, None, &mut repacked, m);
            assert_eq!(
                bits(&repacked),
                bits(&batch),
                "{format}, m {m}: repacked rows"
            );
            for i in 0..m {
                let mut alone = vec![f32::NAN; n];
                ops::linear_weight(&x[i * k..(i + 1) * k], &w, None, &mut alone, 1);
                assert_eq!(
                    bits(&alone),
                    bits(&batch[i * n..(i + 1) * n]),
                    "{format}, row {i} of {m}"
                );
            }
            // Against the f32 path on the same rows: 8-bit activations move a dot by a few
            // tenths of a percent of its magnitude here; 2% of the largest output is loose.
            let mut deq = Vec::new();
            let wf = w.rows_f32(0..n, &mut deq);
            let mut want = vec![0.0f32; m * n];
            ops::linear(&x, wf, None, &mut want, m, k, n);
            let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            for (g, e) in batch.iter().zip(&want) {
                assert!((g - e).abs() <= 0.02 * scale, "{format}, m {m}: {g} vs {e}");
            }
        }
    }
}

/// A tiny Llama with Q4_0, Q4_1, Q8_0 and Q4_K matrices (and Q3_K ones, which take the
/// f32 path), loaded in the q8 mode: the prompt's last logits and the greedy decode logits are
/// bitwise the same whether the prompt is prefilled at once, in chunks, or a token at a
/// time (each a different batch of rows through every `linear`).
#[test]
fn q8_logits_do_not_depend_on_how_the_prompt_is_batched() {
    let dir = scratch_dir("q8_batching");
    let s = TinySpec::llama_wide();
    let w = s.write(&dir, 5);
    let path = dir.join("model.gguf");
    let dtype_of = |n: &str| {
        if n.ends_with("norm.weight") {
            GgmlDType::F32
        } else if n.contains("attn_q") || n.contains("ffn_gate") {
            GgmlDType::Q4_0
        } else if n.contains("attn_v") || n.contains("ffn_down") {
            GgmlDType::Q8_0
        } else if n.contains("attn_output") {
            GgmlDType::Q4K
        } else if n.contains("attn_k") {
            GgmlDType::Q6K
        } else if n.contains("ffn_up") {
            GgmlDType::Q5_0
        } else if n.contains("output.weight") {
            GgmlDType::Q3K
        } else {
            GgmlDType::Q4_1
        }
    };
    write_gguf_as(&s, &w, &path, "llama-bpe", &dtype_of);
    let model = Model::load_as(&path, false, WeightDtype::Q8).unwrap().0;
    let stored = Model::load(&path, false).unwrap().0;
    let prompt: Vec<u32> = (0..23).map(|i| (i * 37 + 11) % 300).collect();
    let run = |model: &Arc<Model>, chunks: &[usize]| -> Vec<Vec<u32>> {
        let c = &model.cfg;
        let mut kv = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, 64);
        let mut at = 0;
        let mut logits = Vec::new();
        for &len in chunks {
            logits = model.forward(&prompt[at..at + len], at, &mut kv).unwrap();
            at += len;
        }
        assert_eq!(at, prompt.len());
        let mut out = vec![bits(&logits)];
        for step in 0..5 {
            let t = argmax(&logits);
            logits = model.forward(&[t], prompt.len() + step, &mut kv).unwrap();
            out.push(bits(&logits));
        }
        out
    };
    let whole = run(&model, &[23]);
    assert_eq!(whole, run(&model, &[5, 1, 9, 8]), "chunked");
    assert_eq!(whole, run(&model, &[1; 23]), "a token at a time");
    // Not the stored mode's bits (the mode is in effect).
    assert_ne!(whole, run(&stored, &[23]), "q8 gave the stored bits");
}

/// The default model in the q8 mode: a chat prompt prefilled at once gives bitwise the
/// last-token logits of feeding it a token at a time, and the next token agrees with the
/// stored mode on most teacher-forced positions (the measured figure is in docs/cpu.md;
/// this only guards against a broken mode).
#[test]
fn default_model_q8_is_batch_invariant_and_close_to_stored() {
    let path = require_default_model();
    let (q8, tok) = Model::load_as(&path, false, WeightDtype::Q8).unwrap();
    let stored = Model::load(&path, false).unwrap().0;
    let ids = tok
        .encode(
            &tok.apply_chat_template("What is the capital of France?")
                .unwrap(),
            false,
        )
        .unwrap();
    let c = &q8.cfg;
    let kv = || ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, 128);
    let whole = q8.forward(&ids, 0, &mut kv()).unwrap();
    let (mut kv_q, mut kv_s) = (kv(), kv());
    let (mut lq, mut agree) = (Vec::new(), 0);
    for (pos, &t) in ids.iter().enumerate() {
        lq = q8.forward(&[t], pos, &mut kv_q).unwrap();
        let ls = stored.forward(&[t], pos, &mut kv_s).unwrap();
        agree += usize::from(argmax(&lq) == argmax(&ls));
    }
    assert_eq!(bits(&whole), bits(&lq), "prefill vs a token at a time");
    assert!(
        agree * 10 >= ids.len() * 8,
        "top-1 agreed on {agree} of {} positions",
        ids.len()
    );
}
