//! Random Qwen3-style models built in memory, for checks that need a model of a given
//! shape and no checkpoint (CUDA vs CPU logits, offload benchmarks). Every weight is
//! rounded to bf16 so the f32 CPU path and the bf16 CUDA path start from the same values.

use super::config::{Arch, GenerationDefaults, MlpAct, ModelConfig, RopeScaling};
use super::weights::{LayerWeights, MatShape, Mlp, ModelWeights, Weight};
use crate::device::bf16::{bf16_to_f32, f32_to_bf16};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// A Qwen3 shape (q/k norm, no bias), or Qwen2's (bias, no q/k norm) with `qkv_bias`.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub inter: usize,
    pub vocab: usize,
    pub max_pos: usize,
    /// Scale of the q/k norm weights (above 1 sharpens attention; bf16 errors grow with it).
    pub qk_gain: f32,
    /// Qwen2 style instead of Qwen3: bias on the q/k/v projections, no q/k norm.
    pub qkv_bias: bool,
    /// Gemma 3 style instead: this sliding window on five layers of every six (the
    /// sixth full), the local layers' RoPE base 10,000, scaled embedding, sandwich norms,
    /// GeGLU.
    pub gemma_window: Option<usize>,
    /// Scores scaled by 1/√this instead of 1/√head_dim (Gemma's `query_pre_attn_scalar`;
    /// Gemma 3 27B's is hidden / heads).
    pub query_pre_attn_scalar: Option<usize>,
}

impl Shape {
    /// Tiny, but with the head_dim (64) the CUDA attention kernels support.
    pub fn tiny() -> Self {
        Self {
            layers: 2,
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            inter: 256,
            vocab: 512,
            max_pos: 4096,
            qk_gain: 1.0,
            qkv_bias: false,
            gemma_window: None,
            query_pre_attn_scalar: None,
        }
    }

    /// Qwen3-4B: 36 layers, hidden 2560, 32 heads, 8 KV heads, head_dim 128, inter 9728,
    /// vocab 151936.
    pub fn qwen3_4b() -> Self {
        Self {
            layers: 36,
            hidden: 2560,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            inter: 9728,
            vocab: 151936,
            max_pos: 40960,
            qk_gain: 1.0,
            qkv_bias: false,
            gemma_window: None,
            query_pre_attn_scalar: None,
        }
    }

    /// A tiny Gemma 3: six layers (0–4 windowed, 5 full) with a window of `window`.
    pub fn tiny_gemma3(window: usize) -> Self {
        Self {
            layers: 6,
            gemma_window: Some(window),
            ..Self::tiny()
        }
    }

    /// A small Gemma 3 at its real head_dim (256) and attention layout (GQA, 4 heads),
    /// scores scaled as 27B's are (not by 1/√head_dim): six layers, 0–4 windowed.
    pub fn gemma3_hd256(window: usize) -> Self {
        Self {
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: 256,
            query_pre_attn_scalar: Some(128),
            ..Self::tiny_gemma3(window)
        }
    }

    pub fn config(&self) -> ModelConfig {
        let gemma = self.gemma_window.is_some();
        let layer_kinds = match self.gemma_window {
            Some(size) => super::config::gemma3_layer_kinds(
                self.layers,
                super::config::Window {
                    size,
                    rope_theta: 10_000.0,
                    rope_scaling: RopeScaling::None,
                },
            ),
            None => ModelConfig::all_full(self.layers),
        };
        ModelConfig {
            arch: if gemma {
                Arch::Gemma3
            } else if self.qkv_bias {
                Arch::Qwen2
            } else {
                Arch::Qwen3
            },
            hidden_size: self.hidden,
            intermediate_size: self.inter,
            num_layers: self.layers,
            num_heads: self.heads,
            num_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            vocab_size: self.vocab,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: RopeScaling::None,
            max_position_embeddings: self.max_pos,
            tie_word_embeddings: true,
            qk_norm: !self.qkv_bias,
            attention_bias: self.qkv_bias,
            out_bias: false,
            attn_sinks: false,
            moe: None,
            layer_kinds,
            rotary_dim: self.head_dim,
            attn_output_gate: false,
            embed_scale: gemma.then(|| (self.hidden as f32).sqrt()),
            sandwich_norms: gemma,
            mlp_act: if gemma {
                MlpAct::GeluTanh
            } else {
                MlpAct::Silu
            },
            attn_scale: ModelConfig::default_attn_scale(
                self.query_pre_attn_scalar.unwrap_or(self.head_dim),
            ),
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            generation: GenerationDefaults::default(),
        }
    }
}

/// Uniform in [-scale, scale), rounded to bf16.
fn uniform(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| bf16_to_f32(f32_to_bf16(rng.random_range(-scale..scale))))
        .collect()
}

/// Norm weights near 1.
fn norm(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| bf16_to_f32(f32_to_bf16(1.0 + rng.random_range(-0.1..0.1))))
        .collect()
}

fn scaled(v: Vec<f32>, g: f32) -> Vec<f32> {
    v.into_iter()
        .map(|x| bf16_to_f32(f32_to_bf16(x * g)))
        .collect()
}

/// Weights scaled by 1/√fan_in so activations stay O(1) through the layers; q/k norm
/// weights near `qk_gain`.
pub fn random_weights(cfg: &ModelConfig, seed: u64, qk_gain: f32) -> ModelWeights {
    let mut rng = StdRng::seed_from_u64(seed);
    let (h, qd, kvd, inter) = (
        cfg.hidden_size,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.intermediate_size,
    );
    let s = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    let mat = |data: Vec<f32>, out_features: usize, in_features: usize| {
        Weight::f32(
            data,
            MatShape {
                out_features,
                in_features,
            },
        )
    };
    let layers = (0..cfg.num_layers)
        .map(|_| LayerWeights {
            delta: None,
            attn_norm: norm(&mut rng, h),
            wqkv: mat(uniform(&mut rng, (qd + 2 * kvd) * h, s(h)), qd + 2 * kvd, h),
            bqkv: cfg
                .attention_bias
                .then(|| uniform(&mut rng, qd + 2 * kvd, 0.5)),
            q_norm: cfg
                .qk_norm
                .then(|| scaled(norm(&mut rng, cfg.head_dim), qk_gain)),
            k_norm: cfg
                .qk_norm
                .then(|| scaled(norm(&mut rng, cfg.head_dim), qk_gain)),
            wo: mat(uniform(&mut rng, h * qd, s(qd)), h, qd),
            mlp_norm: norm(&mut rng, h),
            post_norms: cfg
                .sandwich_norms
                .then(|| (norm(&mut rng, h), norm(&mut rng, h))),
            bo: None,
            sinks: None,
            mlp: Mlp::Dense {
                gate_up: mat(uniform(&mut rng, 2 * inter * h, s(h)), 2 * inter, h),
                down: mat(uniform(&mut rng, h * inter, s(inter)), h, inter),
            },
        })
        .collect();
    ModelWeights {
        // Small, as in trained models: a residual stream much larger than the layers'
        // outputs would round their contributions away in bf16.
        embed: mat(
            uniform(&mut rng, cfg.vocab_size * h, 0.1),
            cfg.vocab_size,
            h,
        ),
        layers,
        final_norm: norm(&mut rng, h),
        lm_head: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{generate, GenerateOptions, SamplingParams};
    use crate::model::Model;
    use std::sync::Arc;

    /// The CPU half of gpu-check steps 2-3: the tiny random Qwen3 runs, is
    /// deterministic, and its weights are bf16-exact.
    #[test]
    fn tiny_random_qwen3_generates() {
        let cfg = Shape::tiny().config();
        let w = random_weights(&cfg, 11, Shape::tiny().qk_gain);
        assert!(w.layers[0]
            .wqkv
            .to_f32()
            .iter()
            .all(|&x| bf16_to_f32(f32_to_bf16(x)) == x));
        let model = Arc::new(Model::new(cfg.clone(), w));
        let opts = GenerateOptions {
            max_tokens: 8,
            sampling: SamplingParams {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                seed: 0,
            },
            stop_ids: Vec::new(),
        };
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % cfg.vocab_size) as u32).collect();
        let run = || generate(&model, &prompt, &opts, 64, &mut |_| Ok(())).unwrap();
        let (a, b) = (run(), run());
        assert_eq!(a.token_ids.len(), 8);
        assert_eq!(a.token_ids, b.token_ids);
        assert!(a.logprobs.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn qwen3_4b_shape() {
        let c = Shape::qwen3_4b().config();
        assert_eq!((c.q_dim(), c.kv_dim()), (4096, 1024));
        assert!(c.qk_norm && c.tie_word_embeddings);
    }
}
