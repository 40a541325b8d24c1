//! `GET /v1/strata/model_card`: the Hugging Face files a framework's frontend loads to
//! tokenize in front of strata (Dynamo's frontend reads a model directory), made from
//! strata's own tokenizer and config — so the frontend's token ids are exactly the ones
//! `strata generate` would use, for GGUF models too (which have no such files).

use anyhow::Result;
use axum::body::Bytes;
use serde_json::json;

use crate::model::config::{Arch, ModelConfig};
use crate::model::Tokenizer;

pub struct ModelCard {
    /// `{"files": {name: content}}`, serialized once (the tokenizer is megabytes).
    body: Bytes,
}

impl ModelCard {
    pub fn new(cfg: &ModelConfig, tok: &Tokenizer, max_model_len: usize) -> Result<Self> {
        let (tokenizer_json, mut tokenizer_config) = tok.to_hf_json()?;
        tokenizer_config["model_max_length"] = max_model_len.into();
        let (architecture, model_type) = match cfg.arch {
            Arch::Llama => ("LlamaForCausalLM", "llama"),
            Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
            Arch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
            Arch::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
            Arch::GptOss => ("GptOssForCausalLM", "gpt_oss"),
            Arch::Qwen35 if cfg.moe.is_some() => ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
            Arch::Qwen35 => ("Qwen3_5ForCausalLM", "qwen3_5_text"),
        };
        let config = json!({
            "architectures": [architecture],
            "model_type": model_type,
            "max_position_embeddings": max_model_len,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_ids,
        });
        let generation = json!({
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_ids,
        });
        let files = json!({"files": {
            "tokenizer.json": tokenizer_json,
            "tokenizer_config.json": tokenizer_config,
            "config.json": config,
            "generation_config.json": generation,
        }});
        Ok(Self {
            body: Bytes::from(files.to_string()),
        })
    }

    /// The endpoint's JSON body.
    pub fn body(&self) -> Bytes {
        self.body.clone()
    }
}
