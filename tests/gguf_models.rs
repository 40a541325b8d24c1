//! GGUF files written by the test from tiny random models: Qwen3 and Qwen2 (no row
//! permutation, `qwen2` pre-tokenizer; Qwen2 with `attn_{q,k,v}.bias`) and Llama (Q/K rows
//! permuted as llama.cpp's converter does, `llama-bpe` pre-tokenizer) load to the same
//! weights as their safetensors twins, so the logits are bit-identical; the tokenizer and
//! config come from the metadata.

mod common;

use std::sync::Arc;

use common::gguf::write_gguf;
use common::{scratch_dir, Family, TinySpec};
use strata::kv::ContiguousKv;
use strata::model::{weights, Arch, Model};

fn logits(model: &Arc<Model>) -> Vec<Vec<f32>> {
    let c = &model.cfg;
    let mut kv = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, 32);
    let mut out = vec![model
        .forward(&[5, 9, 200, 17, 3, 44, 120], 0, &mut kv)
        .unwrap()];
    out.push(model.forward(&[77], 7, &mut kv).unwrap());
    out
}

fn check(spec: TinySpec, name: &str, pre: &str) {
    let dir = scratch_dir(name);
    let w = spec.write(&dir, 31);
    let path = dir.join("model.gguf");
    write_gguf(&spec, &w, &path, pre);
    let (from_gguf, tok) = Model::load(&path, false).unwrap();
    let c = &from_gguf.cfg;
    let arch = match spec.family {
        Family::Llama => Arch::Llama,
        Family::Qwen2 => Arch::Qwen2,
        Family::Qwen3 => Arch::Qwen3,
    };
    assert_eq!(c.arch, arch);
    // Qwen2's biases must be loaded (the safetensors twin below uses this config, so a
    // config without them would compare two bias-free models and prove nothing).
    let bias = spec.family == Family::Qwen2;
    assert_eq!(c.attention_bias, bias);
    assert!(from_gguf
        .weights
        .layers
        .iter()
        .all(|l| l.bqkv.is_some() == bias));
    assert_eq!(
        (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim),
        (spec.layers, spec.heads, spec.kv_heads, spec.head_dim)
    );
    assert_eq!(c.tie_word_embeddings, spec.tie);
    assert_eq!(c.eos_token_ids, vec![2]);
    // The same tensors through the safetensors loader, under the GGUF's config.
    let mut cfg = c.clone();
    let reference = Arc::new(Model::new(
        cfg.clone(),
        weights::load_safetensors(&dir, &mut cfg, false).unwrap(),
    ));
    assert_eq!(
        logits(&from_gguf),
        logits(&reference),
        "{name}: GGUF weights differ from safetensors"
    );
    // Tokenizer from the metadata: byte-level round trip, control tokens whole.
    let text = "héllo, wörld 12345!";
    assert_eq!(
        tok.decode(&tok.encode(text, false).unwrap(), false)
            .unwrap(),
        text
    );
    assert_eq!(tok.encode("<|im_start|>", false).unwrap(), vec![1]);
    assert_eq!(
        tok.apply_chat_template("hi").unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n"
    );
}

#[test]
fn qwen3_gguf_matches_its_safetensors_twin() {
    check(TinySpec::qwen3(), "gguf_qwen3", "qwen2");
}

#[test]
fn qwen2_gguf_with_qkv_bias_matches_its_safetensors_twin() {
    check(TinySpec::qwen2(), "gguf_qwen2", "qwen2");
}

#[test]
fn llama_gguf_with_permuted_rows_matches_its_safetensors_twin() {
    check(TinySpec::llama(), "gguf_llama", "llama-bpe");
}

#[test]
fn unknown_pre_tokenizer_is_refused() {
    let spec = TinySpec::llama();
    let dir = scratch_dir("gguf_bad_pre");
    let w = spec.write(&dir, 31);
    let path = dir.join("model.gguf");
    write_gguf(&spec, &w, &path, "mystery-bpe");
    let err = format!(
        "{:#}",
        Model::load(&path, false).err().expect("must refuse")
    );
    assert!(
        err.contains("unsupported GGUF tokenizer pre-tokenizer `mystery-bpe`"),
        "{err}"
    );
}
