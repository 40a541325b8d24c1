//! gpt-oss against an independent implementation: Hugging Face transformers' own
//! `GptOssForCausalLM` f32 forward on a random checkpoint it made
//! (tests/data/gpt_oss/tiny_random, scripts/gptoss-tiny-random.py): gpt-oss-20b's attention
//! shape (64 query heads, 8 KV heads, head_dim 64) and layer pattern (windowed, full,
//! ...), attention sinks, biases on q/k/v/o, YaRN RoPE, 32 experts with 4 per token and
//! the clamped SwiGLU; window 32 crossed six times by the 200-token prompt.

mod common;
mod live_server;

use std::sync::Arc;

use serde_json::Value;
use strata::device::KvDtype;
use strata::kv::ContiguousKv;
use strata::model::weights::WeightDtype;
use strata::model::Model;

/// Largest |strata − transformers| allowed on a logit (the bound; both sides f32).
const TOL: f32 = 1e-3;

type Reference = common::HfReference;

fn reference() -> (std::path::PathBuf, Reference) {
    let src = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/gpt_oss/tiny_random/reference.json"
    );
    let dir = common::tiny_gpt_oss_dir(&format!("gpt_oss_tiny_{:?}", std::thread::current().id()));
    (dir, Reference::load(src))
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
    let prefill = r.worst(&all);
    let mut kv = ContiguousKv::<f32>::of(c.num_layers, c.num_kv_heads, c.head_dim, 300);
    let steps: Vec<Vec<f32>> = r
        .prompt
        .iter()
        .enumerate()
        .map(|(p, &t)| model.forward(&[t], p, &mut kv).unwrap())
        .collect();
    let decode = r.worst(&steps);
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
    let last_step: Vec<f32> = serde_json::from_value(r.json["last_step_logits"].clone()).unwrap();
    let d = common::max_abs_diff(&last, &last_step);
    assert!(
        d < TOL,
        "the last step's logits differ from transformers' by {d}"
    );
}

// ---------------------------------------------------------------------------------------
// GGUF: the same checkpoint in llama.cpp's layout (scripts/gptoss-gguf.py), against
// transformers and against llama.cpp itself (tests/data/gpt_oss/llamacpp_reference.json,
// scripts/gptoss-llamacpp-reference.py).

/// The GGUF files scripts/gptoss-gguf.py writes (bf16, f32, MXFP4 experts), checked to be
/// the bytes llama.cpp's reference was recorded on.
fn gguf_files(llama: &Value) -> Option<std::path::PathBuf> {
    let expected: Vec<(String, String)> = ["f32", "mxfp4"]
        .iter()
        .map(|kind| {
            let sha = llama["files"][kind]["sha256"].as_str().unwrap();
            (format!("gpt-oss-tiny.{kind}.gguf"), sha.to_string())
        })
        .collect();
    common::gguf_from_script("gptoss-gguf.py", "gpt_oss_gguf", &expected)
}

fn llama_reference() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/gpt_oss/llamacpp_reference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `model` with ggml's YaRN: the ramp's ends rounded to whole dimensions, as ggml's
/// `ggml_rope_yarn_corr_dims` always does (gpt-oss's config says not to).
fn with_ggml_yarn(model: Arc<Model>) -> Arc<Model> {
    use strata::model::config::{LayerKind, RopeScaling};
    let Ok(m) = Arc::try_unwrap(model) else {
        panic!("the model is shared")
    };
    let mut cfg = m.cfg.clone();
    let round = |s: &mut RopeScaling| {
        if let RopeScaling::Yarn { truncate, .. } = s {
            *truncate = true;
        }
    };
    round(&mut cfg.rope_scaling);
    for k in &mut cfg.layer_kinds {
        if let LayerKind::Window(w) = k {
            round(&mut w.rope_scaling);
        }
    }
    Arc::new(Model::new(cfg, m.weights))
}

/// The GGUF gives transformers' logits and greedy tokens, as the safetensors directory
/// does: the bf16 and f32 files against transformers on the checkpoint, the MXFP4 file
/// against transformers with its experts replaced by gguf-py's dequantization of the same
/// tensors (tests/data/gpt_oss/mxfp4_hf_reference.json), each in the f32 reference mode
/// and as stored (the default: bf16 rows and MXFP4 blocks read in place). So the llama.cpp
/// layout (split experts, `post_attention_norm`, `attn_sinks`, the YaRN keys) and the
/// MXFP4 blocks are read right.
#[test]
fn gguf_matches_transformers() {
    let llama = llama_reference();
    let Some(dir) = gguf_files(&llama) else {
        return;
    };
    let (_, r) = reference();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/gpt_oss/mxfp4_hf_reference.json"
    );
    let mx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(
        mx["sha256"], llama["files"]["mxfp4"]["sha256"],
        "the MXFP4 references disagree on the file"
    );
    let mx = Reference {
        logits: serde_json::from_value(mx["logits"].clone()).unwrap(),
        greedy: serde_json::from_value(mx["greedy_ids"].clone()).unwrap(),
        ..reference().1
    };
    for (kind, want) in [("bf16", &r), ("f32", &r), ("mxfp4", &mx)] {
        for dtype in [WeightDtype::F32, WeightDtype::Stored] {
            let path = dir.join(format!("gpt-oss-tiny.{kind}.gguf"));
            let (model, _) = Model::load_as(&path, false, dtype).unwrap();
            let c = &model.cfg;
            assert_eq!(c.arch, strata::model::Arch::GptOss);
            let mut kv = ContiguousKv::<f32>::of(c.num_layers, c.num_kv_heads, c.head_dim, 300);
            let all = model.forward_rows(&want.prompt, 0, &mut kv).unwrap();
            let d = want.worst(&all);
            eprintln!("gpt-oss GGUF {kind} {dtype:?}: max |logit diff| vs transformers {d:.2e}");
            assert!(
                d < TOL,
                "{kind} {dtype:?}: logits differ from transformers' by {d}"
            );
            let out = common::generate_plain(
                &model,
                KvDtype::F32,
                &want.prompt,
                &common::greedy(64),
                300,
            );
            assert_eq!(out.token_ids, want.greedy, "{kind} {dtype:?}");
        }
    }
}

/// Against llama.cpp on the same files. f32: with ggml's rounded YaRN ramp (its one
/// departure from the model's config, `with_ggml_yarn`) strata's logits are llama.cpp's
/// within `LLAMA_TOL` and its 64 greedy tokens llama.cpp's; with the model's own unrounded
/// ramp the two differ by far more (so the rounding is what differs: measured). MXFP4:
/// llama.cpp's CPU kernel quantizes the activations to 8 bits (Q8_0) before its MXFP4
/// dot, strata's keeps them f32, so the logits agree within `MXFP4_TOL` and the top-1
/// wherever llama.cpp's own top-1/top-2 margin exceeds it.
#[test]
fn gguf_matches_llama_cpp_f32_and_mxfp4() {
    /// llama.cpp computes in other orders (and its own exp); measured 9.2e-6.
    const LLAMA_TOL: f32 = 1e-4;
    /// llama.cpp's 8-bit activations against strata's f32; measured 7.3e-2.
    const MXFP4_TOL: f32 = 0.15;
    let llama = llama_reference();
    let Some(dir) = gguf_files(&llama) else {
        return;
    };
    let rows: Vec<usize> = serde_json::from_value(llama["logits_rows"].clone()).unwrap();
    let prompt: Vec<u32> = serde_json::from_value(llama["prompt_ids"].clone()).unwrap();
    let logits_of = |model: &Model| {
        let c = &model.cfg;
        let mut kv = ContiguousKv::<f32>::of(c.num_layers, c.num_kv_heads, c.head_dim, 300);
        let all = model.forward_rows(&prompt, 0, &mut kv).unwrap();
        rows.iter().map(|&r| all[r].clone()).collect::<Vec<_>>()
    };
    let worst = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        a.iter()
            .zip(b)
            .map(|(a, b)| common::max_abs_diff(a, b))
            .fold(0.0, f32::max)
    };
    for kind in ["f32", "mxfp4"] {
        let want: Vec<Vec<f32>> =
            serde_json::from_value(llama["files"][kind]["logits"].clone()).unwrap();
        let greedy: Vec<u32> =
            serde_json::from_value(llama["files"][kind]["greedy_ids"].clone()).unwrap();
        let path = dir.join(format!("gpt-oss-tiny.{kind}.gguf"));
        let (model, _) = Model::load(&path, false).unwrap();
        let unrounded = worst(&logits_of(&model), &want);
        let model = with_ggml_yarn(model);
        let got = logits_of(&model);
        let rounded = worst(&got, &want);
        eprintln!(
            "gpt-oss GGUF {kind} vs llama.cpp: max |logit diff| {rounded:.2e} with ggml's YaRN rounding, {unrounded:.2e} without"
        );
        if kind == "f32" {
            assert!(
                rounded < LLAMA_TOL,
                "{kind}: logits differ from llama.cpp's by {rounded}"
            );
            assert!(
                unrounded > 100.0 * rounded,
                "the YaRN rounding made no difference"
            );
            let out =
                common::generate_plain(&model, KvDtype::F32, &prompt, &common::greedy(64), 300);
            assert_eq!(
                out.token_ids, greedy,
                "greedy tokens differ from llama.cpp's"
            );
        } else {
            assert!(
                rounded < MXFP4_TOL,
                "{kind}: logits differ from llama.cpp's by {rounded}"
            );
            let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
            let mut clear = 0;
            for (g, w) in got.iter().zip(&want) {
                let mut sorted = w.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                if sorted[0] - sorted[1] > MXFP4_TOL {
                    clear += 1;
                    assert_eq!(
                        argmax(g),
                        argmax(w),
                        "{kind}: top-1 differs at a clear margin"
                    );
                }
            }
            assert!(clear >= 10, "only {clear} rows with a clear margin");
        }
    }
}

/// `strata serve` on the gpt-oss directory, driven by the official `openai` client
/// (tests/openai_client.py): /v1/models, completions streamed and not, both endpoints'
/// log-probabilities bitwise `strata generate`'s, error statuses, 16 concurrent greedy
/// requests equal to their sequential results. (Its stop-string check needs readable
/// text; a random model's is not.)
#[test]
fn serve_answers_the_openai_client_as_generate_does() {
    let Some(python) = common::python_with("openai", "pip install openai") else {
        return;
    };
    let dir = common::tiny_gpt_oss_dir("gpt_oss_serve");
    let server = live_server::Server::start(&dir, &[]);
    let checks = "models,completions,logprobs,errors,concurrent";
    server.run_openai_client(&python, &dir, Some(checks));
}

/// Hostile or broken gpt-oss GGUFs (the fuzz corpus's tiny gpt-oss, edited): each refused
/// with one line naming what is wrong, none panics; the unedited file loads and runs.
#[test]
fn broken_gpt_oss_ggufs_are_refused_by_name() {
    use candle_core::quantized::gguf_file::Value as G;
    use strata::fuzz::corpus::gguf_doc;
    let dir = common::scratch_dir("gpt_oss_hostile");
    let load = |doc: &strata::fuzz::gguf_writer::GgufDoc| {
        let path = dir.join("model.gguf");
        std::fs::write(&path, doc.to_bytes()).unwrap();
        Model::load(&path, false).map(|(m, _)| m.cfg.clone())
    };
    let base = gguf_doc("gpt-oss");
    let cfg = load(&base).expect("the unedited tiny gpt-oss loads");
    assert!(cfg.moe.is_some() && cfg.attn_sinks);
    let set = |key: &str, v: G| {
        let mut d = base.clone();
        d.metadata.iter_mut().find(|(k, _)| k == key).unwrap().1 = v;
        d
    };
    let cases: Vec<(&str, strata::fuzz::gguf_writer::GgufDoc)> = vec![
        (
            "experts per token",
            set("gpt-oss.expert_used_count", G::U32(5)),
        ),
        ("number of experts", set("gpt-oss.expert_count", G::U32(0))),
        (
            "sliding window",
            set("gpt-oss.attention.sliding_window", G::U32(0)),
        ),
        (
            "rope scaling factor",
            set("gpt-oss.rope.scaling.factor", G::F32(-1.0)),
        ),
        ("blk.1.attn_sinks.weight", {
            let mut d = base.clone();
            d.tensors.retain(|t| t.name != "blk.1.attn_sinks.weight");
            d
        }),
        ("blk.0.ffn_down_exps.weight", {
            let mut d = base.clone();
            let t = d
                .tensors
                .iter_mut()
                .find(|t| t.name == "blk.0.ffn_down_exps.weight")
                .unwrap();
            t.dims[0] -= 1; // 3 experts' rows where the config says 4
            t.data.truncate(t.data.len() / 4 * 3);
            d
        }),
    ];
    for (want, doc) in cases {
        let err = format!("{:#}", load(&doc).expect_err(want));
        assert!(err.contains(want), "{want}: {err}");
        assert!(!err.contains('\n'), "{want}: not one line: {err}");
    }
}
