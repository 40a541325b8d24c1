//! The fuzzer's base inputs: tiny valid models in both formats (Llama and Qwen3 layouts,
//! f32/f16/Q8_0 tensors in GGUF, f32/bf16 in safetensors), their tokenizer files, and chat
//! templates in the styles real models ship.

use candle_core::quantized::gguf_file::Value;
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::gguf_writer::{GgufDoc, GgufTensor, GGML_F16, GGML_F32, GGML_MXFP4, GGML_Q8_0};
use super::Case;

const HIDDEN: usize = 32;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 8;
const INTER: usize = 64;
const MAX_POS: usize = 128;
/// gpt-oss's experts, and how many a token takes.
const EXPERTS: usize = 4;
const EXPERTS_USED: usize = 2;

/// The three specials (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ids 0–2), then the
/// 256 byte-level symbols in order: the start of every tiny test model's vocabulary.
pub fn byte_level_vocab() -> Vec<String> {
    let mut v: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    let mut chars: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
        .into_iter()
        .collect();
    chars.sort();
    v.extend(chars.iter().map(|c| c.to_string()));
    v
}

/// Token strings: `byte_level_vocab()` and three merged pairs.
fn vocab() -> Vec<String> {
    let mut v = byte_level_vocab();
    v.extend(["he", "ll", "Ġw"].map(String::from));
    v
}

const MERGES: [&str; 3] = ["h e", "l l", "Ġ w"];

/// Entries of `vocab()`.
pub const TINY_VOCAB: usize = 3 + 256 + 3;

pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Templates in the shapes real models ship (ChatML, Llama 3, a Qwen-style one with a
/// system default, namespace and raise_exception, the test suite's tiny one).
pub fn templates() -> Vec<&'static str> {
    vec![
        CHATML,
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
        "{%- set ns = namespace(system=false) -%}{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.system = true -%}{%- endif -%}{%- endfor -%}{%- if not ns.system -%}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{%- endif -%}{%- for m in messages -%}{%- if m.role not in ['system', 'user', 'assistant'] -%}{{ raise_exception('bad role ' ~ m.role) }}{%- endif -%}<|im_start|>{{ m.role }}\n{{ m.content | replace('\\r', '') }}<|im_end|>\n{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}",
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
        "{% for m in messages %}{% set content = m.content.strip() %}{% if loop.first %}{{ bos_token }}{% endif %}[{{ m.role | upper }}] {{ content[:200] }}{{ eos_token if m.role == 'assistant' else '' }}{% endfor %}{{ messages | length }}",
    ]
}

/// The context every fuzzed template renders with: a short conversation.
pub fn template_context() -> minijinja::Value {
    let msg = |role: &str, content: &str| minijinja::context! { role => role, content => content };
    minijinja::context! {
        messages => vec![
            msg("system", "Be brief."),
            msg("user", "Hello\nthere"),
            msg("assistant", "Hi."),
            msg("user", "What is 2+2?"),
        ],
        add_generation_prompt => true,
        bos_token => "<|im_start|>",
        eos_token => "<|im_end|>",
    }
}

pub fn template_cases() -> Vec<Case> {
    templates()
        .into_iter()
        .map(|t| Case {
            files: vec![("template".into(), t.as_bytes().to_vec())],
        })
        .collect()
}

/// A tiny model's tensors by Hugging Face name: (shape, values).
fn hf_tensors(qk_norm: bool, tied: bool) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = StdRng::seed_from_u64(11);
    let mut out = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, offset: f32| {
        let n = shape.iter().product();
        let v = (0..n)
            .map(|_| offset + rng.random_range(-0.3f32..0.3))
            .collect();
        out.push((name, shape, v));
    };
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    add(
        "model.embed_tokens.weight".into(),
        vec![TINY_VOCAB, HIDDEN],
        0.0,
    );
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        add(format!("{p}.self_attn.q_proj.weight"), vec![q, HIDDEN], 0.0);
        add(
            format!("{p}.self_attn.k_proj.weight"),
            vec![kv, HIDDEN],
            0.0,
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            vec![kv, HIDDEN],
            0.0,
        );
        add(format!("{p}.self_attn.o_proj.weight"), vec![HIDDEN, q], 0.0);
        if qk_norm {
            add(format!("{p}.self_attn.q_norm.weight"), vec![HEAD_DIM], 1.0);
            add(format!("{p}.self_attn.k_norm.weight"), vec![HEAD_DIM], 1.0);
        }
        add(format!("{p}.input_layernorm.weight"), vec![HIDDEN], 1.0);
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![HIDDEN],
            1.0,
        );
        add(
            format!("{p}.mlp.gate_proj.weight"),
            vec![INTER, HIDDEN],
            0.0,
        );
        add(format!("{p}.mlp.up_proj.weight"), vec![INTER, HIDDEN], 0.0);
        add(
            format!("{p}.mlp.down_proj.weight"),
            vec![HIDDEN, INTER],
            0.0,
        );
    }
    add("model.norm.weight".into(), vec![HIDDEN], 1.0);
    if !tied {
        add("lm_head.weight".into(), vec![TINY_VOCAB, HIDDEN], 0.0);
    }
    out
}

fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").expect("a layer tensor");
    let (i, part) = rest.split_once('.').expect("layer.part");
    let p = match part {
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        other => unreachable!("unmapped {other}"),
    };
    format!("blk.{i}.{p}")
}

/// Q8_0: blocks of 32 values, an f16 scale then 32 signed bytes.
fn q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for block in values.chunks(32) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for &x in block {
            let q = if d == 0.0 { 0.0 } else { (x / d).round() };
            out.push(q as i8 as u8);
        }
    }
    out
}

/// The architectures `gguf_doc` writes: the fuzz targets' GGUF bases.
pub const GGUF_ARCHS: [&str; 5] = ["llama", "qwen3", "gemma3", "gpt-oss", "qwen35moe"];

pub fn gguf_doc(arch: &str) -> GgufDoc {
    let gemma3 = arch == "gemma3";
    let oss = arch == "gpt-oss";
    let qwen35 = arch == "qwen35moe";
    let qwen3 = arch == "qwen3" || gemma3 || qwen35; // q/k norms, explicit head size
    let s = |x: &str| Value::String(x.to_string());
    let u = |x: usize| Value::U32(x as u32);
    let k = |key: &str| format!("{arch}.{key}");
    let tokens = vocab();
    let mut metadata = vec![
        ("general.architecture".into(), s(arch)),
        ("general.alignment".into(), Value::U32(32)),
        (k("block_count"), u(LAYERS)),
        (k("embedding_length"), u(HIDDEN)),
        (k("feed_forward_length"), u(INTER)),
        (k("attention.head_count"), u(HEADS)),
        (k("attention.head_count_kv"), u(KV_HEADS)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (k("rope.freq_base"), Value::F32(10000.0)),
        (k("context_length"), u(MAX_POS)),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        (
            "tokenizer.ggml.pre".into(),
            s(if qwen3 { "qwen2" } else { "smollm" }),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.iter().map(|t| s(t)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(
                (0..tokens.len())
                    .map(|i| Value::I32(if i < 3 { 3 } else { 1 }))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(MERGES.iter().map(|m| s(m)).collect()),
        ),
        ("tokenizer.ggml.bos_token_id".into(), u(1)),
        ("tokenizer.ggml.eos_token_id".into(), u(2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        ("tokenizer.chat_template".into(), s(CHATML)),
    ];
    if qwen3 {
        metadata.push((k("attention.key_length"), u(HEAD_DIM)));
        metadata.push((k("rope.scaling.type"), s("linear")));
        metadata.push((k("rope.scaling.factor"), Value::F32(2.0)));
    }
    if gemma3 || oss {
        // A window shorter than the fuzz prompts, so the mask and the rings are exercised.
        metadata.push((k("attention.sliding_window"), u(4)));
    }
    if qwen35 {
        for (key, n) in [
            ("ssm.conv_kernel", 4),
            ("ssm.state_size", HEAD_DIM),
            ("ssm.group_count", QWEN35_K_HEADS),
            ("ssm.time_step_rank", QWEN35_V_HEADS),
            ("ssm.inner_size", QWEN35_V_HEADS * HEAD_DIM),
            ("rope.dimension_count", HEAD_DIM / 2),
            ("expert_shared_feed_forward_length", INTER),
        ] {
            metadata.push((k(key), u(n)));
        }
        let layers = (0..LAYERS).map(|i| Value::Bool(i == 0)).collect();
        metadata.push((k("attention.recurrent_layers"), Value::Array(layers)));
    }
    if oss || qwen35 {
        metadata.push((k("expert_count"), u(EXPERTS)));
        metadata.push((k("expert_used_count"), u(EXPERTS_USED)));
        metadata.push((k("expert_feed_forward_length"), u(INTER)));
    }
    if oss {
        metadata.push((k("rope.scaling.type"), s("yarn")));
        metadata.push((k("rope.scaling.factor"), Value::F32(4.0)));
        metadata.push((k("rope.scaling.original_context_length"), u(32)));
    }
    let hf = match qwen35 {
        true => qwen35_gguf_tensors(),
        false => hf_tensors(qwen3, !qwen3)
            .into_iter()
            .map(|(name, shape, values)| (gguf_name(&name), shape, values))
            .collect(),
    };
    let mut tensors: Vec<GgufTensor> = hf
        .into_iter()
        .map(|(name, shape, values)| {
            let (ggml_type, data) = if name.contains("ffn_") && !name.contains("norm") {
                (GGML_Q8_0, q8_0(&values))
            } else if name.contains("attn_q.") || name.contains("attn_k.") {
                let d = values
                    .iter()
                    .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                    .collect();
                (GGML_F16, d)
            } else {
                (
                    GGML_F32,
                    values.iter().flat_map(|x| x.to_le_bytes()).collect(),
                )
            };
            GgufTensor {
                name,
                dims: shape.iter().map(|&d| d as u64).collect(),
                ggml_type,
                data,
                offset: None,
            }
        })
        .collect();
    if gemma3 {
        // Gemma's norms after each sublayer.
        for i in 0..LAYERS {
            for part in ["post_attention_norm", "post_ffw_norm"] {
                tensors.push(GgufTensor {
                    name: format!("blk.{i}.{part}.weight"),
                    dims: vec![HIDDEN as u64],
                    ggml_type: GGML_F32,
                    data: (0..HIDDEN).flat_map(|_| 1f32.to_le_bytes()).collect(),
                    offset: None,
                });
            }
        }
    }
    if oss {
        gpt_oss_tensors(&mut tensors);
    }
    GgufDoc {
        version: 3,
        metadata,
        tensors,
        layout_alignment: 32,
    }
}

/// The tiny Qwen3.5 MoE's tensors (`qwen35_tensors`) as llama.cpp's converter writes them:
/// its names, the conv kernel `[channels, kernel]`, `ssm_a` = −exp(A_log), experts stacked,
/// the shared expert's gate `[hidden]`.
fn qwen35_gguf_tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let hf = qwen35_tensors();
    let mut out = Vec::new();
    // `blk.{i}.ffn_{gate,up,down}_exps.weight` -> each expert's `[out, in]` and values.
    let mut experts: std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> =
        Default::default();
    for (name, shape, values) in hf {
        let mapped = match name.as_str() {
            "model.embed_tokens.weight" => "token_embd.weight".to_string(),
            "model.norm.weight" => "output_norm.weight".to_string(),
            "lm_head.weight" => "output.weight".to_string(),
            _ => {
                let rest = name.strip_prefix("model.layers.").expect("a layer tensor");
                let (i, part) = rest.split_once('.').expect("layer.part");
                if let Some(e) = part.strip_prefix("mlp.experts.") {
                    let (_, proj) = e.split_once('.').expect("expert.part");
                    let which = proj.strip_suffix("_proj.weight").expect("a projection");
                    let stacked = experts
                        .entry(format!("blk.{i}.ffn_{which}_exps.weight"))
                        .or_insert_with(|| (shape.clone(), Vec::new()));
                    stacked.1.extend(values);
                    continue;
                }
                let p = match part {
                    "linear_attn.in_proj_qkv.weight" => "attn_qkv.weight",
                    "linear_attn.in_proj_z.weight" => "attn_gate.weight",
                    "linear_attn.in_proj_b.weight" => "ssm_beta.weight",
                    "linear_attn.in_proj_a.weight" => "ssm_alpha.weight",
                    "linear_attn.conv1d.weight" => "ssm_conv1d.weight",
                    "linear_attn.A_log" => "ssm_a",
                    "linear_attn.dt_bias" => "ssm_dt.bias",
                    "linear_attn.norm.weight" => "ssm_norm.weight",
                    "linear_attn.out_proj.weight" => "ssm_out.weight",
                    "post_attention_layernorm.weight" => "post_attention_norm.weight",
                    "mlp.gate.weight" => "ffn_gate_inp.weight",
                    "mlp.shared_expert.gate_proj.weight" => "ffn_gate_shexp.weight",
                    "mlp.shared_expert.up_proj.weight" => "ffn_up_shexp.weight",
                    "mlp.shared_expert.down_proj.weight" => "ffn_down_shexp.weight",
                    "mlp.shared_expert_gate.weight" => "ffn_gate_inp_shexp.weight",
                    _ => {
                        out.push((gguf_name(&name), shape, values));
                        continue;
                    }
                };
                format!("blk.{i}.{p}")
            }
        };
        let (shape, values) = match mapped.as_str() {
            n if n.ends_with("ssm_conv1d.weight") => (vec![shape[0], shape[2]], values),
            n if n.ends_with("ssm_a") => (shape, values.iter().map(|x| -x.exp()).collect()),
            n if n.ends_with("ffn_gate_inp_shexp.weight") => (vec![shape[1]], values),
            _ => (shape, values),
        };
        out.push((mapped, shape, values));
    }
    out.extend(
        (experts.into_iter())
            .map(|(name, (shape, values))| (name, [&[EXPERTS][..], &shape].concat(), values)),
    );
    out
}

/// The tiny Llama's tensors made gpt-oss's: the dense MLP replaced by experts (gate Q8_0,
/// up f32, down MXFP4: every expert format path), its norm renamed, biases and sinks added.
fn gpt_oss_tensors(tensors: &mut Vec<GgufTensor>) {
    let dense = ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"];
    tensors.retain(|t| !dense.iter().any(|d| t.name.ends_with(d)));
    for t in tensors.iter_mut() {
        if let Some(i) = t.name.strip_suffix(".ffn_norm.weight") {
            t.name = format!("{i}.post_attention_norm.weight");
        }
    }
    let mut rng = StdRng::seed_from_u64(39);
    let mut values =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-0.3f32..0.3)).collect() };
    let f32_bytes = |v: Vec<f32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    for i in 0..LAYERS {
        let mut add = |part: &str, dims: Vec<usize>, ggml_type: u32, data: Vec<u8>| {
            tensors.push(GgufTensor {
                name: format!("blk.{i}.{part}"),
                dims: dims.iter().map(|&d| d as u64).collect(),
                ggml_type,
                data,
                offset: None,
            })
        };
        for (part, n) in [
            ("attn_q.bias", q),
            ("attn_k.bias", kv),
            ("attn_v.bias", kv),
            ("attn_output.bias", HIDDEN),
            ("attn_sinks.weight", HEADS),
            ("ffn_gate_inp.bias", EXPERTS),
        ] {
            add(part, vec![n], GGML_F32, f32_bytes(values(n)));
        }
        add(
            "ffn_gate_inp.weight",
            vec![EXPERTS, HIDDEN],
            GGML_F32,
            f32_bytes(values(EXPERTS * HIDDEN)),
        );
        for (part, out) in [
            ("ffn_gate_exps.bias", INTER),
            ("ffn_up_exps.bias", INTER),
            ("ffn_down_exps.bias", HIDDEN),
        ] {
            add(
                part,
                vec![EXPERTS, out],
                GGML_F32,
                f32_bytes(values(EXPERTS * out)),
            );
        }
        let gate = q8_0(&values(EXPERTS * INTER * HIDDEN));
        add(
            "ffn_gate_exps.weight",
            vec![EXPERTS, INTER, HIDDEN],
            GGML_Q8_0,
            gate,
        );
        let up = f32_bytes(values(EXPERTS * INTER * HIDDEN));
        add(
            "ffn_up_exps.weight",
            vec![EXPERTS, INTER, HIDDEN],
            GGML_F32,
            up,
        );
        // MXFP4 blocks: an E8M0 scale near 2^-4, then 16 bytes of codes.
        let blocks = EXPERTS * HIDDEN * INTER / 32;
        let down: Vec<u8> = (0..blocks)
            .flat_map(|b| {
                std::iter::once(121u8).chain((0..16).map(move |j| (b * 7 + j * 13) as u8))
            })
            .collect();
        add(
            "ffn_down_exps.weight",
            vec![EXPERTS, HIDDEN, INTER],
            GGML_MXFP4,
            down,
        );
    }
}

pub fn gguf_cases() -> Vec<Case> {
    // The tiny Llama again with a SentencePiece tokenizer (`llama`: byte tokens `<0xHH>`,
    // `▁` for a space, no merges listed: they are derived from the vocabulary).
    let mut spm = gguf_doc("llama");
    let mut pieces: Vec<String> = vocab()[..3].to_vec();
    pieces.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    pieces.extend(["\u{2581}", "h", "\u{2581}h"].map(String::from));
    debug_assert_eq!(pieces.len(), TINY_VOCAB);
    spm.metadata.retain(|(k, _)| k != "tokenizer.ggml.merges");
    for (k, v) in spm.metadata.iter_mut() {
        match k.as_str() {
            "tokenizer.ggml.model" => *v = Value::String("llama".into()),
            "tokenizer.ggml.tokens" => {
                *v = Value::Array(pieces.iter().map(|p| Value::String(p.clone())).collect())
            }
            _ => {}
        }
    }
    spm.metadata
        .push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(true)));
    GGUF_ARCHS
        .map(gguf_doc)
        .into_iter()
        .chain([spm])
        .map(|doc| Case {
            files: vec![("model.gguf".into(), doc.to_bytes())],
        })
        .collect()
}

fn config_json(qwen3: bool) -> serde_json::Value {
    let mut v = serde_json::json!({
        "architectures": [if qwen3 { "Qwen3ForCausalLM" } else { "LlamaForCausalLM" }],
        "model_type": if qwen3 { "qwen3" } else { "llama" },
        "vocab_size": TINY_VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "max_position_embeddings": MAX_POS,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": !qwen3,
        "bos_token_id": 1, "eos_token_id": 2,
    });
    if qwen3 {
        v["head_dim"] = HEAD_DIM.into();
        v["rope_theta"] = 1_000_000.0.into();
        v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 2.0});
    } else {
        v["rope_parameters"] = serde_json::json!({"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64});
    }
    v
}

/// `model.safetensors` bytes of the Llama / Qwen3 base.
fn safetensors_bytes(qwen3: bool) -> Vec<u8> {
    serialize(hf_tensors(qwen3, !qwen3))
}

/// Tensors as `model.safetensors` bytes: f32, bf16 for the MLP's.
fn serialize(tensors: Vec<(String, Vec<usize>, Vec<f32>)>) -> Vec<u8> {
    let data: Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, shape, values)| {
            if name.contains("mlp.") {
                let b = values
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect();
                (name, shape, safetensors::Dtype::BF16, b)
            } else {
                let b = values.iter().flat_map(|x| x.to_le_bytes()).collect();
                (name, shape, safetensors::Dtype::F32, b)
            }
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, shape, dtype, bytes)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                .expect("consistent tensor view");
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize(views, None).expect("serialising a tiny model")
}

pub fn tokenizer_json() -> String {
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let vocab: tokenizers::models::bpe::Vocab = vocab()
        .into_iter()
        .enumerate()
        .map(|(i, s)| (s, i as u32))
        .collect();
    let merges = MERGES
        .iter()
        .map(|m| {
            let (a, b) = m.split_once(' ').expect("a merge");
            (a.to_string(), b.to_string())
        })
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .expect("tiny BPE");
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.add_special_tokens(vec![
        tokenizers::AddedToken::from("<|im_start|>", true),
        tokenizers::AddedToken::from("<|im_end|>", true),
    ])
    .expect("special tokens");
    tok.to_string(false).expect("tokenizer json")
}

fn tokenizer_config(with_template: bool) -> String {
    let mut v =
        serde_json::json!({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}});
    if with_template {
        v["chat_template"] = CHATML.into();
    }
    v.to_string()
}

const GENERATION_CONFIG: &str =
    r#"{"do_sample": true, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "eos_token_id": [2, 0]}"#;

pub fn safetensors_cases() -> Vec<Case> {
    let hf = |config: serde_json::Value, tensors: Vec<u8>| Case {
        files: vec![
            ("config.json".into(), config.to_string().into_bytes()),
            ("model.safetensors".into(), tensors),
            ("tokenizer.json".into(), tokenizer_json().into_bytes()),
            (
                "tokenizer_config.json".into(),
                tokenizer_config(true).into_bytes(),
            ),
            (
                "generation_config.json".into(),
                GENERATION_CONFIG.as_bytes().to_vec(),
            ),
        ],
    };
    let mut cases: Vec<Case> = [false, true]
        .into_iter()
        .map(|qwen3| hf(config_json(qwen3), safetensors_bytes(qwen3)))
        .collect();
    // Qwen3.5 MoE: a Gated DeltaNet state layer, then a gated full-attention layer, each
    // with routed and shared experts.
    cases.push(hf(qwen35_config_json(), serialize(qwen35_tensors())));
    cases
}

/// A tiny Qwen3.5 MoE config.json: one state layer, one full layer.
fn qwen35_config_json() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "vocab_size": TINY_VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POS, "rms_norm_eps": 1e-6,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": QWEN35_K_HEADS, "linear_num_value_heads": QWEN35_V_HEADS,
        "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM,
        "linear_conv_kernel_dim": 4, "num_experts": EXPERTS,
        "num_experts_per_tok": EXPERTS_USED, "moe_intermediate_size": INTER,
        "shared_expert_intermediate_size": INTER,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5},
        "bos_token_id": 1, "eos_token_id": 2,
    })
}

const QWEN35_K_HEADS: usize = 2;
const QWEN35_V_HEADS: usize = 4;

/// Its tensors, Qwen's names (random, norms around 0: zero-centred).
fn qwen35_tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = StdRng::seed_from_u64(35);
    let mut out = Vec::new();
    let mut add = |name: String, shape: Vec<usize>| {
        let n = shape.iter().product();
        let v = (0..n).map(|_| rng.random_range(-0.3f32..0.3)).collect();
        out.push((name, shape, v));
    };
    let (q, kv, h) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, HIDDEN);
    let (kd, vd, nv) = (
        QWEN35_K_HEADS * HEAD_DIM,
        QWEN35_V_HEADS * HEAD_DIM,
        QWEN35_V_HEADS,
    );
    add("model.embed_tokens.weight".into(), vec![TINY_VOCAB, h]);
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        if i == 0 {
            let l = format!("{p}.linear_attn");
            add(format!("{l}.in_proj_qkv.weight"), vec![2 * kd + vd, h]);
            add(format!("{l}.in_proj_z.weight"), vec![vd, h]);
            add(format!("{l}.in_proj_b.weight"), vec![nv, h]);
            add(format!("{l}.in_proj_a.weight"), vec![nv, h]);
            add(format!("{l}.conv1d.weight"), vec![2 * kd + vd, 1, 4]);
            add(format!("{l}.dt_bias"), vec![nv]);
            add(format!("{l}.A_log"), vec![nv]);
            add(format!("{l}.norm.weight"), vec![HEAD_DIM]);
            add(format!("{l}.out_proj.weight"), vec![h, vd]);
        } else {
            let a = format!("{p}.self_attn");
            add(format!("{a}.q_proj.weight"), vec![2 * q, h]);
            add(format!("{a}.k_proj.weight"), vec![kv, h]);
            add(format!("{a}.v_proj.weight"), vec![kv, h]);
            add(format!("{a}.o_proj.weight"), vec![h, q]);
            add(format!("{a}.q_norm.weight"), vec![HEAD_DIM]);
            add(format!("{a}.k_norm.weight"), vec![HEAD_DIM]);
        }
        add(format!("{p}.input_layernorm.weight"), vec![h]);
        add(format!("{p}.post_attention_layernorm.weight"), vec![h]);
        let m = format!("{p}.mlp");
        add(format!("{m}.gate.weight"), vec![EXPERTS, h]);
        for x in 0..EXPERTS {
            add(format!("{m}.experts.{x}.gate_proj.weight"), vec![INTER, h]);
            add(format!("{m}.experts.{x}.up_proj.weight"), vec![INTER, h]);
            add(format!("{m}.experts.{x}.down_proj.weight"), vec![h, INTER]);
        }
        add(
            format!("{m}.shared_expert.gate_proj.weight"),
            vec![INTER, h],
        );
        add(format!("{m}.shared_expert.up_proj.weight"), vec![INTER, h]);
        add(
            format!("{m}.shared_expert.down_proj.weight"),
            vec![h, INTER],
        );
        add(format!("{m}.shared_expert_gate.weight"), vec![1, h]);
    }
    add("model.norm.weight".into(), vec![h]);
    add("lm_head.weight".into(), vec![TINY_VOCAB, h]);
    out
}

pub fn tokenizer_cases() -> Vec<Case> {
    let tok = tokenizer_json().into_bytes();
    vec![
        Case {
            files: vec![
                ("tokenizer.json".into(), tok.clone()),
                (
                    "tokenizer_config.json".into(),
                    tokenizer_config(true).into_bytes(),
                ),
                (
                    "generation_config.json".into(),
                    GENERATION_CONFIG.as_bytes().to_vec(),
                ),
            ],
        },
        Case {
            files: vec![
                ("tokenizer.json".into(), tok),
                (
                    "tokenizer_config.json".into(),
                    tokenizer_config(false).into_bytes(),
                ),
                (
                    "chat_template.jinja".into(),
                    templates()[2].as_bytes().to_vec(),
                ),
            ],
        },
    ]
}
