//! The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): strata's greedy continuation
//! of a fixed chat prompt equals candle-transformers' `llama` run on the same dequantized
//! weights. The reference un-permutes Q/K with its own tensor ops (not strata's loader).

mod common;

use std::collections::HashMap;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama;
use strata::engine::{self, GenerateOptions, SamplingParams};
use strata::model::weights::WeightDtype;
use strata::model::Model;

const STEPS: usize = 24;
const PROMPT: &str = "Write a short story about a robot who learns to paint.";

/// HF-named f32 tensors from the GGUF, Q/K rows restored to HF order.
fn reference_weights(
    path: &std::path::Path,
    heads: usize,
    kv_heads: usize,
) -> HashMap<String, Tensor> {
    let mut f = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let dev = Device::Cpu;
    let mut out = HashMap::new();
    for name in content.tensor_infos.keys() {
        let t = content
            .tensor(&mut f, name, &dev)
            .unwrap()
            .dequantize(&dev)
            .unwrap();
        let hf = if let Some(rest) = name.strip_prefix("blk.") {
            let (i, part) = rest.split_once('.').unwrap();
            let p = match part {
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "attn_norm.weight" => "input_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                "ffn_down.weight" => "mlp.down_proj.weight",
                other => panic!("unexpected tensor {other}"),
            };
            format!("model.layers.{i}.{p}")
        } else {
            match name.as_str() {
                "token_embd.weight" => "model.embed_tokens.weight".into(),
                "output_norm.weight" => "model.norm.weight".into(),
                other => panic!("unexpected tensor {other}"),
            }
        };
        // llama.cpp: w.reshape(n, 2, d/2, cols).swapaxes(1, 2); undone by the inverse reshape.
        let n = if name.ends_with("attn_q.weight") {
            Some(heads)
        } else if name.ends_with("attn_k.weight") {
            Some(kv_heads)
        } else {
            None
        };
        let t = match n {
            Some(n) => {
                let (rows, cols) = t.dims2().unwrap();
                t.reshape((n, rows / n / 2, 2, cols))
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap()
                    .contiguous()
                    .unwrap()
                    .reshape((rows, cols))
                    .unwrap()
            }
            None => t,
        };
        out.insert(hf, t);
    }
    out
}

#[test]
fn greedy_continuation_matches_candle_llama() {
    let path = common::require_default_model();
    let (model, tok) = Model::load(&path, false).unwrap();
    let c = &model.cfg;
    assert_eq!(
        (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim),
        (30, 9, 3, 64)
    );
    let prompt = tok
        .encode(&tok.apply_chat_template(PROMPT).unwrap(), false)
        .unwrap();

    // strata, greedy, no stop token so both run the full length.
    let opts = GenerateOptions {
        max_tokens: STEPS,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
    };
    // In every KV element: the 16-bit caches round K and V, and must still decode HF's
    // tokens on this prompt (the bar for a KV element to be the CPU default).
    let ours: Vec<Vec<u32>> = common::KV_DTYPES
        .iter()
        .map(|&kv| common::generate_plain(&model, kv, &prompt, &opts, 8192).token_ids)
        .collect();
    // The CPU's default mode, q8 (integer dots on two-plane activations), in every KV
    // element too: not bitwise, but it must decode the same tokens (the bar for being the
    // default: docs/cpu.md, "Accuracy"; one 8-bit plane did not).
    let (q8, _) = Model::load_as(&path, false, WeightDtype::Q8).unwrap();
    let ours_q8: Vec<Vec<u32>> = common::KV_DTYPES
        .iter()
        .map(|&kv| common::generate_plain(&q8, kv, &prompt, &opts, 8192).token_ids)
        .collect();

    // candle-transformers llama on the same dequantized weights.
    let cfg = llama::Config {
        hidden_size: 576,
        intermediate_size: 1536,
        vocab_size: 49152,
        num_hidden_layers: 30,
        num_attention_heads: 9,
        num_key_value_heads: 3,
        use_flash_attn: false,
        rms_norm_eps: c.rms_norm_eps as f64,
        rope_theta: 100000.0,
        bos_token_id: Some(1),
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
    };
    let vb = VarBuilder::from_tensors(reference_weights(&path, 9, 3), DType::F32, &Device::Cpu);
    let reference = llama::Llama::load(vb, &cfg).unwrap();
    let mut cache = llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
    let mut theirs = Vec::new();
    let mut input = prompt.clone();
    let mut pos = 0;
    for _ in 0..STEPS {
        let x = Tensor::new(input.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits: Vec<f32> = reference
            .forward(&x, pos, &mut cache)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        pos += input.len();
        let next = strata::engine::sampler::argmax(&logits);
        theirs.push(next);
        input = vec![next];
    }
    let modes = ours.iter().map(|o| ("stored", o));
    let modes = modes.chain(ours_q8.iter().map(|o| ("q8", o)));
    for ((dtype, ours), kv) in modes.zip(common::KV_DTYPES.iter().cycle()) {
        assert_eq!(
            ours,
            &theirs,
            "{dtype}, KV {kv}: strata: {:?}\ncandle: {:?}",
            tok.decode(ours, false),
            tok.decode(&theirs, false)
        );
    }
    assert!(
        !theirs.contains(&2),
        "the continuation ended early; pick a prompt with a longer answer"
    );
}

#[test]
fn serving_batched_and_chunked_equals_generate_bitwise() {
    // Three chat prompts served together (16-token blocks, 64-token prefill chunks, decode
    // rows batched with prefill chunks) against `strata generate`'s whole-prompt,
    // contiguous-cache run of each alone: the same tokens and the same log-probability bits.
    use strata::serve::{Engine, EngineConfig, RequestParams, SchedulerConfig};
    let path = common::require_default_model();
    let (model, tok) = Model::load(&path, false).unwrap();
    let prompts: Vec<Vec<u32>> = [
        PROMPT,
        "What is the capital of France?",
        "List three prime numbers and explain why each of them is prime, in one sentence each.",
    ]
    .iter()
    .map(|p| {
        tok.encode(&tok.apply_chat_template(p).unwrap(), false)
            .unwrap()
    })
    .collect();
    let max_tokens = 12;
    let params = RequestParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    let cfg = EngineConfig {
        kv_dtype: strata::device::KvDtype::F32,
        sched: SchedulerConfig {
            block_size: 16,
            num_gpu_blocks: 64,
            max_cpu_offload_blocks: 0,
            max_disk_offload_blocks: 0,
            max_num_seqs: 16,
            max_num_batched_tokens: 96,
            prefill_chunk: 32,
        },
        link_gbps: 0.0,
        sanitize: false,
        check_order: strata::device::order::on_by_default(),
        disk: None,
    };
    let got = Engine::new(model.clone(), cfg)
        .unwrap()
        .generate_with_logprobs(&prompts, &[params])
        .unwrap();
    let opts = GenerateOptions {
        max_tokens,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
    };
    for (i, p) in prompts.iter().enumerate() {
        let want = engine::generate(&model, p, &opts, 8192, &mut |_| Ok(())).unwrap();
        assert_eq!(got[i].0, want.token_ids, "prompt {i}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got[i].1), bits(&want.logprobs), "prompt {i}");
    }
}
