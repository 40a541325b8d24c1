//! Decoder-only transformer (Llama, Qwen3) with an explicit layer loop over the KV seam.

pub mod config;
pub mod tokenizer;
pub mod weights;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::device::cpu::ops::{self, AttnShape};
use crate::kv::KvView;
pub use config::{Arch, ModelConfig};
pub use tokenizer::Tokenizer;
use weights::ModelWeights;

/// Rows of the MLP processed at once in prefill, so the `[rows, 2 * inter]` activation
/// stays bounded however long the prompt is.
const MLP_CHUNK: usize = 1024;

pub struct Model {
    pub cfg: ModelConfig,
    pub weights: ModelWeights,
    inv_freq: Vec<f32>, // [head_dim / 2]
}

/// A model file or directory, resolved to its format.
pub enum ModelSource {
    Gguf(PathBuf),
    HfDir(PathBuf),
}

impl ModelSource {
    pub fn detect(path: &Path) -> Result<Self> {
        if !path.exists() {
            bail!("model not found: {}", path.display());
        }
        if path.is_dir() {
            if !path.join("config.json").exists() {
                bail!("{}: a model directory needs config.json", path.display());
            }
            return Ok(Self::HfDir(path.to_path_buf()));
        }
        Ok(Self::Gguf(path.to_path_buf()))
    }
}

impl Model {
    pub fn new(cfg: ModelConfig, weights: ModelWeights) -> Self {
        let inv_freq = config::rope_inv_freq(&cfg);
        Self {
            cfg,
            weights,
            inv_freq,
        }
    }

    /// Loads weights and tokenizer from a GGUF file or a Hugging Face directory.
    pub fn load(path: &Path, progress: bool) -> Result<(Self, Tokenizer)> {
        match ModelSource::detect(path)? {
            ModelSource::Gguf(p) => {
                let mut gguf = weights::GgufFile::open(&p)?;
                let mut cfg = ModelConfig::from_gguf(&gguf.content.metadata)
                    .with_context(|| format!("{}", p.display()))?;
                let tok = Tokenizer::from_gguf(&gguf.content.metadata)
                    .with_context(|| format!("{}", p.display()))?;
                let w = weights::load_gguf(&mut gguf, &mut cfg, progress)
                    .with_context(|| format!("{}", p.display()))?;
                if cfg.eos_token_ids.is_empty() {
                    cfg.eos_token_ids = tok.eos_token_ids.clone();
                }
                Ok((Self::new(cfg, w), tok))
            }
            ModelSource::HfDir(dir) => {
                let cfg_path = dir.join("config.json");
                let text = std::fs::read_to_string(&cfg_path)
                    .with_context(|| format!("reading {}", cfg_path.display()))?;
                let mut cfg = ModelConfig::from_hf_json(&text)
                    .with_context(|| format!("{}", cfg_path.display()))?;
                let tok = Tokenizer::from_hf_dir(&dir, &cfg.eos_token_ids)?;
                cfg.eos_token_ids = tok.eos_token_ids.clone();
                let gen_path = dir.join("generation_config.json");
                if gen_path.exists() {
                    let text = std::fs::read_to_string(&gen_path)?;
                    let v: serde_json::Value = serde_json::from_str(&text)
                        .with_context(|| format!("malformed {}", gen_path.display()))?;
                    cfg.generation = config::GenerationDefaults::from_json(&v);
                }
                let w = weights::load_safetensors(&dir, &mut cfg, progress)
                    .with_context(|| format!("{}", dir.display()))?;
                Ok((Self::new(cfg, w), tok))
            }
        }
    }

    /// Bytes of f32 weights held.
    pub fn weight_bytes(&self) -> usize {
        let w = &self.weights;
        let layer: usize = w
            .layers
            .iter()
            .map(|l| {
                l.attn_norm.len()
                    + l.wqkv.len()
                    + l.bqkv.as_ref().map_or(0, Vec::len)
                    + l.q_norm.as_ref().map_or(0, Vec::len)
                    + l.k_norm.as_ref().map_or(0, Vec::len)
                    + l.wo.len()
                    + l.mlp_norm.len()
                    + l.w_gate_up.len()
                    + l.w_down.len()
            })
            .sum();
        4 * (w.embed.len() + layer + w.final_norm.len() + w.lm_head.as_ref().map_or(0, Vec::len))
    }

    /// Runs `tokens` at positions `pos0..` through every layer, storing their K/V through
    /// `kv`, and returns the logits `[vocab]` of the last token.
    pub fn forward(&self, tokens: &[u32], pos0: usize, kv: &mut dyn KvView) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let w = &self.weights;
        let t = tokens.len();
        if t == 0 {
            bail!("forward called with no tokens");
        }
        let (h, qd, kvd, inter) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        let qkv_dim = qd + 2 * kvd;
        let eps = cfg.rms_norm_eps;

        // x[t, h]: residual stream; hn[t, h]: its normalised copy feeding the next block.
        let mut x = vec![0.0f32; t * h];
        for (row, &id) in x.chunks_exact_mut(h).zip(tokens) {
            let id = id as usize;
            if id >= cfg.vocab_size {
                bail!(
                    "token id {id} is outside the vocabulary ({})",
                    cfg.vocab_size
                );
            }
            row.copy_from_slice(&w.embed[id * h..(id + 1) * h]);
        }
        let mut hn = vec![0.0f32; t * h];
        ops::rms_norm(&x, &w.layers[0].attn_norm, eps, &mut hn);

        let (cos, sin) = ops::rope_tables(&self.inv_freq, pos0, t);
        let mut qkv = vec![0.0f32; t * qkv_dim]; // [t, q | k | v]
        let mut q = vec![0.0f32; t * qd]; // [t, heads, head_dim]
        let mut attn = vec![0.0f32; t * qd]; // [t, heads, head_dim]
        let mut proj = vec![0.0f32; t * h]; // [t, h]
        let chunk = t.min(MLP_CHUNK);
        let mut gu = vec![0.0f32; chunk * 2 * inter]; // [chunk, gate | up]
        let mut act = vec![0.0f32; chunk * inter]; // [chunk, inter]

        for (l, lw) in w.layers.iter().enumerate() {
            // 1. Fused QKV projection.
            ops::linear(&hn, &lw.wqkv, lw.bqkv.as_deref(), &mut qkv, t, h, qkv_dim);
            // 2. Qwen3: per-head RMSNorm of q and k, before RoPE.
            if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
                ops::head_rms_norm(&mut qkv, t, cfg.num_heads, cfg.head_dim, qkv_dim, qn, eps);
                ops::head_rms_norm(
                    &mut qkv[qd..],
                    t,
                    cfg.num_kv_heads,
                    cfg.head_dim,
                    qkv_dim,
                    kn,
                    eps,
                );
            }
            // 3. RoPE on q and k.
            ops::rope(
                &mut qkv,
                t,
                cfg.num_heads,
                cfg.head_dim,
                qkv_dim,
                &cos,
                &sin,
            );
            ops::rope(
                &mut qkv[qd..],
                t,
                cfg.num_kv_heads,
                cfg.head_dim,
                qkv_dim,
                &cos,
                &sin,
            );
            for (dst, src) in q.chunks_exact_mut(qd).zip(qkv.chunks_exact(qkv_dim)) {
                dst.copy_from_slice(&src[..qd]);
            }
            // 4. Store the new K/V and attend over everything up to them.
            kv.begin_layer(l)?;
            {
                let lkv = kv.layer(l, pos0 + t)?;
                for (i, src) in qkv.chunks_exact(qkv_dim).enumerate() {
                    let at = (pos0 + i) * kvd;
                    lkv.k[at..at + kvd].copy_from_slice(&src[qd..qd + kvd]);
                    lkv.v[at..at + kvd].copy_from_slice(&src[qd + kvd..]);
                }
                let shape = AttnShape {
                    tokens: t,
                    pos0,
                    num_heads: cfg.num_heads,
                    num_kv_heads: cfg.num_kv_heads,
                    head_dim: cfg.head_dim,
                };
                ops::attention(&q, lkv.k, lkv.v, &mut attn, shape);
            }
            kv.end_layer(l)?;
            // 5. Output projection, residual add, post-attention norm.
            ops::linear(&attn, &lw.wo, None, &mut proj, t, qd, h);
            ops::add_rms_norm(&mut x, &proj, &lw.mlp_norm, eps, &mut hn);
            // 6. MLP in row chunks; the residual add is fused with the next block's norm.
            let next_norm = w.layers.get(l + 1).map_or(&w.final_norm, |n| &n.attn_norm);
            for r0 in (0..t).step_by(chunk) {
                let n = chunk.min(t - r0);
                let rows = r0 * h..(r0 + n) * h;
                ops::linear(
                    &hn[rows.clone()],
                    &lw.w_gate_up,
                    None,
                    &mut gu[..n * 2 * inter],
                    n,
                    h,
                    2 * inter,
                );
                ops::silu_mul(&gu[..n * 2 * inter], inter, &mut act[..n * inter]);
                ops::linear(
                    &act[..n * inter],
                    &lw.w_down,
                    None,
                    &mut proj[rows.clone()],
                    n,
                    inter,
                    h,
                );
                ops::add_rms_norm(
                    &mut x[rows.clone()],
                    &proj[rows.clone()],
                    next_norm,
                    eps,
                    &mut hn[rows],
                );
            }
        }
        // 7. lm_head on the last position only.
        let mut logits = vec![0.0f32; cfg.vocab_size];
        ops::linear(
            &hn[(t - 1) * h..],
            w.lm_head(),
            None,
            &mut logits,
            1,
            h,
            cfg.vocab_size,
        );
        Ok(logits)
    }
}
