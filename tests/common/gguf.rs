//! GGUF files written from tiny random models (the tests' stand-in for llama.cpp's
//! converter): llama.cpp's tensor names, Q/K row permutation for `llama`, a byte-level
//! tokenizer in the metadata.

use candle_core::quantized::{gguf_file::Value, GgmlDType, QTensor};
use candle_core::Tensor;

use super::{Family, TinySpec};

/// llama.cpp's `permute`: HF rows (head, half, pair-index) → interleaved rotary pairs.
pub fn llama_cpp_permute(w: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    w.reshape((heads, 2, rows / heads / 2, cols))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((rows, cols))
        .unwrap()
}

pub fn gguf_name(hf: &str) -> String {
    let map = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = map.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (i, part) = rest.split_once('.').unwrap();
    let p = match part {
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        other => panic!("unmapped {other}"),
    };
    format!("blk.{i}.{p}")
}

pub fn gguf_arch(f: Family) -> &'static str {
    match f {
        Family::Llama => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
    }
}

/// Writes `spec`'s weights as a GGUF file with the given architecture and pre-tokenizer,
/// each tensor in `dtype_of(its HF name)` (quantized by candle).
pub fn write_gguf_as(
    spec: &TinySpec,
    w: &std::collections::HashMap<String, Tensor>,
    path: &std::path::Path,
    pre: &str,
    dtype_of: &dyn Fn(&str) -> GgmlDType,
) {
    let arch = gguf_arch(spec.family);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (name, t) in w {
        let t = t.to_dtype(candle_core::DType::F32).unwrap();
        // llama.cpp permutes Q/K rows for its `llama` arch only (not qwen2, not qwen3).
        let t = match (
            spec.family,
            name.contains("q_proj.weight"),
            name.contains("k_proj.weight"),
        ) {
            (Family::Llama, true, _) => llama_cpp_permute(&t, spec.heads),
            (Family::Llama, _, true) => llama_cpp_permute(&t, spec.kv_heads),
            _ => t,
        };
        tensors.push((
            gguf_name(name),
            QTensor::quantize(&t, dtype_of(name)).unwrap(),
        ));
    }
    // Vocab: specials, the 256 byte-level symbols, then fillers up to the model's size.
    let mut tokens = strata::fuzz::corpus::byte_level_vocab();
    while tokens.len() < spec.vocab {
        tokens.push(format!("<extra_{}>", tokens.len()));
    }
    tokens.truncate(spec.vocab);
    let types: Vec<Value> = (0..tokens.len())
        .map(|i| Value::I32(if i < 3 { 3 } else { 1 }))
        .collect();
    let s = |x: &str| Value::String(x.to_string());
    let u = |x: usize| Value::U32(x as u32);
    let k = |key: &str| format!("{arch}.{key}");
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(arch)),
        (k("block_count"), u(spec.layers)),
        (k("embedding_length"), u(spec.hidden)),
        (k("feed_forward_length"), u(spec.inter)),
        (k("attention.head_count"), u(spec.heads)),
        (k("attention.head_count_kv"), u(spec.kv_heads)),
        (k("attention.key_length"), u(spec.head_dim)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (k("rope.freq_base"), Value::F32(10000.0)),
        (k("context_length"), u(512)),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s(pre)),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens.iter().map(|t| s(t)).collect())),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(vec![])),
        ("tokenizer.ggml.eos_token_id".into(), u(2)),
        ("tokenizer.chat_template".into(), s("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")),
    ];
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(a, b)| (a.as_str(), b)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(a, b)| (a.as_str(), b)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    candle_core::quantized::gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
}

/// `write_gguf_as` with every tensor in f32.
pub fn write_gguf(
    spec: &TinySpec,
    w: &std::collections::HashMap<String, Tensor>,
    path: &std::path::Path,
    pre: &str,
) {
    write_gguf_as(spec, w, path, pre, &|_| GgmlDType::F32);
}
