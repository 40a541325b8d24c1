//! Model hyper-parameters, read from a Hugging Face `config.json` (transformers 4.x or 5.x)
//! or from GGUF metadata, normalised into one `ModelConfig`.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;

/// The decoder architectures strata runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama and Mistral: GGUF Q/K rows are stored permuted by llama.cpp's converter.
    Llama,
    /// Qwen2 / Qwen2.5: Llama plus a bias on the q/k/v projections; GGUF rows unpermuted.
    Qwen2,
    /// Qwen3: per-head RMSNorm of q and k, no bias.
    Qwen3,
    /// Gemma 3: Qwen3's q/k norms plus a scaled embedding, norms around both sublayers
    /// ("sandwich"), GeGLU, and five sliding-window layers to every full one.
    Gemma3,
    /// gpt-oss: windowed and full layers alternating, attention sinks, biases on every
    /// attention projection, YaRN RoPE, and a mixture of experts in place of the MLP.
    GptOss,
    /// Qwen3.5 (dense): three Gated DeltaNet state layers to every full-attention one; the
    /// full layers gate their output per head and rotate a quarter of each head; every
    /// norm zero-centred (`1 + w`).
    Qwen35,
}

/// How one layer attends, which decides what KV it keeps: the one per-layer question
/// every part that holds KV asks (docs/architecture.md "Layer kinds").
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LayerKind {
    /// Attends every earlier position: its KV grows with the context.
    Full,
    /// Attends the last `size` positions, the query's own included (`p - size < k <= p`),
    /// with its own RoPE.
    Window(Window),
    /// Attends nothing: a Gated DeltaNet recurrence over a fixed-size per-sequence state
    /// (`kv::RecurrentStates`); it keeps no KV at all.
    State(DeltaShape),
}

pub use super::delta_net::{DeltaShape, ValueHeadOrder};

/// A sliding-window layer's window and RoPE.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub size: usize,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
}

/// The MLP's gate activation: a device-level kind (each device's kernels pick by it), named
/// here too because a config chooses it.
pub use crate::device::{ExpertAct, MlpAct};

/// RoPE frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    /// Llama 3.x "llama3" scaling of the low frequencies.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// Plain position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f32,
    },
    /// YaRN (transformers' `_compute_yarn_parameters`): each frequency blended between
    /// interpolated (÷ `factor`) and kept, by a ramp over the dimensions whose rotations
    /// within `original_max_position_embeddings` lie between `beta_slow` and `beta_fast`;
    /// q and k are both scaled by `attention_factor` (so the scores by its square).
    Yarn {
        factor: f32,
        beta_fast: f32,
        beta_slow: f32,
        original_max_position_embeddings: usize,
        /// Round the ramp's ends outwards to whole dimensions.
        truncate: bool,
        attention_factor: f32,
    },
}

/// A mixture-of-experts feed-forward block: a router picks `top_k` of `num_experts`
/// experts per token (its weights: a softmax over the chosen experts' router logits, as
/// gpt-oss does, and as Qwen's `norm_topk_prob` renormalisation amounts to), each a gated
/// MLP of `intermediate_size` with biases.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Moe {
    pub num_experts: usize,
    pub top_k: usize,
    pub act: ExpertAct,
    /// A shared expert every token runs too, of this width, its output scaled by
    /// σ(a learned gate) (Qwen3.5 MoE); `None` without one.
    pub shared_intermediate: Option<usize>,
    /// The router and every expert's projections carry biases (gpt-oss; Qwen's do not).
    pub biases: bool,
}

/// Plausible upper bounds for sizes read from a model file: far above any released model
/// (the largest today: 126 layers, hidden 16384, 128 heads, head_dim 256, vocab 262144,
/// 10M context), far below what could wrap or exhaust memory before a tensor is checked.
pub mod limits {
    pub const MAX_LAYERS: usize = 1024;
    pub const MAX_HIDDEN: usize = 1 << 17;
    pub const MAX_INTERMEDIATE: usize = 1 << 19;
    pub const MAX_HEADS: usize = 1024;
    pub const MAX_HEAD_DIM: usize = 1024;
    pub const MAX_VOCAB: usize = 1 << 22;
    /// Longest context, in tokens (also the bound of every token-count flag).
    pub const MAX_CONTEXT: usize = 1 << 24;
    /// Experts of one mixture-of-experts layer (the largest today: 512).
    pub const MAX_EXPERTS: usize = 1 << 12;
}

impl RopeScaling {
    /// Factors must be finite and positive: a zero, negative or NaN factor would silently
    /// give every position the same (or a garbage) rotation.
    fn validate(&self) -> Result<()> {
        let positive = |key: &str, x: f32| -> Result<()> {
            if !(x.is_finite() && x > 0.0) {
                bail!(
                    "invalid model config: rope scaling {key} must be a finite number > 0, got {x}"
                );
            }
            Ok(())
        };
        match *self {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => positive("factor", factor)?,
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate: _,
                attention_factor,
            } => {
                positive("factor", factor)?;
                positive("beta_fast", beta_fast)?;
                positive("beta_slow", beta_slow)?;
                positive("attention_factor", attention_factor)?;
                if !(1..=limits::MAX_CONTEXT).contains(&original_max_position_embeddings) {
                    bail!(
                        "invalid model config: rope scaling original_max_position_embeddings must be in 1..={}, got {original_max_position_embeddings}",
                        limits::MAX_CONTEXT
                    );
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    bail!("invalid model config: rope scaling high_freq_factor ({high_freq_factor}) must be above low_freq_factor ({low_freq_factor})");
                }
                if !(1..=limits::MAX_CONTEXT).contains(&original_max_position_embeddings) {
                    bail!(
                        "invalid model config: rope scaling original_max_position_embeddings must be in 1..={}, got {original_max_position_embeddings}",
                        limits::MAX_CONTEXT
                    );
                }
            }
        }
        Ok(())
    }

    /// What this RoPE multiplies q and k by after rotating them (YaRN's attention factor;
    /// 1 for every other kind).
    pub fn attention_factor(&self) -> f32 {
        match *self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor,
            _ => 1.0,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Qwen3: RMSNorm over each head of q and k before RoPE.
    pub qk_norm: bool,
    /// Bias on the q/k/v projections (Qwen2-style checkpoints of the Llama family).
    pub attention_bias: bool,
    /// Bias on the attention's output projection too (gpt-oss).
    pub out_bias: bool,
    /// A learned logit per head in every softmax's denominator, attending nothing (gpt-oss).
    pub attn_sinks: bool,
    /// Experts in place of the dense MLP (gpt-oss); `intermediate_size` is each expert's.
    pub moe: Option<Moe>,
    /// Each layer's attention kind, `[num_layers]`; `rope_theta` / `rope_scaling` are
    /// the full layers' RoPE, a window carries its own.
    pub layer_kinds: Vec<LayerKind>,
    /// Leading dimensions of each head that RoPE rotates (`head_dim`, or Qwen3.5's
    /// `partial_rotary_factor · head_dim`; the rest pass through).
    pub rotary_dim: usize,
    /// Qwen3.5: the query projection also gives a per-head gate, `[q | gate]` per head in
    /// the file; the attention output is multiplied by σ(gate) before `o_proj`.
    pub attn_output_gate: bool,
    /// Multiplies each embedding row (Gemma: √hidden in f32); not the tied LM head.
    pub embed_scale: Option<f32>,
    /// Gemma: an RMSNorm on the attention output and on the MLP output, each before its
    /// residual add.
    pub sandwich_norms: bool,
    pub mlp_act: MlpAct,
    /// Attention scores are `q·k × attn_scale`: 1/√head_dim, or Gemma's
    /// `query_pre_attn_scalar^-½`.
    pub attn_scale: f32,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Default sampling (from `generation_config.json`; greedy when absent).
    pub generation: GenerationDefaults,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
}

impl Default for GenerationDefaults {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }
}

impl GenerationDefaults {
    /// Reads `generation_config.json`: `do_sample: false` (or absent) means greedy. Values
    /// are checked here, so a bad one is reported as this file's key, not as a flag.
    pub fn from_json(v: &Value) -> Result<Self> {
        let do_sample = match v.get("do_sample") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => bail!("do_sample must be true or false, got {other}"),
        };
        if !do_sample {
            return Ok(Self::default());
        }
        let float = |key: &str, default: f64| -> Result<f32> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default as f32),
                Some(x) => x
                    .as_f64()
                    .map(|x| x as f32)
                    .with_context(|| format!("{key} must be a number, got {x}")),
            }
        };
        let temperature = float("temperature", 1.0)?;
        if !(temperature.is_finite() && temperature >= 0.0) {
            bail!("temperature must be a finite number >= 0, got {temperature}");
        }
        let top_p = float("top_p", 1.0)?;
        if !(top_p > 0.0 && top_p <= 1.0) {
            bail!("top_p must be in (0, 1], got {top_p}");
        }
        let top_k = match v.get("top_k") {
            None | Some(Value::Null) => 0,
            Some(x) => x
                .as_u64()
                .and_then(|k| usize::try_from(k).ok())
                .with_context(|| format!("top_k must be a whole number >= 0, got {x}"))?,
        };
        Ok(Self {
            temperature,
            top_k,
            top_p,
        })
    }
}

/// Token ids from a JSON `*_token_id` value (a number or a list of numbers); an id that
/// is not a whole number below 2^32 is an error naming the key.
pub fn json_token_ids(key: &str, v: Option<&Value>) -> Result<Vec<u32>> {
    let one = |x: &Value| -> Result<u32> {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .with_context(|| {
                format!("{key} must hold token ids (whole numbers below 2^32), got {x}")
            })
    };
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => a.iter().map(one).collect(),
        Some(x) => Ok(vec![one(x)?]),
    }
}

impl ModelConfig {
    /// Every layer full attention: the kinds of a Llama / Qwen model.
    pub fn all_full(num_layers: usize) -> Vec<LayerKind> {
        vec![LayerKind::Full; num_layers]
    }

    /// The usual score scale, 1/√head_dim (in f32, as the attention kernels always formed it).
    pub fn default_attn_scale(head_dim: usize) -> f32 {
        1.0 / (head_dim as f32).sqrt()
    }

    /// Layer `l`'s attention window, `None` for a full layer.
    pub fn window(&self, l: usize) -> Option<usize> {
        match self.layer_kinds[l] {
            LayerKind::Full | LayerKind::State(_) => None,
            LayerKind::Window(w) => Some(w.size),
        }
    }

    /// Layer `l`'s recurrence, `None` for an attention layer.
    pub fn state(&self, l: usize) -> Option<DeltaShape> {
        match self.layer_kinds[l] {
            LayerKind::State(s) => Some(s),
            _ => None,
        }
    }

    /// Whether layer `l` stores K and V (every attention layer; a state layer does not).
    pub fn keeps_kv(&self, l: usize) -> bool {
        self.state(l).is_none()
    }

    /// Whether any layer is a state layer (its per-sequence state cannot rewind).
    pub fn has_state_layers(&self) -> bool {
        (0..self.num_layers).any(|l| self.state(l).is_some())
    }

    /// Width of one token's row out of the fused input projection: q, k, v (and the
    /// output gate) for attention; a state layer's q/k/v, z, b and a, whichever is wider.
    pub fn qkv_width(&self) -> usize {
        let attn = self.attn_qkv_dim();
        self.layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::State(s) => s.proj_width(),
                _ => attn,
            })
            .max()
            .unwrap_or(attn)
    }

    /// An attention layer's fused projection row: `[q | k | v]`, then the gate.
    pub fn attn_qkv_dim(&self) -> usize {
        self.q_dim() * (1 + self.attn_output_gate as usize) + 2 * self.kv_dim()
    }

    /// Width of a layer's mixer output (what `o_proj` / `out_proj` reads), the widest.
    pub fn mixer_width(&self) -> usize {
        self.layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::State(s) => s.v_heads * s.dv,
                _ => self.q_dim(),
            })
            .max()
            .unwrap_or(self.q_dim())
    }

    /// The widest sliding window of any layer (`None`: every layer attends everything).
    pub fn widest_window(&self) -> Option<usize> {
        (0..self.num_layers).filter_map(|l| self.window(l)).max()
    }

    /// Layer `l`'s RoPE: the full layers' or its window's.
    pub fn layer_rope(&self, l: usize) -> (f32, RopeScaling) {
        match self.layer_kinds[l] {
            LayerKind::Full | LayerKind::State(_) => (self.rope_theta, self.rope_scaling),
            LayerKind::Window(w) => (w.rope_theta, w.rope_scaling),
        }
    }

    /// Layer `l`'s score scale: `attn_scale`, times the square of its RoPE's attention
    /// factor (YaRN scales both q and k; folded here, the rotation stays a rotation).
    pub fn layer_attn_scale(&self, l: usize) -> f32 {
        let f = self.layer_rope(l).1.attention_factor();
        self.attn_scale * f * f
    }

    /// Whether every layer attends the whole context (no windows).
    pub fn all_layers_full(&self) -> bool {
        self.layer_kinds.iter().all(|k| *k == LayerKind::Full)
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes of K and V for `tokens` tokens of one layer, in elements of `elem_bytes`
    /// (`KvDtype::bytes`); `None` if the product overflows. With `kv_bytes`, the
    /// one KV sizing rule: offload plans, serving blocks, memory checks and plan lines.
    pub fn kv_layer_bytes(&self, tokens: usize, elem_bytes: usize) -> Option<usize> {
        [2, tokens, self.kv_dim(), elem_bytes]
            .into_iter()
            .try_fold(1usize, usize::checked_mul)
    }

    /// Bytes of K and V for `tokens` tokens in every layer that keeps KV (one serving
    /// block of `tokens` tokens, a disk slot's payload).
    pub fn kv_bytes(&self, tokens: usize, elem_bytes: usize) -> Option<usize> {
        self.kv_layer_bytes(tokens, elem_bytes)?
            .checked_mul(self.kv_layers())
    }

    /// Layers that keep K and V (all but the state layers).
    pub fn kv_layers(&self) -> usize {
        (0..self.num_layers).filter(|&l| self.keeps_kv(l)).count()
    }

    /// Rejects configurations the forward pass cannot run, with the reason. Every size is
    /// bounded (see `limits`) before anything is allocated from it, and every product the
    /// loader and the forward pass form from these sizes fits in memory arithmetic.
    pub fn validate(&self) -> Result<()> {
        use limits::*;
        let sizes = [
            ("hidden_size", self.hidden_size, MAX_HIDDEN),
            ("num_hidden_layers", self.num_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_heads, MAX_HEADS),
            ("num_key_value_heads", self.num_kv_heads, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_HEAD_DIM),
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            (
                "intermediate_size",
                self.intermediate_size,
                MAX_INTERMEDIATE,
            ),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_CONTEXT,
            ),
        ];
        for (key, value, max) in sizes {
            if value == 0 {
                bail!("invalid model config: {key} must be > 0");
            }
            if value > max {
                bail!(
                    "invalid model config: {key} = {value} is above the supported limit of {max}"
                );
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!(
                "invalid model config: head_dim must be even, got {}",
                self.head_dim
            );
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            bail!(
                "invalid model config: rope_theta must be a finite number > 0, got {}",
                self.rope_theta
            );
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            bail!(
                "invalid model config: rms_norm_eps must be a finite number >= 0, got {}",
                self.rms_norm_eps
            );
        }
        self.rope_scaling.validate()?;
        if self.layer_kinds.len() != self.num_layers {
            bail!(
                "invalid model config: {} layer kinds for {} layers",
                self.layer_kinds.len(),
                self.num_layers
            );
        }
        if !(self.rotary_dim.is_multiple_of(2) && (2..=self.head_dim).contains(&self.rotary_dim)) {
            bail!(
                "invalid model config: the rotary dimension must be even and in 2..={} (head_dim), got {}",
                self.head_dim,
                self.rotary_dim
            );
        }
        for kind in &self.layer_kinds {
            if let LayerKind::State(s) = kind {
                super::delta_net::validate(s)?;
            }
            if let LayerKind::Window(w) = kind {
                if !(1..=MAX_CONTEXT).contains(&w.size) {
                    bail!(
                        "invalid model config: sliding window must be in 1..={MAX_CONTEXT}, got {}",
                        w.size
                    );
                }
                if !(w.rope_theta.is_finite() && w.rope_theta > 0.0) {
                    bail!(
                        "invalid model config: the sliding-window layers' rope_theta must be a finite number > 0, got {}",
                        w.rope_theta
                    );
                }
                w.rope_scaling.validate()?;
            }
        }
        for (key, x) in [
            ("the attention scale", Some(self.attn_scale)),
            ("the embedding scale", self.embed_scale),
        ] {
            if let Some(x) = x.filter(|x| !(x.is_finite() && *x > 0.0)) {
                bail!("invalid model config: {key} must be a finite number > 0, got {x}");
            }
        }
        if let Some(moe) = &self.moe {
            if !(1..=MAX_EXPERTS).contains(&moe.num_experts) {
                bail!(
                    "invalid model config: the number of experts must be in 1..={MAX_EXPERTS}, got {}",
                    moe.num_experts
                );
            }
            if !(1..=moe.num_experts).contains(&moe.top_k) {
                bail!(
                    "invalid model config: experts per token must be in 1..={} (the experts), got {}",
                    moe.num_experts,
                    moe.top_k
                );
            }
            match moe.act {
                ExpertAct::ClampedSwiglu { alpha, limit } => {
                    if !(alpha.is_finite() && limit.is_finite() && limit > 0.0) {
                        bail!("invalid model config: swiglu_alpha must be finite and swiglu_limit finite and > 0, got {alpha} and {limit}");
                    }
                }
                ExpertAct::Silu => {}
            }
            if let Some(n) = moe.shared_intermediate {
                if !(1..=MAX_INTERMEDIATE).contains(&n) {
                    bail!("invalid model config: shared_expert_intermediate_size must be in 1..={MAX_INTERMEDIATE}, got {n}");
                }
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            bail!(
                "invalid model config: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_heads,
                self.num_kv_heads
            );
        }
        // The bounds above keep these far from wrapping; checked all the same, since the
        // largest tensors' byte sizes are formed from them.
        let product = |a: usize, b: usize| a.checked_mul(b).and_then(|n| n.checked_mul(4));
        let qkv_rows = self.qkv_width();
        for (what, bytes) in [
            ("the embedding", product(self.vocab_size, self.hidden_size)),
            ("the fused qkv matrix", product(qkv_rows, self.hidden_size)),
            (
                "the fused gate/up matrix",
                product(2 * self.intermediate_size, self.hidden_size),
            ),
        ] {
            if bytes.is_none_or(|b| b > isize::MAX as usize) {
                bail!("invalid model config: {what} would not fit in memory");
            }
        }
        for (key, id) in self
            .bos_token_id
            .iter()
            .map(|&i| ("bos_token_id", i))
            .chain(self.eos_token_ids.iter().map(|&i| ("eos_token_id", i)))
        {
            if id as usize >= self.vocab_size {
                bail!(
                    "invalid model config: {key} {id} is outside the vocabulary ({} tokens)",
                    self.vocab_size
                );
            }
        }
        Ok(())
    }

    /// Parses a Hugging Face `config.json` text.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let mut v: Value = serde_json::from_str(text).context("malformed config.json")?;
        // Gemma 3's multimodal checkpoints nest the text model in `text_config`; its
        // token ids and tying may sit at the top.
        let multimodal = [
            ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"),
            ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
            (
                "Qwen3_5MoeForConditionalGeneration",
                "Qwen3_5MoeForCausalLM",
            ),
        ]
        .into_iter()
        .find(|(outer, _)| {
            v["architectures"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == outer))
        });
        if let Some((outer, inner)) = multimodal {
            let mut text = v["text_config"].take();
            let Some(t) = text.as_object_mut() else {
                bail!("{outer} config.json has no text_config object");
            };
            for key in ["bos_token_id", "eos_token_id", "tie_word_embeddings"] {
                if !t.contains_key(key) {
                    if let Some(x) = v.get(key) {
                        t.insert(key.into(), x.clone());
                    }
                }
            }
            t.insert("architectures".into(), serde_json::json!([inner]));
            v = text;
        }
        let raw: HfConfig = serde_json::from_value(v).context("malformed config.json")?;
        raw.into_config()
    }

    /// Builds the config from GGUF metadata (`<arch>.block_count` and friends).
    pub fn from_gguf(
        md: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
    ) -> Result<Self> {
        use candle_core::quantized::gguf_file::Value;
        let arch_name = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .context("GGUF metadata has no general.architecture")?
            .clone();
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" => Arch::Gemma3,
            "gpt-oss" => Arch::GptOss,
            "qwen35" | "qwen35moe" => Arch::Qwen35,
            other => {
                bail!("unsupported architecture `{other}` in GGUF (supported: llama, qwen2, qwen3, gemma3, gpt-oss, qwen35, qwen35moe)")
            }
        };
        let num = |key: &str| -> Result<Option<f64>> {
            let Some(v) = md.get(&format!("{arch_name}.{key}")) else {
                return Ok(None);
            };
            let x = match v {
                Value::U8(x) => *x as f64,
                Value::I8(x) => *x as f64,
                Value::U16(x) => *x as f64,
                Value::I16(x) => *x as f64,
                Value::U32(x) => *x as f64,
                Value::I32(x) => *x as f64,
                Value::U64(x) => *x as f64,
                Value::I64(x) => *x as f64,
                Value::F32(x) => *x as f64,
                Value::F64(x) => *x,
                other => bail!("GGUF key {arch_name}.{key} is not a number: {other:?}"),
            };
            Ok(Some(x))
        };
        let need = |key: &str| -> Result<f64> {
            num(key)?.with_context(|| format!("GGUF metadata is missing {arch_name}.{key}"))
        };
        // A size: a whole number >= 0 (an out-of-range one is refused by `validate`).
        let count = |key: &str| -> Result<Option<usize>> {
            match num(key)? {
                Some(x) if x >= 0.0 && x.fract() == 0.0 => {
                    Ok(Some(x.min(usize::MAX as f64) as usize))
                }
                Some(x) => bail!("GGUF key {arch_name}.{key} must be a whole number >= 0, got {x}"),
                None => Ok(None),
            }
        };
        let need_count = |key: &str| -> Result<usize> {
            count(key)?.with_context(|| format!("GGUF metadata is missing {arch_name}.{key}"))
        };
        let hidden_size = need_count("embedding_length")?;
        let num_heads = need_count("attention.head_count")?;
        let num_kv_heads = count("attention.head_count_kv")?.unwrap_or(num_heads);
        let head_dim = match count("attention.key_length")? {
            Some(x) => x,
            None => hidden_size.checked_div(num_heads).unwrap_or(0),
        };
        let vocab_size = match count("vocab_size")? {
            Some(v) => v,
            None => md
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok())
                .map(|v| v.len())
                .context("GGUF metadata has neither vocab_size nor tokenizer.ggml.tokens")?,
        };
        let scaling = match md
            .get(&format!("{arch_name}.rope.scaling.type"))
            .and_then(|v| v.to_string().ok())
            .map(String::as_str)
        {
            Some("linear") => RopeScaling::Linear {
                factor: need("rope.scaling.factor")? as f32,
            },
            // llama.cpp's converter writes YaRN's factor and original context; beta_fast /
            // beta_slow / attention factor are its (and transformers') defaults. The ramp
            // is not rounded to whole dimensions: gpt-oss's config says `truncate: false`
            // (ggml's YaRN always rounds: docs/models.md).
            Some("yarn") => {
                let factor = need("rope.scaling.factor")?;
                RopeScaling::Yarn {
                    factor: factor as f32,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    original_max_position_embeddings: need_count(
                        "rope.scaling.original_context_length",
                    )?,
                    truncate: arch_name != "gpt-oss",
                    attention_factor: if factor > 1.0 {
                        (0.1 * factor.ln() + 1.0) as f32
                    } else {
                        1.0
                    },
                }
            }
            Some("none") | None => RopeScaling::None,
            Some(other) => bail!("unsupported RoPE scaling `{other}` in GGUF"),
        };
        let u32_key = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
        for key in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"] {
            if let Some(id) = u32_key(key).filter(|&id| id as usize >= vocab_size) {
                bail!("GGUF {key} {id} is outside the vocabulary ({vocab_size} tokens)");
            }
        }
        // llama.cpp's converter counts a multi-token-prediction head's blocks (Qwen3.5's
        // `mtp.*`) in `block_count`, after the model's own: they are not run here, and their
        // tensors are not read.
        let all_layers = need_count("block_count")?;
        let nextn = count("nextn_predict_layers")?.unwrap_or(0);
        if nextn >= all_layers {
            bail!("GGUF {arch_name}.nextn_predict_layers ({nextn}) leaves none of the {all_layers} blocks to run");
        }
        let num_layers = all_layers - nextn;
        let gemma = arch == Arch::Gemma3;
        let oss = arch == Arch::GptOss;
        let qwen = arch == Arch::Qwen35;
        let rope_theta = num("rope.freq_base")?.unwrap_or(10_000.0) as f32;
        let layer_kinds = if oss {
            // llama.cpp's `set_swa_pattern(2)`: even layers windowed, sharing the RoPE.
            let window = Window {
                size: need_count("attention.sliding_window")?,
                rope_theta,
                rope_scaling: scaling,
            };
            (0..num_layers.min(limits::MAX_LAYERS))
                .map(|i| {
                    if i % 2 == 0 {
                        LayerKind::Window(window)
                    } else {
                        LayerKind::Full
                    }
                })
                .collect()
        } else if gemma {
            // Neither the window pattern nor the local layers' RoPE base is in the file:
            // llama.cpp and transformers hardcode them for Gemma 3 (docs/gemma3/architecture.md §5, §6).
            let window = Window {
                size: need_count("attention.sliding_window")?,
                rope_theta: 10_000.0,
                rope_scaling: RopeScaling::None,
            };
            gemma3_layer_kinds(num_layers.min(limits::MAX_LAYERS), window)
        } else if qwen {
            qwen35_gguf_layer_kinds(
                md,
                &arch_name,
                num_layers.min(limits::MAX_LAYERS),
                all_layers,
                &count,
            )?
        } else {
            ModelConfig::all_full(num_layers.min(limits::MAX_LAYERS))
        };
        let moe = if oss {
            // llama.cpp's LLM_FFN_SWIGLU_OAI_MOE: alpha 1.702, limit 7 (not in the file).
            Some(Moe {
                num_experts: need_count("expert_count")?,
                top_k: need_count("expert_used_count")?,
                act: ExpertAct::ClampedSwiglu {
                    alpha: 1.702,
                    limit: 7.0,
                },
                shared_intermediate: None,
                biases: true,
            })
        } else if arch_name == "qwen35moe" {
            // llama.cpp: softmax router, the chosen renormalised, SiLU experts; the shared
            // expert as wide as `feed_forward_length` when its own key is absent.
            Some(Moe {
                num_experts: need_count("expert_count")?,
                top_k: need_count("expert_used_count")?,
                act: ExpertAct::Silu,
                shared_intermediate: Some(match count("expert_shared_feed_forward_length")? {
                    Some(n) => n,
                    None => need_count("feed_forward_length")?,
                }),
                biases: false,
            })
        } else {
            None
        };
        // Gemma 3 scales queries by query_pre_attn_scalar^-½, not in the GGUF: head_dim
        // for every size but the 27B (62 layers), where it is hidden / heads (llama.cpp).
        let attn_scale = if gemma && num_layers == 62 {
            ModelConfig::default_attn_scale(hidden_size.checked_div(num_heads).unwrap_or(1))
        } else {
            ModelConfig::default_attn_scale(head_dim)
        };
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: if moe.is_some() {
                need_count("expert_feed_forward_length")?
            } else {
                need_count("feed_forward_length")?
            },
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: need("attention.layer_norm_rms_epsilon")? as f32,
            rope_theta,
            rope_scaling: scaling,
            max_position_embeddings: count("context_length")?.unwrap_or(2048),
            tie_word_embeddings: false, // decided by the loader: no `output.weight` means tied
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen35),
            // llama.cpp's qwen2 always carries `attn_{q,k,v}.bias`; its llama and qwen3 never do.
            attention_bias: matches!(arch, Arch::Qwen2 | Arch::GptOss),
            out_bias: oss,
            attn_sinks: oss,
            moe,
            layer_kinds,
            // The text positions of Qwen3.5's multimodal RoPE are one position repeated, so
            // its `rope.dimension_sections` rotate as plain RoPE over these dimensions.
            rotary_dim: match count("rope.dimension_count")? {
                Some(n) if qwen => n,
                _ => head_dim,
            },
            attn_output_gate: qwen,
            embed_scale: gemma.then(|| (hidden_size as f32).sqrt()),
            sandwich_norms: gemma,
            mlp_act: if gemma {
                MlpAct::GeluTanh
            } else {
                MlpAct::Silu
            },
            attn_scale,
            bos_token_id: u32_key("tokenizer.ggml.bos_token_id"),
            eos_token_ids: u32_key("tokenizer.ggml.eos_token_id").into_iter().collect(),
            generation: GenerationDefaults::default(),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// A `qwen35` / `qwen35moe` GGUF's `num_layers` layers, as llama.cpp reads them: the state
/// layers named by `attention.recurrent_layers` (one bool per block, `all_layers` of them
/// with the prediction head's) or else every layer but each `full_attention_interval`-th
/// (4); one Gated DeltaNet shape from the `ssm.*` keys, value heads in the converter's
/// tiled order.
fn qwen35_gguf_layer_kinds(
    md: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
    arch_name: &str,
    num_layers: usize,
    all_layers: usize,
    count: &dyn Fn(&str) -> Result<Option<usize>>,
) -> Result<Vec<LayerKind>> {
    use candle_core::quantized::gguf_file::Value;
    let need = |key: &str| -> Result<usize> {
        count(key)?.with_context(|| format!("GGUF metadata is missing {arch_name}.{key}"))
    };
    let v_heads = need("ssm.time_step_rank")?;
    let inner = need("ssm.inner_size")?;
    if v_heads == 0 || !inner.is_multiple_of(v_heads) {
        bail!("GGUF {arch_name}.ssm.inner_size ({inner}) is not a whole number of {arch_name}.ssm.time_step_rank ({v_heads}) value heads");
    }
    let shape = DeltaShape {
        k_heads: need("ssm.group_count")?,
        v_heads,
        dk: need("ssm.state_size")?,
        dv: inner / v_heads,
        kernel: need("ssm.conv_kernel")?,
        value_heads: ValueHeadOrder::Tiled,
    };
    let key = format!("{arch_name}.attention.recurrent_layers");
    let state: Vec<bool> = match md.get(&key) {
        Some(Value::Array(flags)) if flags.len() == all_layers => flags[..num_layers]
            .iter()
            .map(|f| match f {
                Value::Bool(b) => Ok(*b),
                other => bail!("GGUF {key} holds {other:?}, not bools"),
            })
            .collect::<Result<_>>()?,
        Some(Value::Array(flags)) => bail!(
            "GGUF {key} has {} entries for {all_layers} blocks",
            flags.len()
        ),
        Some(other) => bail!("GGUF {key} is not an array: {other:?}"),
        None => {
            let every = count("full_attention_interval")?.unwrap_or(4).max(1);
            (0..num_layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    Ok(state
        .into_iter()
        .map(|s| match s {
            true => LayerKind::State(shape),
            false => LayerKind::Full,
        })
        .collect())
}

/// What a Qwen3.5 config.json sets beyond the Qwen3 keys.
struct QwenNextParts {
    kinds: Vec<LayerKind>,
    rotary_dim: usize,
    /// The MoE variant's experts and each one's width.
    moe: Option<(Moe, usize)>,
}

/// What a gpt-oss config.json sets beyond the Llama keys.
struct OssParts {
    kinds: Vec<LayerKind>,
    moe: Moe,
}

/// What a Gemma 3 config.json sets beyond the Llama keys.
struct GemmaParts {
    kinds: Vec<LayerKind>,
    rope_theta: f32,
    rope_scaling: RopeScaling,
    attn_scale: f32,
}

/// Gemma 3's layers: every sixth (5, 11, 17, ...) full, the others windowed (transformers'
/// `sliding_window_pattern` 6, llama.cpp's `set_swa_pattern(6)`).
pub fn gemma3_layer_kinds(num_layers: usize, window: Window) -> Vec<LayerKind> {
    (0..num_layers)
        .map(|i| {
            if (i + 1) % 6 == 0 {
                LayerKind::Full
            } else {
                LayerKind::Window(window)
            }
        })
        .collect()
}

/// `config.json` as transformers 4.x and 5.x write it (5.x may nest RoPE settings
/// in `rope_parameters` and the text model in `text_config`).
#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: Option<usize>,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    // Gemma 3
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    rope_local_base_freq: Option<f64>,
    query_pre_attn_scalar: Option<f64>,
    attn_logit_softcapping: Option<Value>,
    final_logit_softcapping: Option<Value>,
    hidden_activation: Option<String>,
    use_bidirectional_attention: Option<bool>,
    // gpt-oss
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    swiglu_alpha: Option<f64>,
    swiglu_limit: Option<f64>,
    // Qwen3.5
    hidden_act: Option<String>,
    partial_rotary_factor: Option<f64>,
    full_attention_interval: Option<usize>,
    linear_conv_kernel_dim: Option<usize>,
    linear_key_head_dim: Option<usize>,
    linear_value_head_dim: Option<usize>,
    linear_num_key_heads: Option<usize>,
    linear_num_value_heads: Option<usize>,
    attn_output_gate: Option<bool>,
    // Qwen3.5 MoE
    num_experts: Option<usize>,
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
}

impl HfConfig {
    /// Each layer's kind from `layer_types` (`None` when the config has none), a
    /// `sliding_attention` layer attending `window`.
    fn kinds_from_layer_types(&self, window: Window) -> Result<Option<Vec<LayerKind>>> {
        self.kinds_with_state(window, None)
    }

    /// `kinds_from_layer_types`, a `linear_attention` layer running `state` (refused
    /// without one).
    fn kinds_with_state(
        &self,
        window: Window,
        state: Option<DeltaShape>,
    ) -> Result<Option<Vec<LayerKind>>> {
        let Some(types) = &self.layer_types else {
            return Ok(None);
        };
        if types.len() != self.num_hidden_layers {
            bail!(
                "layer_types names {} layers, num_hidden_layers is {}",
                types.len(),
                self.num_hidden_layers
            );
        }
        let kinds = types
            .iter()
            .map(|t| match t.as_str() {
                "full_attention" => Ok(LayerKind::Full),
                "sliding_attention" => Ok(LayerKind::Window(window)),
                "linear_attention" if state.is_some() => {
                    Ok(LayerKind::State(state.expect("checked")))
                }
                other => bail!("unsupported layer type {other:?} (supported: full_attention, sliding_attention; linear_attention in Qwen3.5)"),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(kinds))
    }

    /// gpt-oss (`GptOssForCausalLM`): transformers' `GptOssConfig` defaults where a key is
    /// absent — windowed layers (sharing the full layers' RoPE) alternating with full ones
    /// from a windowed first, and the experts.
    fn gpt_oss_parts(&self, rope_theta: f64, rope_scaling: RopeScaling) -> Result<OssParts> {
        let window = Window {
            size: self.sliding_window.unwrap_or(128),
            rope_theta: rope_theta as f32,
            rope_scaling,
        };
        let kinds = match self.kinds_from_layer_types(window)? {
            Some(kinds) => kinds,
            None => (0..self.num_hidden_layers.min(limits::MAX_LAYERS))
                .map(|i| {
                    if i % 2 == 0 {
                        LayerKind::Window(window)
                    } else {
                        LayerKind::Full
                    }
                })
                .collect(),
        };
        let moe = Moe {
            num_experts: self.num_local_experts.unwrap_or(128),
            top_k: self.num_experts_per_tok.unwrap_or(4),
            act: ExpertAct::ClampedSwiglu {
                alpha: self.swiglu_alpha.unwrap_or(1.702) as f32,
                limit: self.swiglu_limit.unwrap_or(7.0) as f32,
            },
            shared_intermediate: None,
            biases: true,
        };
        Ok(OssParts { kinds, moe })
    }

    /// Gemma 3's text model (`Gemma3ForCausalLM`, `gemma3_text`; the text part of
    /// `Gemma3ForConditionalGeneration`): transformers' `Gemma3TextConfig` defaults where a
    /// key is absent; what the forward pass does not compute (softcaps, bidirectional
    /// attention, another activation) is refused by name.
    fn gemma3_config(&self, head_dim: usize) -> Result<GemmaParts> {
        for (key, v) in [
            ("attn_logit_softcapping", &self.attn_logit_softcapping),
            ("final_logit_softcapping", &self.final_logit_softcapping),
        ] {
            if v.as_ref().is_some_and(|v| !v.is_null()) {
                bail!("unsupported Gemma 3 config: {key} is set (no softcapping is implemented)");
            }
        }
        if self.use_bidirectional_attention == Some(true) {
            bail!("unsupported Gemma 3 config: use_bidirectional_attention is true");
        }
        if let Some(act) = self
            .hidden_activation
            .as_deref()
            .filter(|a| *a != "gelu_pytorch_tanh")
        {
            bail!("unsupported Gemma 3 config: hidden_activation {act:?} (supported: gelu_pytorch_tanh)");
        }
        // transformers 5.x: rope_parameters per layer type; 4.x: rope_theta + rope_scaling
        // (global layers only) and rope_local_base_freq.
        let per_type = |t: &str| {
            self.rope_parameters
                .as_ref()
                .and_then(|p| p.get(t))
                .filter(|p| p.is_object())
        };
        let theta = |p: Option<&Value>| p.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64);
        let (full, local) = (per_type("full_attention"), per_type("sliding_attention"));
        let global_theta = self.rope_theta.or(theta(full)).unwrap_or(1_000_000.0);
        let global_scaling = match self
            .rope_scaling
            .as_ref()
            .filter(|v| v.is_object())
            .or(full)
        {
            None => RopeScaling::None,
            Some(s) => parse_rope_scaling(s)?,
        };
        let window = Window {
            size: self.sliding_window.unwrap_or(4096),
            rope_theta: self
                .rope_local_base_freq
                .or(theta(local))
                .unwrap_or(10_000.0) as f32,
            rope_scaling: match local {
                None => RopeScaling::None,
                Some(s) => parse_rope_scaling(s)?,
            },
        };
        let layers = self.num_hidden_layers.min(limits::MAX_LAYERS);
        let kinds = match self.kinds_from_layer_types(window)? {
            Some(kinds) => kinds,
            None => {
                let pattern = self.sliding_window_pattern.unwrap_or(6).max(1);
                (0..layers)
                    .map(|i| {
                        if (i + 1) % pattern == 0 {
                            LayerKind::Full
                        } else {
                            LayerKind::Window(window)
                        }
                    })
                    .collect()
            }
        };
        let scalar = self.query_pre_attn_scalar.unwrap_or(head_dim as f64);
        if !(scalar.is_finite() && scalar > 0.0) {
            bail!("query_pre_attn_scalar must be a finite number > 0, got {scalar}");
        }
        Ok(GemmaParts {
            kinds,
            rope_theta: global_theta as f32,
            rope_scaling: global_scaling,
            attn_scale: (1.0 / scalar.sqrt()) as f32,
        })
    }

    /// Qwen3.5's text model (`Qwen3_5ForCausalLM`, `qwen3_5_text`; the text part of
    /// `Qwen3_5ForConditionalGeneration`): transformers' `Qwen3_5TextConfig` defaults where
    /// a key is absent — a full-attention layer every `full_attention_interval` (4), the
    /// rest Gated DeltaNet.
    fn qwen35_parts(&self, head_dim: usize) -> Result<QwenNextParts> {
        if let Some(act) = self.hidden_act.as_deref().filter(|a| *a != "silu") {
            bail!("unsupported Qwen3.5 config: hidden_act {act:?} (supported: silu)");
        }
        if self.attn_output_gate == Some(false) {
            bail!("unsupported Qwen3.5 config: attn_output_gate is false (Qwen3.5's full layers always gate)");
        }
        let shape = DeltaShape {
            k_heads: self.linear_num_key_heads.unwrap_or(16),
            v_heads: self.linear_num_value_heads.unwrap_or(32),
            dk: self.linear_key_head_dim.unwrap_or(128),
            dv: self.linear_value_head_dim.unwrap_or(128),
            kernel: self.linear_conv_kernel_dim.unwrap_or(4),
            value_heads: ValueHeadOrder::Grouped,
        };
        // Never used by a full layer (its kind carries no window).
        let unused = Window {
            size: 1,
            rope_theta: 1.0,
            rope_scaling: RopeScaling::None,
        };
        let kinds = match self.kinds_with_state(unused, Some(shape))? {
            Some(kinds) => kinds,
            None => {
                let every = self.full_attention_interval.unwrap_or(4).max(1);
                (0..self.num_hidden_layers.min(limits::MAX_LAYERS))
                    .map(|i| match (i + 1) % every {
                        0 => LayerKind::Full,
                        _ => LayerKind::State(shape),
                    })
                    .collect()
            }
        };
        if kinds.iter().any(|k| matches!(k, LayerKind::Window(_))) {
            bail!("unsupported Qwen3.5 config: a sliding_attention layer");
        }
        let factor = self
            .partial_rotary_factor
            .or_else(|| {
                self.rope_parameters
                    .as_ref()
                    .and_then(|p| p.get("partial_rotary_factor"))
                    .and_then(Value::as_f64)
            })
            .unwrap_or(0.25);
        if !(factor > 0.0 && factor <= 1.0) {
            bail!("invalid model config: partial_rotary_factor must be in (0, 1], got {factor}");
        }
        // The MoE variant: every layer's MLP a router over `num_experts` (softmax, top-k,
        // renormalised: a softmax over the chosen) plus a gated shared expert.
        let moe = match (self.num_experts, self.moe_intermediate_size) {
            (Some(num_experts), Some(inter)) => Some((
                Moe {
                    num_experts,
                    top_k: self.num_experts_per_tok.unwrap_or(8),
                    act: ExpertAct::Silu,
                    shared_intermediate: Some(self.shared_expert_intermediate_size.unwrap_or(512)),
                    biases: false,
                },
                inter,
            )),
            (None, None) => None,
            _ => bail!("a Qwen3.5 MoE config needs both num_experts and moe_intermediate_size"),
        };
        Ok(QwenNextParts {
            kinds,
            // transformers: `int(head_dim * partial_rotary_factor)`.
            rotary_dim: (head_dim as f64 * factor) as usize,
            moe,
        })
    }

    fn into_config(self) -> Result<ModelConfig> {
        let names = self.architectures.clone().unwrap_or_default();
        let arch = names
            .iter()
            .find_map(|a| match a.as_str() {
                "LlamaForCausalLM" | "MistralForCausalLM" => Some(Arch::Llama),
                "Qwen2ForCausalLM" => Some(Arch::Qwen2),
                "Qwen3ForCausalLM" => Some(Arch::Qwen3),
                "Gemma3ForCausalLM" => Some(Arch::Gemma3),
                "GptOssForCausalLM" => Some(Arch::GptOss),
                "Qwen3_5ForCausalLM" | "Qwen3_5MoeForCausalLM" => Some(Arch::Qwen35),
                _ => None,
            })
            .or(match self.model_type.as_deref() {
                Some("llama") | Some("mistral") if names.is_empty() => Some(Arch::Llama),
                Some("qwen2") if names.is_empty() => Some(Arch::Qwen2),
                Some("qwen3") if names.is_empty() => Some(Arch::Qwen3),
                Some("gemma3_text") if names.is_empty() => Some(Arch::Gemma3),
                Some("gpt_oss") if names.is_empty() => Some(Arch::GptOss),
                Some("qwen3_5_text" | "qwen3_5_moe_text") if names.is_empty() => Some(Arch::Qwen35),
                _ => None,
            });
        let Some(arch) = arch else {
            let shown = if names.is_empty() {
                format!("model_type {:?}", self.model_type.unwrap_or_default())
            } else {
                names.join(", ")
            };
            bail!("unsupported architecture `{shown}` (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration's text model, GptOssForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, and the text models of Qwen3_5(Moe)ForConditionalGeneration)");
        };
        // Qwen2/Qwen3 apply `sliding_window` only when `use_sliding_window` is set; the
        // forward pass is full causal attention, so such a config would compute wrong logits.
        if self.use_sliding_window == Some(true) {
            bail!("unsupported config: use_sliding_window is true (only full attention is implemented)");
        }
        // Mistral applies `sliding_window` (when not null) to every layer. Full attention
        // is exact up to the window, so the context is capped there: longer prompts get
        // the over-long-prompt error instead of silently different logits.
        let mistral = names.iter().any(|a| a == "MistralForCausalLM")
            || (names.is_empty() && self.model_type.as_deref() == Some("mistral"));
        let window = self.sliding_window.filter(|_| mistral);
        // transformers 5.x: rope_theta and rope type live in `rope_parameters`.
        let rope_params = self.rope_parameters.as_ref().filter(|v| v.is_object());
        let oss = arch == Arch::GptOss;
        let rope_theta = self
            .rope_theta
            .or_else(|| {
                rope_params
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Value::as_f64)
            })
            .unwrap_or(if oss { 150_000.0 } else { 10_000.0 });
        let scaling_src = self
            .rope_scaling
            .as_ref()
            .filter(|v| v.is_object())
            .or(rope_params);
        let rope_scaling = match scaling_src {
            None => RopeScaling::None,
            Some(s) => parse_rope_scaling(s)?,
        };
        if oss && self.rope_scaling.is_none() && rope_params.is_none() {
            bail!("unsupported gpt-oss config: no rope_parameters (its YaRN RoPE must be given)");
        }
        let head_dim = self.head_dim.unwrap_or(
            self.hidden_size
                .checked_div(self.num_attention_heads)
                .unwrap_or(0),
        );
        let bos_token_id = json_token_ids("bos_token_id", self.bos_token_id.as_ref())?
            .first()
            .copied();
        let eos_token_ids = json_token_ids("eos_token_id", self.eos_token_id.as_ref())?;
        let gemma = match arch {
            Arch::Gemma3 => Some(self.gemma3_config(head_dim)?),
            _ => None,
        };
        let oss = match arch {
            Arch::GptOss => Some(self.gpt_oss_parts(rope_theta, rope_scaling)?),
            _ => None,
        };
        let qwen35 = match arch {
            Arch::Qwen35 => Some(self.qwen35_parts(head_dim)?),
            _ => None,
        };
        let cfg = ModelConfig {
            arch,
            hidden_size: self.hidden_size,
            intermediate_size: match qwen35.as_ref().and_then(|q| q.moe) {
                Some((_, inter)) => inter,
                None => self
                    .intermediate_size
                    .context("config.json has no intermediate_size")?,
            },
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim,
            vocab_size: self.vocab_size,
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: gemma.as_ref().map_or(rope_theta as f32, |g| g.rope_theta),
            rope_scaling: gemma.as_ref().map_or(rope_scaling, |g| g.rope_scaling),
            max_position_embeddings: self
                .max_position_embeddings
                .unwrap_or(if qwen35.is_some() {
                    32_768
                } else if gemma.is_some() || oss.is_some() {
                    131_072
                } else {
                    2048
                })
                .min(window.unwrap_or(usize::MAX)),
            // Gemma ties its head unless the config says otherwise.
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(gemma.is_some()),
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen35),
            // Qwen2's q/k/v projections always have a bias (its configs have no key for it).
            attention_bias: self
                .attention_bias
                .unwrap_or(matches!(arch, Arch::Qwen2 | Arch::GptOss)),
            // gpt-oss's attention_bias covers the output projection too.
            out_bias: oss.is_some() && self.attention_bias.unwrap_or(true),
            attn_sinks: oss.is_some(),
            moe: oss
                .as_ref()
                .map(|o| o.moe)
                .or(qwen35.as_ref().and_then(|q| q.moe).map(|(m, _)| m)),
            embed_scale: gemma.as_ref().map(|_| (self.hidden_size as f32).sqrt()),
            sandwich_norms: gemma.is_some(),
            mlp_act: if gemma.is_some() {
                MlpAct::GeluTanh
            } else {
                MlpAct::Silu
            },
            attn_scale: gemma
                .as_ref()
                .map_or(ModelConfig::default_attn_scale(head_dim), |g| g.attn_scale),
            rotary_dim: qwen35.as_ref().map_or(head_dim, |q| q.rotary_dim),
            attn_output_gate: qwen35.is_some(),
            layer_kinds: match (gemma, oss, qwen35) {
                (Some(g), _, _) => g.kinds,
                (_, Some(o), _) => o.kinds,
                (_, _, Some(q)) => q.kinds,
                _ => ModelConfig::all_full(self.num_hidden_layers.min(limits::MAX_LAYERS)),
            },
            bos_token_id,
            eos_token_ids,
            generation: GenerationDefaults::default(),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

fn parse_rope_scaling(s: &Value) -> Result<RopeScaling> {
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let f = |k: &str| s.get(k).and_then(Value::as_f64);
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: f("factor").context("rope scaling `linear` needs `factor`")? as f32,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: f("factor").context("rope scaling `llama3` needs `factor`")? as f32,
            low_freq_factor: f("low_freq_factor").unwrap_or(1.0) as f32,
            high_freq_factor: f("high_freq_factor").unwrap_or(4.0) as f32,
            original_max_position_embeddings: f("original_max_position_embeddings")
                .unwrap_or(8192.0) as usize,
        },
        "yarn" => {
            let factor = f("factor").context("rope scaling `yarn` needs `factor`")?;
            let get_mscale = |m: f64| {
                if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * m * factor.ln() + 1.0
                }
            };
            let attention_factor = match (f("attention_factor"), f("mscale"), f("mscale_all_dim")) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    get_mscale(m) / get_mscale(all)
                }
                _ => get_mscale(1.0),
            };
            RopeScaling::Yarn {
                factor: factor as f32,
                beta_fast: f("beta_fast").filter(|&b| b != 0.0).unwrap_or(32.0) as f32,
                beta_slow: f("beta_slow").filter(|&b| b != 0.0).unwrap_or(1.0) as f32,
                original_max_position_embeddings: f("original_max_position_embeddings")
                    .context("rope scaling `yarn` needs `original_max_position_embeddings`")?
                    as usize,
                truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                attention_factor: attention_factor as f32,
            }
        }
        other => {
            bail!("unsupported rope scaling type `{other}` (supported: default, linear, llama3, yarn)")
        }
    })
}

/// Each distinct RoPE of `cfg`'s layers once (`rope_inv_freq`), and the index of each
/// layer's: a sliding-window layer may have its own base, the rest share one.
pub fn distinct_ropes(cfg: &ModelConfig) -> (Vec<Vec<f32>>, Vec<usize>) {
    let (mut inv_freq, mut layer_rope) = (Vec::<Vec<f32>>::new(), Vec::new());
    for l in 0..cfg.num_layers {
        let f = rope_inv_freq(cfg, l);
        let i = inv_freq.iter().position(|g| *g == f).unwrap_or_else(|| {
            inv_freq.push(f);
            inv_freq.len() - 1
        });
        layer_rope.push(i);
    }
    (inv_freq, layer_rope)
}

/// Inverse frequencies for layer `l`'s RoPE, `rotary_dim / 2` of them, after any scaling.
pub fn rope_inv_freq(cfg: &ModelConfig, l: usize) -> Vec<f32> {
    let (theta, scaling) = cfg.layer_rope(l);
    let half = cfg.rotary_dim / 2;
    let base: Vec<f64> = (0..half)
        .map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / cfg.rotary_dim as f64))
        .collect();
    let scaled: Vec<f64> = match scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor as f64).collect(),
        RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings,
            truncate,
            attention_factor: _,
        } => {
            let dim = cfg.rotary_dim as f64;
            let ln_base = (theta as f64).ln();
            let old = original_max_position_embeddings as f64;
            // The dimension whose frequency turns `rotations` times over `old` positions.
            let dim_of = |rotations: f32| {
                dim * (old / (rotations as f64 * 2.0 * std::f64::consts::PI)).ln() / (2.0 * ln_base)
            };
            let (mut low, mut high) = (dim_of(beta_fast), dim_of(beta_slow));
            if truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
            if low == high {
                high += 0.001; // as transformers: no division by zero
            }
            base.iter()
                .enumerate()
                .map(|(i, &f)| {
                    // 1 keeps the frequency (fast dimensions), 0 interpolates it.
                    let keep = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    f / factor as f64 * (1.0 - keep) + f * keep
                })
                .collect()
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let (factor, low, high) = (
                factor as f64,
                low_freq_factor as f64,
                high_freq_factor as f64,
            );
            let old = original_max_position_embeddings as f64;
            let low_wavelen = old / low;
            let high_wavelen = old / high;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    };
    scaled.into_iter().map(|f| f as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A gpt-oss config.json, shrunk, with transformers 5's `rope_parameters`.
    fn gpt_oss_json(extra: &str) -> String {
        format!(
            r#"{{"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 300, "rope_parameters": {{"rope_type": "yarn", "factor": 32.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}}{extra}}}"#
        )
    }

    /// transformers' GptOssConfig defaults where a key is absent: windowed layers first
    /// (window 128, the full layers' YaRN), 128 experts with 4 per token, biases on every
    /// attention projection, sinks.
    #[test]
    fn gpt_oss_defaults_follow_transformers() {
        let c = ModelConfig::from_hf_json(&gpt_oss_json("")).unwrap();
        assert_eq!(c.arch, Arch::GptOss);
        assert_eq!(
            (0..4).map(|l| c.window(l)).collect::<Vec<_>>(),
            [Some(128), None, Some(128), None]
        );
        assert_eq!(c.layer_rope(0), c.layer_rope(1));
        let moe = c.moe.unwrap();
        assert_eq!((moe.num_experts, moe.top_k), (128, 4));
        assert!(c.attention_bias && c.out_bias && c.attn_sinks && !c.tie_word_embeddings);
        assert_eq!(c.max_position_embeddings, 131_072);
        let RopeScaling::Yarn {
            truncate,
            attention_factor,
            ..
        } = c.rope_scaling
        else {
            panic!("{:?}", c.rope_scaling)
        };
        assert!(!truncate);
        assert!((attention_factor - (0.1 * 32f32.ln() + 1.0)).abs() < 1e-6);
    }

    /// YaRN's inverse frequencies against transformers 5.23's `_compute_yarn_parameters`
    /// for gpt-oss's RoPE at head_dim 64 (printed there: the first, a ramp's and the last).
    #[test]
    fn yarn_inverse_frequencies_match_transformers() {
        let c = ModelConfig::from_hf_json(
            &gpt_oss_json("").replace(r#""head_dim": 16"#, r#""head_dim": 64"#),
        )
        .unwrap();
        let f = rope_inv_freq(&c, 1);
        let want = [
            (0, 1.0f32),
            (8, 0.050_813_27),
            (12, 0.006_794_959),
            (31, 3.023_511e-7),
        ];
        for (i, want) in want {
            // transformers forms the powers in f32, strata in f64: within 1e-5 relative.
            assert!(
                (f[i] - want).abs() <= 1e-5 * want,
                "{i}: {} vs {want}",
                f[i]
            );
        }
    }

    #[test]
    fn bad_gpt_oss_configs_are_refused_by_name() {
        let err = |extra: &str| {
            format!(
                "{:#}",
                ModelConfig::from_hf_json(&gpt_oss_json(extra)).unwrap_err()
            )
        };
        assert!(err(r#", "num_local_experts": 4, "num_experts_per_tok": 5"#)
            .contains("experts per token"));
        assert!(err(r#", "num_local_experts": 0"#).contains("number of experts"));
        assert!(err(r#", "swiglu_limit": 0"#).contains("swiglu_limit"));
        let no_rope = gpt_oss_json("").replace(r#""rope_parameters""#, r#""unused""#);
        let e = format!("{:#}", ModelConfig::from_hf_json(&no_rope).unwrap_err());
        assert!(e.contains("rope_parameters"), "{e}");
    }

    /// A Qwen3.5 text config.json, shrunk (no layer_types: transformers' default pattern).
    fn qwen35_json(extra: &str) -> String {
        format!(
            r#"{{"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "vocab_size": 300, "rope_parameters": {{"rope_type": "default",
            "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
            "mrope_interleaved": true, "mrope_section": [11, 11, 10]}}{extra}}}"#
        )
    }

    /// transformers' Qwen3_5TextConfig defaults where a key is absent: a full layer every
    /// 4th, Gated DeltaNet elsewhere (16 key heads, 32 value heads, 128 wide, kernel 4),
    /// a quarter of each head rotated, the output gate on; the multimodal checkpoints'
    /// `text_config` read the same, token ids from the top.
    #[test]
    fn qwen35_defaults_follow_transformers() {
        let c = ModelConfig::from_hf_json(&qwen35_json("")).unwrap();
        assert_eq!(c.arch, Arch::Qwen35);
        let full: Vec<usize> = (0..8).filter(|&l| c.keeps_kv(l)).collect();
        assert_eq!(full, [3, 7]);
        let s = c.state(0).unwrap();
        assert_eq!(
            (s.k_heads, s.v_heads, s.dk, s.dv, s.kernel),
            (16, 32, 128, 128, 4)
        );
        assert_eq!((c.rotary_dim, c.rope_theta), (8, 1e7));
        assert!(c.attn_output_gate && c.qk_norm && !c.attention_bias);
        assert_eq!((c.kv_layers(), c.max_position_embeddings), (2, 32_768));
        // Only the full layers' KV counts: 2 layers × K and V × 1 token × kv_dim 64 × 2 B.
        assert_eq!(c.kv_bytes(1, 2), Some(2 * 2 * 64 * 2));
        let text = qwen35_json(r#", "eos_token_id": 7"#)
            .replace(r#""architectures": ["Qwen3_5ForCausalLM"], "#, "");
        let vl = format!(
            r#"{{"architectures": ["Qwen3_5ForConditionalGeneration"], "bos_token_id": 5,
            "vision_config": {{}}, "text_config": {text}}}"#
        );
        let v = ModelConfig::from_hf_json(&vl).unwrap();
        assert_eq!(v.arch, Arch::Qwen35);
        assert_eq!(
            (v.bos_token_id, v.eos_token_ids.clone()),
            (Some(5), vec![7])
        );
        assert_eq!(v.layer_kinds, c.layer_kinds);
    }

    #[test]
    fn bad_qwen35_configs_are_refused_by_name() {
        let err = |extra: &str| match ModelConfig::from_hf_json(&qwen35_json(extra)) {
            Ok(_) => panic!("{extra} was accepted"),
            Err(e) => format!("{e:#}"),
        };
        for (extra, says) in [
            (
                r#", "linear_num_key_heads": 3"#,
                "not a multiple of linear_num_key_heads",
            ),
            (
                r#", "linear_num_value_heads": 0"#,
                "linear_num_value_heads must be",
            ),
            (r#", "linear_conv_kernel_dim": 1"#, "linear_conv_kernel_dim"),
            (
                r#", "linear_conv_kernel_dim": 100000"#,
                "linear_conv_kernel_dim",
            ),
            (r#", "linear_key_head_dim": 100000"#, "linear_key_head_dim"),
            (r#", "partial_rotary_factor": 0"#, "partial_rotary_factor"),
            (r#", "partial_rotary_factor": 2"#, "partial_rotary_factor"),
            (r#", "partial_rotary_factor": 0.01"#, "rotary dimension"),
            (r#", "hidden_act": "gelu""#, "hidden_act"),
            (r#", "attn_output_gate": false"#, "attn_output_gate"),
            (
                r#", "layer_types": ["linear_attention", "sliding_attention"]"#,
                "layer_types names 2 layers",
            ),
        ] {
            let e = err(extra);
            assert!(e.contains(says), "{extra}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
        // A state layer in a model that has none.
        let gemma = r#"{"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 300, "layer_types": ["linear_attention", "full_attention"]}"#;
        let e = format!("{:#}", ModelConfig::from_hf_json(gemma).unwrap_err());
        assert!(
            e.contains("unsupported layer type \"linear_attention\""),
            "{e}"
        );
        // The MoE family needs its experts' sizes.
        let moe = qwen35_json(r#", "num_experts": 8"#)
            .replace("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM");
        let e = format!("{:#}", ModelConfig::from_hf_json(&moe).unwrap_err());
        assert!(
            e.contains("needs both num_experts and moe_intermediate_size"),
            "{e}"
        );
        let e = err(r#", "num_experts": 8, "moe_intermediate_size": 16, "num_experts_per_tok": 9"#);
        assert!(e.contains("experts per token"), "{e}");
    }

    /// A Qwen2.5-0.5B-style config.json, shrunk.
    fn qwen2_json(extra: &str) -> String {
        format!(
            r#"{{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
            "max_position_embeddings": 512, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "sliding_window": 32768, "max_window_layers": 2, "tie_word_embeddings": true,
            "hidden_act": "silu"{extra}}}"#
        )
    }

    #[test]
    fn qwen2_has_qkv_bias_and_no_qk_norm() {
        let c = ModelConfig::from_hf_json(&qwen2_json(r#", "use_sliding_window": false"#)).unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.attention_bias && !c.qk_norm && c.tie_word_embeddings);
        assert_eq!((c.head_dim, c.num_kv_heads), (16, 2));
        assert_eq!(c.rope_theta, 1e6);
        // model_type alone, without `architectures`.
        let c = ModelConfig::from_hf_json(
            &qwen2_json("").replace(r#""architectures": ["Qwen2ForCausalLM"], "#, ""),
        )
        .unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.attention_bias);
    }

    #[test]
    fn explicit_attention_bias_is_honoured() {
        let c = ModelConfig::from_hf_json(&qwen2_json(r#", "attention_bias": false"#)).unwrap();
        assert!(!c.attention_bias);
    }

    #[test]
    fn mistral_context_is_capped_at_its_sliding_window() {
        let json = |window: &str| {
            format!(
                r#"{{"architectures": ["MistralForCausalLM"], "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 32768,
                "sliding_window": {window}}}"#
            )
        };
        let c = ModelConfig::from_hf_json(&json("4096")).unwrap();
        assert_eq!(c.max_position_embeddings, 4096);
        let c = ModelConfig::from_hf_json(&json("null")).unwrap();
        assert_eq!(c.max_position_embeddings, 32768);
        // Qwen2's window is off unless use_sliding_window is set: no cap.
        let small_window =
            qwen2_json("").replace(r#""sliding_window": 32768"#, r#""sliding_window": 256"#);
        let c = ModelConfig::from_hf_json(&small_window).unwrap();
        assert_eq!(c.max_position_embeddings, 512);
    }

    /// Gemma 3 as transformers 4.x wrote it (rope_theta, rope_local_base_freq, rope_scaling
    /// for the global layers, sliding_window_pattern) and as 5.x writes it (rope_parameters
    /// per layer type, layer_types), and nested in a multimodal config: one configuration.
    #[test]
    fn gemma3_configs_of_every_layout_agree() {
        let common = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
            "vocab_size": 300, "sliding_window": 8, "query_pre_attn_scalar": 24,
            "eos_token_id": [1, 106]"#;
        let v4 = format!(
            r#"{{"architectures": ["Gemma3ForCausalLM"], {common}, "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
            "rope_scaling": {{"rope_type": "linear", "factor": 8.0}}}}"#
        );
        let v5 = format!(
            r#"{{"model_type": "gemma3_text", {common}, "layer_types": ["sliding_attention",
            "sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
            "full_attention", "sliding_attention"], "rope_parameters": {{
            "full_attention": {{"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
            "sliding_attention": {{"rope_type": "default", "rope_theta": 10000.0}}}}}}"#
        );
        let text = format!(
            r#"{{"model_type": "gemma3_text", {common}, "rope_theta": 1000000.0,
            "rope_scaling": {{"rope_type": "linear", "factor": 8.0}}}}"#
        );
        // The multimodal config keeps its eos ids at the top, outside text_config.
        let mm = format!(
            r#"{{"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
            "text_config": {}}}"#,
            text.replace(r#""eos_token_id": [1, 106]"#, r#""bos_token_id": 2"#)
        );
        let configs: Vec<ModelConfig> = [v4, v5, mm]
            .iter()
            .map(|j| ModelConfig::from_hf_json(j).unwrap())
            .collect();
        for c in &configs {
            assert_eq!(c.arch, Arch::Gemma3);
            assert_eq!(c.window(0), Some(8));
            assert_eq!(c.window(5), None);
            assert_eq!(c.window(6), Some(8));
            assert_eq!(c.layer_rope(5), (1e6, RopeScaling::Linear { factor: 8.0 }));
            assert_eq!(c.layer_rope(0), (1e4, RopeScaling::None));
            assert_eq!(c.attn_scale, (1.0 / 24f64.sqrt()) as f32); // as transformers rounds it
            assert_eq!(c.eos_token_ids, [1, 106]);
            assert!(c.tie_word_embeddings && c.sandwich_norms && c.qk_norm);
            assert_eq!(c.embed_scale, Some(8.0));
        }
        // What the forward pass does not compute is refused by name.
        for (key, value) in [
            ("final_logit_softcapping", "30.0"),
            ("attn_logit_softcapping", "50.0"),
            ("use_bidirectional_attention", "true"),
            ("hidden_activation", r#""gelu""#),
        ] {
            let j = format!(r#"{{"model_type": "gemma3_text", {common}, "{key}": {value}}}"#);
            let err = ModelConfig::from_hf_json(&j).unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
    }

    #[test]
    fn sliding_window_in_use_is_refused() {
        let err = ModelConfig::from_hf_json(&qwen2_json(r#", "use_sliding_window": true"#))
            .unwrap_err()
            .to_string();
        assert!(err.contains("use_sliding_window"), "{err}");
        assert!(!err.contains('\n'), "{err}");
    }

    /// A `qwen35moe` GGUF's metadata (the fuzz corpus's tiny one: a state layer, then a full
    /// one), with `edit` applied.
    fn qwen35_gguf(
        edit: impl FnOnce(&mut HashMap<String, candle_core::quantized::gguf_file::Value>),
    ) -> Result<ModelConfig> {
        let doc = crate::fuzz::corpus::gguf_doc("qwen35moe");
        let mut md: HashMap<_, _> = doc.metadata.into_iter().collect();
        edit(&mut md);
        ModelConfig::from_gguf(&md)
    }

    #[test]
    fn qwen35_gguf_keys_are_read_as_llama_cpp_reads_them() {
        use candle_core::quantized::gguf_file::Value;
        let c = qwen35_gguf(|_| {}).unwrap();
        assert_eq!(c.arch, Arch::Qwen35);
        let s = c.state(0).expect("layer 0 is a state layer");
        assert_eq!(
            (s.k_heads, s.v_heads, s.dk, s.dv, s.kernel, s.value_heads),
            (2, 4, 8, 8, 4, ValueHeadOrder::Tiled)
        );
        assert_eq!(c.layer_kinds[1], LayerKind::Full);
        assert_eq!(c.rotary_dim, 4);
        assert!(c.attn_output_gate && c.qk_norm);
        let moe = c.moe.unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.shared_intermediate),
            (4, 2, Some(64))
        );
        assert!(!moe.biases && moe.act == ExpertAct::Silu);
        // Without `attention.recurrent_layers`: every `full_attention_interval`-th is full.
        let c = qwen35_gguf(|md| {
            md.remove("qwen35moe.attention.recurrent_layers");
            md.insert("qwen35moe.full_attention_interval".into(), Value::U32(2));
        })
        .unwrap();
        assert!(c.state(0).is_some() && c.state(1).is_none());
        // A prediction head's block after them: counted in `block_count`, not run.
        let c = qwen35_gguf(|md| {
            md.insert("qwen35moe.block_count".into(), Value::U32(3));
            md.insert("qwen35moe.nextn_predict_layers".into(), Value::U32(1));
            let flags = [true, false, false].map(Value::Bool).to_vec();
            md.insert(
                "qwen35moe.attention.recurrent_layers".into(),
                Value::Array(flags),
            );
        })
        .unwrap();
        assert_eq!(c.num_layers, 2);
        assert!(c.state(0).is_some() && c.state(1).is_none());
        // Hostile or broken values: one line each, naming the key.
        type Edit = Box<dyn FnOnce(&mut HashMap<String, Value>)>;
        let cases: Vec<(Edit, &str)> = vec![
            (
                Box::new(|md| {
                    md.insert(
                        "qwen35moe.attention.recurrent_layers".into(),
                        Value::Array(vec![Value::Bool(true)]),
                    );
                }),
                "recurrent_layers has 1 entries for 2 blocks",
            ),
            (
                Box::new(|md| {
                    md.insert(
                        "qwen35moe.attention.recurrent_layers".into(),
                        Value::Array(vec![Value::U8(1), Value::U8(0)]),
                    );
                }),
                "not bools",
            ),
            (
                Box::new(|md| {
                    md.insert("qwen35moe.nextn_predict_layers".into(), Value::U32(2));
                }),
                "leaves none of the 2 blocks to run",
            ),
            (
                Box::new(|md| {
                    md.insert("qwen35moe.ssm.inner_size".into(), Value::U32(33));
                }),
                "is not a whole number of",
            ),
            (
                Box::new(|md| {
                    md.insert("qwen35moe.ssm.time_step_rank".into(), Value::U32(0));
                }),
                "is not a whole number of",
            ),
            (
                Box::new(|md| {
                    md.remove("qwen35moe.ssm.state_size");
                }),
                "missing qwen35moe.ssm.state_size",
            ),
            (
                Box::new(|md| {
                    md.insert("qwen35moe.ssm.group_count".into(), Value::U32(3));
                }),
                "not a multiple of linear_num_key_heads",
            ),
            (
                Box::new(|md| {
                    md.insert("qwen35moe.rope.dimension_count".into(), Value::U32(9));
                }),
                "rotary dimension must be even",
            ),
        ];
        for (edit, says) in cases {
            let err = format!("{:#}", qwen35_gguf(edit).unwrap_err());
            assert!(err.contains(says) && !err.contains('\n'), "{says}: {err}");
        }
    }
}
