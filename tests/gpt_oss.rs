//! gpt-oss against an independent implementation: Hugging Face transformers' own
//! `GptOssForCausalLM` f32 forward on a random checkpoint it made
//! (tests/data/gpt_oss/tiny_random, scripts/gptoss-tiny-random.py): gpt-oss-20b's attention
//! shape (64 query heads, 8 KV heads, head_dim 64) and layer pattern (windowed, full,
//! ...), attention sinks, biases on q/k/v/o, YaRN RoPE, 32 experts with 4 per token and
//! the clamped SwiGLU; window 32 crossed six times by the 200-token prompt.

mod common;

use serde_json::Value;
use strata::device::KvDtype;
use strata::kv::ContiguousKv;
use strata::model::weights::WeightDtype;
use strata::model::Model;

/// Largest |strata − transformers| allowed on a logit (the bound; both sides f32).
const TOL: f32 = 1e-3;

struct Reference {
    prompt: Vec<u32>,
    rows: Vec<usize>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
    last_step: Vec<f32>,
}

fn reference() -> (std::path::PathBuf, Reference) {
    let src = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/gpt_oss/tiny_random"
    );
    let dir = common::scratch_dir(&format!("gpt_oss_tiny_{:?}", std::thread::current().id()));
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(format!("{src}/{f}"), dir.join(f)).unwrap();
    }
    common::write_tokenizer(&dir, 512);
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{src}/reference.json")).unwrap())
            .unwrap();
    fn get<T: serde::de::DeserializeOwned>(r: &Value, k: &str) -> T {
        serde_json::from_value(r[k].clone()).unwrap()
    }
    let reference = Reference {
        prompt: get(&r, "prompt_ids"),
        rows: get(&r, "logits_rows"),
        logits: get(&r, "logits"),
        greedy: get(&r, "greedy_ids"),
        last_step: get(&r, "last_step_logits"),
    };
    (dir, reference)
}

fn worst(all: &[Vec<f32>], r: &Reference) -> f32 {
    r.rows
        .iter()
        .zip(&r.logits)
        .map(|(&row, want)| common::max_abs_diff(&all[row], want))
        .fold(0.0, f32::max)
}

#[test]
fn config_reads_the_gpt_oss_layout() {
    let (dir, _) = reference();
    let c = Model::peek_config(&dir).unwrap();
    assert_eq!(c.arch, strata::model::Arch::GptOss);
    assert_eq!((c.window(0), c.window(1)), (Some(32), None));
    assert!(c.attn_sinks && c.out_bias && c.attention_bias);
    let moe = c.moe.unwrap();
    assert_eq!((moe.num_experts, moe.top_k), (32, 4));
    // YaRN's attention factor 0.1 ln 32 + 1, squared into the score scale.
    let f = 0.1 * 32f32.ln() + 1.0;
    assert!((c.layer_attn_scale(1) - f * f / 8.0).abs() < 1e-6);
}

/// Prefill over the whole prompt (the sliding layers' window crossed six times), and
/// the same prompt fed one token at a time: every recorded row within `TOL` of
/// transformers'.
#[test]
fn logits_match_transformers_in_prefill_and_token_by_token() {
    let (dir, r) = reference();
    let (model, _) = Model::load_as(&dir, false, WeightDtype::F32).unwrap();
    let c = &model.cfg;
    let mut kv = ContiguousKv::<f32>::of(c.num_layers, c.num_kv_heads, c.head_dim, 300);
    let all = model.forward_rows(&r.prompt, 0, &mut kv).unwrap();
    let prefill = worst(&all, &r);
    let mut kv = ContiguousKv::<f32>::of(c.num_layers, c.num_kv_heads, c.head_dim, 300);
    let steps: Vec<Vec<f32>> = r
        .prompt
        .iter()
        .enumerate()
        .map(|(p, &t)| model.forward(&[t], p, &mut kv).unwrap())
        .collect();
    let decode = worst(&steps, &r);
    eprintln!(
        "tiny random gpt-oss: max |logit diff| prefill {prefill:.2e}, token by token {decode:.2e}"
    );
    assert!(
        prefill < TOL,
        "prefill logits differ from transformers' by {prefill}"
    );
    assert!(
        decode < TOL,
        "token-by-token logits differ from transformers' by {decode}"
    );
}

/// Greedy decoding gives transformers' 64 tokens, and the last step's logits agree.
#[test]
fn greedy_matches_transformers_over_64_tokens() {
    let (dir, r) = reference();
    let (model, _) = Model::load_as(&dir, false, WeightDtype::F32).unwrap();
    let out = common::generate_plain(&model, KvDtype::F32, &r.prompt, &common::greedy(64), 300);
    assert_eq!(out.token_ids, r.greedy);
    let c = &model.cfg;
    let mut kv = ContiguousKv::<f32>::of(c.num_layers, c.num_kv_heads, c.head_dim, 300);
    let mut seq = r.prompt.clone();
    seq.extend(&r.greedy[..63]);
    let last = model.forward(&seq, 0, &mut kv).unwrap();
    let d = common::max_abs_diff(&last, &r.last_step);
    assert!(
        d < TOL,
        "the last step's logits differ from transformers' by {d}"
    );
}
