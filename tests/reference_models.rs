//! Logits of tiny random Llama, Qwen2 and Qwen3 models match candle-transformers' own
//! implementations (the independent reference) on the same weights, for a prefill and
//! for decode steps against the KV cache.
//!
//! Tolerance: max |strata - candle| <= 1e-4 * (1 + max |candle|) per logit vector. Both
//! compute in f32; the difference is summation order in GEMMs and softmax.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::{max_abs_diff, scratch_dir, TinySpec};
use strata::kv::ContiguousKv;
use strata::model::{weights, Model, ModelConfig};

const PROMPT: [u32; 11] = [1, 17, 250, 3, 99, 42, 7, 7, 180, 64, 5];
const DECODE: [u32; 4] = [31, 2, 200, 77];

fn tolerance(reference: &[f32]) -> f32 {
    1e-4 * (1.0 + reference.iter().fold(0.0f32, |m, x| m.max(x.abs())))
}

fn load_strata(dir: &std::path::Path) -> Arc<Model> {
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut cfg = ModelConfig::from_hf_json(&text).unwrap();
    let w = weights::load_safetensors(dir, &mut cfg, false).unwrap();
    Arc::new(Model::new(cfg, w))
}

/// Runs prefill then decode steps, returning each step's last-position logits.
fn strata_logits(model: &Arc<Model>) -> Vec<Vec<f32>> {
    let c = &model.cfg;
    let mut kv = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, 64);
    let mut out = vec![model.forward(&PROMPT, 0, &mut kv).unwrap()];
    for (i, &t) in DECODE.iter().enumerate() {
        out.push(model.forward(&[t], PROMPT.len() + i, &mut kv).unwrap());
    }
    out
}

fn input(ids: &[u32]) -> Tensor {
    Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
}

fn to_vec(t: Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn compare(ours: &[Vec<f32>], theirs: &[Vec<f32>]) {
    for (step, (a, b)) in ours.iter().zip(theirs).enumerate() {
        let err = max_abs_diff(a, b);
        let tol = tolerance(b);
        assert!(
            err <= tol,
            "step {step}: max abs logit difference {err} > {tol}"
        );
    }
}

#[test]
fn tiny_llama_matches_candle_transformers() {
    use candle_transformers::models::llama;
    let spec = TinySpec::llama();
    let dir = scratch_dir("ref_llama");
    let w = spec.write(&dir, 11);
    let ours = strata_logits(&load_strata(&dir));

    let cfg: llama::LlamaConfig = serde_json::from_str(&spec.config_json_v4()).unwrap();
    let cfg = cfg.into_config(false);
    let vb = VarBuilder::from_tensors(w, DType::F32, &Device::Cpu);
    let model = llama::Llama::load(vb, &cfg).unwrap();
    let mut cache = llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
    let mut theirs = vec![to_vec(
        model.forward(&input(&PROMPT), 0, &mut cache).unwrap(),
    )];
    for (i, &t) in DECODE.iter().enumerate() {
        theirs.push(to_vec(
            model
                .forward(&input(&[t]), PROMPT.len() + i, &mut cache)
                .unwrap(),
        ));
    }
    compare(&ours, &theirs);
}

#[test]
fn tiny_qwen3_matches_candle_transformers() {
    use candle_transformers::models::qwen3;
    let spec = TinySpec::qwen3();
    let dir = scratch_dir("ref_qwen3");
    let w = spec.write(&dir, 12);
    let ours = strata_logits(&load_strata(&dir));

    let cfg: qwen3::Config = serde_json::from_str(&spec.config_json()).unwrap();
    // Weights are stored in bf16; both sides widen them to f32.
    let vb = VarBuilder::from_tensors(w, DType::F32, &Device::Cpu);
    let mut model = qwen3::ModelForCausalLM::new(&cfg, vb).unwrap();
    let mut theirs = vec![to_vec(model.forward(&input(&PROMPT), 0).unwrap())];
    for (i, &t) in DECODE.iter().enumerate() {
        theirs.push(to_vec(
            model.forward(&input(&[t]), PROMPT.len() + i).unwrap(),
        ));
    }
    compare(&ours, &theirs);
}

/// Qwen2: q/k/v biases, GQA, no q/k norm; tied and untied embeddings. candle's
/// `ModelForCausalLM` returns the last position's logits, as `Model::forward` does.
#[test]
fn tiny_qwen2_matches_candle_transformers() {
    use candle_transformers::models::qwen2;
    for tie in [true, false] {
        let spec = TinySpec {
            tie,
            ..TinySpec::qwen2()
        };
        let dir = scratch_dir(&format!("ref_qwen2_tie_{tie}"));
        let w = spec.write(&dir, 13);
        assert!(w.contains_key("model.layers.0.self_attn.k_proj.bias"));
        assert_eq!(w.contains_key("lm_head.weight"), !tie);
        let model = load_strata(&dir);
        assert!(model.cfg.attention_bias && !model.cfg.qk_norm);
        let ours = strata_logits(&model);

        let cfg: qwen2::Config = serde_json::from_str(&spec.config_json()).unwrap();
        // Weights are stored in bf16; both sides widen them to f32.
        let vb = VarBuilder::from_tensors(w, DType::F32, &Device::Cpu);
        let mut model = qwen2::ModelForCausalLM::new(&cfg, vb).unwrap();
        let mut theirs = vec![to_vec(model.forward(&input(&PROMPT), 0).unwrap())];
        for (i, &t) in DECODE.iter().enumerate() {
            theirs.push(to_vec(
                model.forward(&input(&[t]), PROMPT.len() + i).unwrap(),
            ));
        }
        assert_eq!(theirs[0].len(), spec.vocab, "last position only");
        compare(&ours, &theirs);
    }
}

#[test]
fn hf_config_4x_and_5x_forms_agree() {
    let spec = TinySpec::llama();
    let a = ModelConfig::from_hf_json(&spec.config_json()).unwrap();
    let b = ModelConfig::from_hf_json(&spec.config_json_v4()).unwrap();
    assert_eq!(a.rope_theta, 500000.0);
    assert_eq!(a.rope_theta, b.rope_theta);
    assert_eq!(a.rope_scaling, b.rope_scaling);
    assert!(matches!(
        a.rope_scaling,
        strata::model::config::RopeScaling::Llama3 { .. }
    ));
}

#[test]
fn sharded_checkpoint_loads_the_same_weights() {
    let spec = TinySpec::llama();
    let dir = scratch_dir("ref_sharded");
    let w = spec.write(&dir, 11);
    let single = strata_logits(&load_strata(&dir));
    // Re-save as two shards plus an index, as transformers does for large models.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let mut names: Vec<&String> = w.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        let shard: std::collections::HashMap<String, Tensor> =
            part.iter().map(|n| ((*n).clone(), w[*n].clone())).collect();
        candle_core::safetensors::save(&shard, dir.join(file)).unwrap();
        for n in part {
            map.insert((*n).clone(), serde_json::Value::String(file.into()));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert_eq!(strata_logits(&load_strata(&dir)), single);
}
