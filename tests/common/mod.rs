//! Helpers shared by the integration tests: tiny random models written to disk.
#![allow(dead_code)]

pub mod gguf;
pub mod sparse_oracle;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// Every KV element the CPU device stores: each bit-exactness test of a tier (offload,
/// preemption, disk) runs in each, against the plain run of the same element.
pub const KV_DTYPES: [strata::device::KvDtype; 3] = [
    strata::device::KvDtype::F32,
    strata::device::KvDtype::Bf16,
    strata::device::KvDtype::F16,
];

/// Greedy decoding of `n` tokens with no stop ids: what the bit-exactness tests compare.
pub fn greedy(n: usize) -> strata::engine::GenerateOptions {
    strata::engine::GenerateOptions {
        max_tokens: n,
        sampling: strata::engine::SamplingParams::default(),
        stop_ids: vec![],
    }
}

/// `len` random token ids in `3..vocab` (clear of the tiny models' special ids).
pub fn random_prompt(rng: &mut StdRng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|_| rng.random_range(3..vocab as u32))
        .collect()
}

/// The bits of each value: log-probs compared exactly, NaN included.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One request on a fresh contiguous cache of elements `kv` (`engine::generate` in any
/// KV element): the plain run every tier is compared with.
pub fn generate_plain(
    model: &std::sync::Arc<strata::model::Model>,
    kv: strata::device::KvDtype,
    prompt: &[u32],
    opts: &strata::engine::GenerateOptions,
    capacity: usize,
) -> strata::engine::GenerationOutput {
    let c = &model.cfg;
    strata::with_kv_elem!(kv, T => {
        let mut cache = strata::kv::ContiguousKv::<T>::plain(c, capacity);
        strata::engine::generate_with(model, &mut cache, capacity, prompt, opts, &mut |_| Ok(()))
            .unwrap()
    })
}

/// A TCP port free on the loopback a moment ago (for a server started as a process).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh directory under the target dir, removed first if it exists.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Which Hugging Face architecture a `TinySpec` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    /// Llama plus biases on q/k/v (always present; no `attention_bias` key in the config).
    Qwen2,
    /// Per-head q/k RMSNorm, no bias.
    Qwen3,
}

pub struct TinySpec {
    pub family: Family,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub inter: usize,
    pub vocab: usize,
    pub tie: bool,
    pub dtype: DType,
}

impl TinySpec {
    pub fn llama() -> Self {
        Self {
            family: Family::Llama,
            hidden: 64,
            layers: 3,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            inter: 96,
            vocab: 320,
            tie: true,
            dtype: DType::F32,
        }
    }
    /// A Llama whose every matrix is a whole number of 256-value K-quant super-blocks
    /// wide (and so of every 32-value block format too), its head dim a real model's.
    pub fn llama_wide() -> Self {
        Self {
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            inter: 512,
            tie: false,
            ..Self::llama()
        }
    }
    pub fn qwen3() -> Self {
        // head_dim * heads != hidden on purpose, as in real Qwen3 configs.
        Self {
            family: Family::Qwen3,
            hidden: 48,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            inter: 80,
            vocab: 300,
            tie: false,
            dtype: DType::BF16,
        }
    }

    /// Qwen2 has no `head_dim` key: heads * head_dim == hidden, as candle's qwen2 assumes.
    pub fn qwen2() -> Self {
        Self {
            family: Family::Qwen2,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            inter: 80,
            vocab: 300,
            tie: true,
            dtype: DType::BF16,
        }
    }

    pub fn config_json(&self) -> String {
        if self.family == Family::Qwen2 {
            // As Qwen2.5 checkpoints write it: a sliding_window that `use_sliding_window`
            // switches off, and no `attention_bias` key.
            serde_json::json!({
                "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.inter,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "max_position_embeddings": 512,
                "sliding_window": 32768, "max_window_layers": self.layers, "use_sliding_window": false,
                "tie_word_embeddings": self.tie, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2
            })
            .to_string()
        } else if self.family == Family::Qwen3 {
            serde_json::json!({
                "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.inter,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads, "head_dim": self.head_dim,
                "attention_bias": false, "num_key_value_heads": self.kv_heads, "max_position_embeddings": 512,
                "sliding_window": null, "max_window_layers": self.layers, "tie_word_embeddings": self.tie,
                "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": false, "hidden_act": "silu",
                "bos_token_id": 1, "eos_token_id": 2
            })
            .to_string()
        } else {
            // transformers 5.x style: rope settings inside `rope_parameters`, with llama3 scaling.
            serde_json::json!({
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.inter,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "max_position_embeddings": 512,
                "tie_word_embeddings": self.tie, "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                "bos_token_id": 1, "eos_token_id": 2
            })
            .to_string()
        }
    }

    /// The same Llama config as transformers 4.x writes it (rope settings at the top level),
    /// which is also the form candle-transformers reads.
    pub fn config_json_v4(&self) -> String {
        let mut v: serde_json::Value = serde_json::from_str(&self.config_json()).unwrap();
        if let Some(rp) = v.as_object_mut().unwrap().remove("rope_parameters") {
            v["rope_theta"] = rp["rope_theta"].clone();
            let mut scaling = rp.clone();
            scaling.as_object_mut().unwrap().remove("rope_theta");
            v["rope_scaling"] = scaling;
        }
        v.to_string()
    }

    /// Random weights with HF names, as candle tensors of `self.dtype`.
    pub fn weights(&self, seed: u64) -> HashMap<String, Tensor> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut t = HashMap::new();
        let mut add = |name: String, shape: &[usize], scale: f32, offset: f32| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n)
                .map(|_| offset + scale * rng.random_range(-1.0f32..1.0))
                .collect();
            let ten = Tensor::from_vec(data, shape, &Device::Cpu)
                .unwrap()
                .to_dtype(self.dtype)
                .unwrap();
            t.insert(name, ten);
        };
        let (h, q, kv) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        add(
            "model.embed_tokens.weight".into(),
            &[self.vocab, h],
            1.0,
            0.0,
        );
        for i in 0..self.layers {
            let p = format!("model.layers.{i}");
            add(format!("{p}.self_attn.q_proj.weight"), &[q, h], 0.3, 0.0);
            add(format!("{p}.self_attn.k_proj.weight"), &[kv, h], 0.3, 0.0);
            add(format!("{p}.self_attn.v_proj.weight"), &[kv, h], 0.3, 0.0);
            add(format!("{p}.self_attn.o_proj.weight"), &[h, q], 0.3, 0.0);
            if self.family == Family::Qwen2 {
                // Large enough that a model ignoring them computes visibly different logits.
                add(format!("{p}.self_attn.q_proj.bias"), &[q], 0.5, 0.0);
                add(format!("{p}.self_attn.k_proj.bias"), &[kv], 0.5, 0.0);
                add(format!("{p}.self_attn.v_proj.bias"), &[kv], 0.5, 0.0);
            }
            if self.family == Family::Qwen3 {
                add(
                    format!("{p}.self_attn.q_norm.weight"),
                    &[self.head_dim],
                    0.2,
                    1.0,
                );
                add(
                    format!("{p}.self_attn.k_norm.weight"),
                    &[self.head_dim],
                    0.2,
                    1.0,
                );
            }
            add(format!("{p}.input_layernorm.weight"), &[h], 0.2, 1.0);
            add(
                format!("{p}.post_attention_layernorm.weight"),
                &[h],
                0.2,
                1.0,
            );
            add(
                format!("{p}.mlp.gate_proj.weight"),
                &[self.inter, h],
                0.3,
                0.0,
            );
            add(
                format!("{p}.mlp.up_proj.weight"),
                &[self.inter, h],
                0.3,
                0.0,
            );
            add(
                format!("{p}.mlp.down_proj.weight"),
                &[h, self.inter],
                0.3,
                0.0,
            );
        }
        add("model.norm.weight".into(), &[h], 0.2, 1.0);
        if !self.tie {
            add("lm_head.weight".into(), &[self.vocab, h], 0.3, 0.0);
        }
        t
    }

    /// Writes config.json, model.safetensors and a small byte-level tokenizer.json.
    pub fn write(&self, dir: &Path, seed: u64) -> HashMap<String, Tensor> {
        std::fs::write(dir.join("config.json"), self.config_json()).unwrap();
        let w = self.weights(seed);
        candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
        write_tokenizer(dir, self.vocab);
        w
    }
}

/// A byte-level BPE tokenizer whose vocab is the 256 byte symbols plus specials.
/// `spec` with weights from `seed`, written under `name` and loaded as the runtime would.
pub fn load_tiny(spec: TinySpec, name: &str, seed: u64) -> std::sync::Arc<strata::model::Model> {
    use strata::model::{weights, Model, ModelConfig};
    let dir = scratch_dir(name);
    spec.write(&dir, seed);
    let json = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut cfg = ModelConfig::from_hf_json(&json).unwrap();
    let w = weights::load_safetensors(&dir, &mut cfg, false).unwrap();
    std::sync::Arc::new(Model::new(cfg, w))
}

pub fn write_tokenizer(dir: &Path, vocab_size: usize) {
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let alphabet = ByteLevel::alphabet();
    let mut symbols: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut chars: Vec<char> = alphabet.into_iter().collect();
    chars.sort();
    symbols.extend(chars.iter().map(|c| c.to_string()));
    symbols.truncate(vocab_size);
    let vocab: tokenizers::models::bpe::Vocab = symbols
        .iter()
        .enumerate()
        .map(|(i, s)| (s.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, vec![])
        .unk_token("<unk>".into())
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.add_special_tokens(vec![
        tokenizers::AddedToken::from("<s>", true),
        tokenizers::AddedToken::from("</s>", true),
    ])
    .unwrap();
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    let tc = serde_json::json!({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    });
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
}

/// Largest |a - b| over two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn default_model_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The real model, or a panic that says how to get it (CI fetches it first).
pub fn require_default_model() -> PathBuf {
    let p = default_model_path();
    assert!(
        p.exists(),
        "{} is missing: run models/fetch.sh",
        p.display()
    );
    p
}

/// A tiny Gemma 3 in memory (random weights): five layers with a sliding window of
/// `window` to one full layer, the local layers' own RoPE base, sandwich norms, GeGLU.
pub fn tiny_gemma3(window: usize) -> std::sync::Arc<strata::model::Model> {
    let cfg = strata::model::random::Shape::tiny_gemma3(window).config();
    let w = strata::model::random::random_weights(&cfg, 23, 1.0);
    std::sync::Arc::new(strata::model::Model::new(cfg, w))
}

/// Gemma 3 270M (`models/fetch-gemma3.sh`), or `None` after a loud skip message; a panic
/// under `CI=true`, where `.ci/run` must have fetched it.
pub fn gemma3_model() -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/gemma-3-270m-q4_k_m.gguf");
    if path.exists() {
        return Some(path);
    }
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    assert!(
        !ci,
        "{} is missing (CI=true): run models/fetch-gemma3.sh",
        path.display()
    );
    eprintln!(
        "\n**** SKIPPED: {} is missing; run models/fetch-gemma3.sh ****\n",
        path.display()
    );
    None
}

/// transformers' tokenizer and forward on the Gemma 3 file (tests/data/gemma3/README.md).
pub fn gemma3_reference() -> serde_json::Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/gemma3/hf_reference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// The Python interpreter the Python-driven tests use (`$STRATA_TEST_PYTHON`, else
/// `python3`), if it imports `modules`. Otherwise `None` after a loud skip message, or a
/// panic under `CI=true`, where `.ci/run` must have installed them (`install` says how).
pub fn python_with(modules: &str, install: &str) -> Option<String> {
    let python = std::env::var("STRATA_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let found = std::process::Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if found {
        return Some(python);
    }
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    assert!(!ci, "{python} cannot import {modules} (CI=true): {install}");
    eprintln!("\n**** SKIPPED: {python} cannot import {modules}; {install} ****\n");
    None
}

/// Runs `scripts/<script> DIR` (a writer of GGUF files from a checkpoint in tests/data)
/// into a scratch directory `name` and checks each `(file, sha256)` of `expected` is a line
/// it printed: the same bytes llama.cpp's recorded reference ran on. `None` (skipped
/// loudly, a failure under CI=true) without gguf-py.
pub fn gguf_from_script(
    script: &str,
    name: &str,
    expected: &[(String, String)],
) -> Option<PathBuf> {
    let python = python_with("gguf, numpy", "pip install gguf")?;
    let dir = scratch_dir(&format!("{name}_{:?}", std::thread::current().id()));
    let out = std::process::Command::new(python)
        .arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("scripts")
                .join(script),
        )
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8(out.stdout).unwrap();
    for (file, sha) in expected {
        assert!(
            printed.contains(&format!("{file} {sha}")),
            "{file}: not the bytes llama.cpp ran on: {printed}"
        );
    }
    Some(dir)
}

/// The serving engine's scheduler in the tests: blocks of 4 tokens, prefill chunks of 8,
/// `gpu` device blocks and `cpu` host blocks (0: preemption recomputes).
pub fn serve_sched(gpu: usize, cpu: usize) -> strata::serve::SchedulerConfig {
    strata::serve::SchedulerConfig {
        block_size: 4,
        num_gpu_blocks: gpu,
        max_cpu_offload_blocks: cpu,
        max_disk_offload_blocks: 0,
        max_num_seqs: 16,
        max_num_batched_tokens: 16, // few requests join per step, so later ones hit the prefix cache
        prefill_chunk: 8,
    }
}

/// A serving engine's configuration around `serve_sched`, without a disk tier.
pub fn serve_config(
    kv_dtype: strata::device::KvDtype,
    gpu: usize,
    cpu: usize,
    sanitize: bool,
) -> strata::serve::EngineConfig {
    strata::serve::EngineConfig {
        sched: serve_sched(gpu, cpu),
        link_gbps: 0.0,
        sanitize,
        check_order: strata::device::order::on_by_default(),
        disk: None,
        kv_dtype,
    }
}

/// `n` serving requests for a tiny model (ids 3..300): prompts of 5..70 tokens that share
/// their first `shared` tokens, 5..40 new tokens each, run past end-of-sequence.
pub fn serve_requests(
    seed: u64,
    n: usize,
    shared: usize,
) -> (Vec<Vec<u32>>, Vec<strata::serve::RequestParams>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let prefix: Vec<u32> = (0..shared).map(|_| rng.random_range(3..300)).collect();
    let prompts = (0..n)
        .map(|_| {
            let len = rng.random_range(shared.max(5)..70);
            let mut p = prefix.clone();
            p.extend((shared..len).map(|_| rng.random_range(3..300)));
            p
        })
        .collect();
    let params = (0..n)
        .map(|_| strata::serve::RequestParams {
            max_tokens: rng.random_range(5..40),
            ignore_eos: true,
            ..Default::default()
        })
        .collect();
    (prompts, params)
}

/// transformers' tiny random gpt-oss (tests/data/gpt_oss/tiny_random,
/// scripts/gptoss-tiny-random.py) in a scratch directory `name` with a byte-level
/// tokenizer of its 512 tokens: a Hugging Face directory `generate` and `serve` load.
/// transformers' own forward recorded on a tiny random checkpoint it made (the
/// `reference.json` scripts/*-tiny-random.py write beside it).
#[derive(Clone)]
pub struct HfReference {
    pub prompt: Vec<u32>,
    /// Positions whose logits were recorded, and those logits `[vocab]` each.
    pub rows: Vec<usize>,
    pub logits: Vec<Vec<f32>>,
    /// transformers' greedy continuation of the prompt.
    pub greedy: Vec<u32>,
    /// The whole file, for keys a family records besides these.
    pub json: serde_json::Value,
}

impl HfReference {
    pub fn load(path: impl AsRef<Path>) -> Self {
        let text = std::fs::read_to_string(path.as_ref()).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let get = |k: &str| json[k].clone();
        Self {
            prompt: serde_json::from_value(get("prompt_ids")).unwrap(),
            rows: serde_json::from_value(get("logits_rows")).unwrap(),
            logits: serde_json::from_value(get("logits")).unwrap(),
            greedy: serde_json::from_value(get("greedy_ids")).unwrap(),
            json,
        }
    }

    /// The largest |strata − transformers| over the recorded rows, `all` holding strata's
    /// logits of every position.
    pub fn worst(&self, all: &[Vec<f32>]) -> f32 {
        self.rows
            .iter()
            .zip(&self.logits)
            .map(|(&row, want)| max_abs_diff(&all[row], want))
            .fold(0.0, f32::max)
    }
}

pub fn tiny_gpt_oss_dir(name: &str) -> PathBuf {
    tiny_random_dir("gpt_oss", name)
}

/// A copy of `tests/data/<family>/tiny_random` (a checkpoint transformers made, with no
/// tokenizer) in scratch directory `name`, with a 512-token BPE tokenizer beside it.
pub fn tiny_random_dir(family: &str, name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(family)
        .join("tiny_random");
    tiny_random_dir_of(&src, name)
}

/// `tiny_random_dir` of the checkpoint directory `src`.
pub fn tiny_random_dir_of(src: impl AsRef<Path>, name: &str) -> PathBuf {
    let src = src.as_ref();
    let dir = scratch_dir(name);
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    write_tokenizer(&dir, 512);
    dir
}

/// `tests/data/qwen3_5/tiny_random` (transformers' random Qwen3.5), loaded as stored
/// (bf16 rows read in place).
pub fn tiny_qwen35(name: &str) -> std::sync::Arc<strata::model::Model> {
    strata::model::Model::load(&tiny_random_dir("qwen3_5", name), false)
        .unwrap()
        .0
}

/// `tests/data/qwen3_5/tiny_random_moe` (transformers' random Qwen3.5 MoE: 16 experts,
/// 4 per token, a shared expert), loaded as stored.
pub fn tiny_qwen35_moe(name: &str) -> std::sync::Arc<strata::model::Model> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/qwen3_5/tiny_random_moe");
    strata::model::Model::load(&tiny_random_dir_of(src, name), false)
        .unwrap()
        .0
}

/// `tiny_gpt_oss_dir`, loaded as stored (bf16 attention and router, f32 experts).
pub fn tiny_gpt_oss(name: &str) -> std::sync::Arc<strata::model::Model> {
    strata::model::Model::load(&tiny_gpt_oss_dir(name), false)
        .unwrap()
        .0
}
