//! Model weights on the GPU in bf16, the same fused layout as `model::weights`
//! (QKV rows q|k|v, gate/up rows gate|up). Layers are `Arc`s so a benchmark can run a
//! deep model whose layers share one set of random weights (timing is the same; the
//! memory figure then counts one layer's weights).
//!
//! Upload streams: each tensor is converted from its stored format to bf16 on the host
//! (row by row, see `Weight::to_bf16_bits`), uploaded, and its host copy dropped before
//! the next; the host never holds more than one tensor's bf16 beyond the stored weights.

use crate::device::bf16::f32_to_bf16;
use crate::device::cuda::exec::{Buf, Exec};
use crate::device::DevPtr;
use crate::model::weights::DeltaWeights;
use crate::model::weights::{Expert, Experts, LayerWeights, Mlp, Weight};
use crate::model::{Model, ModelConfig};
use anyhow::{bail, Result};
use half::bf16;
use std::sync::Arc;

/// One bf16 tensor on the device and its address.
pub struct Tensor {
    _buf: Buf,
    pub ptr: DevPtr<bf16>,
}

impl Tensor {
    pub fn from_bf16(exec: &dyn Exec, bits: &[u16]) -> Result<Self> {
        // SAFETY: a u16 slice viewed as its bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts(bits.as_ptr() as *const u8, bits.len() * 2) };
        let (buf, ptr) = exec.upload(bytes)?;
        Ok(Self {
            _buf: buf,
            ptr: ptr.cast(),
        })
    }

    pub fn from_f32(exec: &dyn Exec, v: &[f32]) -> Result<Self> {
        let bits: Vec<u16> = v.iter().map(|&x| f32_to_bf16(x)).collect();
        Self::from_bf16(exec, &bits)
    }
}

/// One layer's tensors, each a `T`: a device `Tensor`, or what a host-side sink returns.
pub struct LayerOf<T> {
    pub attn_norm: T,            // [hidden]
    pub wqkv: T,                 // [q_dim + 2 kv_dim, hidden]
    pub bqkv: Option<T>,         // [q_dim + 2 kv_dim] (Qwen2-style bias)
    pub qk_norm: Option<(T, T)>, // [head_dim] each (Qwen3, Gemma 3)
    pub wo: T,                   // [hidden, q_dim]
    pub bo: Option<T>,           // [hidden] (gpt-oss's output-projection bias)
    /// Gemma 3's norms of the attention and MLP outputs before their residual adds,
    /// [hidden] each.
    pub post_norms: Option<(T, T)>,
    pub mlp_norm: T, // [hidden]
    pub mlp: MlpOf<T>,
}

/// A layer's feed-forward block.
pub enum MlpOf<T> {
    Dense {
        gate_up: T, // [2 inter, hidden]
        down: T,    // [hidden, inter]
    },
    Experts(ExpertsOf<T>),
}

/// A mixture of experts (Qwen3.5 MoE, gpt-oss).
pub struct ExpertsOf<T> {
    pub router: T, // [experts, hidden]
    /// The routed experts' tensors on the device; `None`: kept in host memory and
    /// streamed per layer (`model::cuda::ExpertSource`, `--offload-experts`).
    pub mats: Option<ExpertMats<T>>,
    /// An expert every token runs, scaled by σ(`gate` · x).
    pub shared: Option<SharedOf<T>>,
}

/// Every routed expert's matrices stacked in one tensor each, so a kernel reaches expert
/// `e` at an offset (`ops::moe_matvec`).
pub struct ExpertMats<T> {
    pub gate_up: T, // [experts, 2 inter, hidden]  rows: gate, then up
    pub down: T,    // [experts, hidden, inter]
    /// gpt-oss's expert biases: [experts, 2 inter] and [experts, hidden].
    pub biases: Option<(T, T)>,
}

/// A layer's routed experts in bf16, stacked as `ExpertMats` holds them.
pub type ExpertStacks = ExpertMats<Vec<u16>>;

impl ExpertStacks {
    /// The experts of `x` (a layer of `model`), converted and stacked on the host.
    pub fn of(model: &Model, x: &Experts) -> Self {
        let bf16 = |v: &[f32]| v.iter().map(|&x| f32_to_bf16(x)).collect::<Vec<_>>();
        let stack = |f: fn(&Expert) -> &Weight| -> Vec<u16> {
            x.experts.iter().flat_map(|e| f(e).to_bf16_bits()).collect()
        };
        // Both biases or none (`Moe::biases`); zeros stand in for one a file lacks.
        let biased = x
            .experts
            .iter()
            .any(|e| e.gate_up_bias.is_some() || e.down_bias.is_some());
        // Each expert's bias `f(e)`, `n` wide, stacked.
        let stack_bias = |f: fn(&Expert) -> Option<&[f32]>, n: usize| {
            x.experts
                .iter()
                .flat_map(|e| f(e).map_or_else(|| vec![0; n], bf16))
                .collect::<Vec<u16>>()
        };
        let (h, inter2) = (model.cfg.hidden_size, 2 * model.cfg.intermediate_size);
        Self {
            gate_up: stack(|e| &e.gate_up),
            down: stack(|e| &e.down),
            biases: biased.then(|| {
                (
                    stack_bias(|e| e.gate_up_bias.as_deref(), inter2),
                    stack_bias(|e| e.down_bias.as_deref(), h),
                )
            }),
        }
    }

    /// Each tensor in order (gate/up, down, then the biases).
    pub fn parts(&self) -> Vec<&[u16]> {
        let mut v = vec![self.gate_up.as_slice(), self.down.as_slice()];
        if let Some((g, d)) = &self.biases {
            v.extend([g.as_slice(), d.as_slice()]);
        }
        v
    }
}

pub struct SharedOf<T> {
    pub gate_up: T, // [2 shared_inter, hidden]
    pub down: T,    // [hidden, shared_inter]
    pub gate: T,    // [1, hidden]
}

pub type LayerW = LayerOf<Tensor>;

/// Where a mixture of experts' routed experts live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPlace {
    /// In device memory, uploaded with the rest.
    Resident,
    /// In host memory, streamed per layer (`--offload-experts`).
    Streamed,
}

/// A model's tensors, each a `T`, in upload order.
pub struct ModelOf<T> {
    pub embed: T, // [vocab, hidden]
    pub layers: Vec<LayerOf<T>>,
    pub final_norm: T,      // [hidden]
    pub lm_head: Option<T>, // [vocab, hidden]; None = tied to embed
}

/// Converts every tensor of `model` to bf16, one at a time, handing each to `sink` (an
/// upload, or a host-side measurement) before converting the next; the routed experts
/// only when `experts` says they are resident.
pub fn convert_each<T>(
    model: &Model,
    experts: ExpertPlace,
    mut sink: impl FnMut(&[u16]) -> Result<T>,
) -> Result<ModelOf<T>> {
    let w = &model.weights;
    let bf16 = |x: &[f32]| x.iter().map(|&x| f32_to_bf16(x)).collect::<Vec<_>>();
    let mut layers = Vec::with_capacity(w.layers.len());
    for l in &w.layers {
        let attn_norm = sink(&bf16(&l.attn_norm))?;
        let bqkv = l.bqkv.as_deref().map(|b| sink(&bf16(b))).transpose()?;
        let qk_norm = match (&l.q_norm, &l.k_norm) {
            (Some(q), Some(k)) => Some((sink(&bf16(q))?, sink(&bf16(k))?)),
            _ => None,
        };
        let post_norms = match &l.post_norms {
            Some((a, m)) => Some((sink(&bf16(a))?, sink(&bf16(m))?)),
            None => None,
        };
        let mlp_norm = sink(&bf16(&l.mlp_norm))?;
        let mlp = match &l.mlp {
            Mlp::Dense { gate_up, down } => MlpOf::Dense {
                gate_up: sink(&gate_up.to_bf16_bits())?,
                down: sink(&down.to_bf16_bits())?,
            },
            Mlp::Experts(x) => {
                let shared = match &x.shared {
                    Some(s) => Some(SharedOf {
                        gate_up: sink(&s.gate_up.to_bf16_bits())?,
                        down: sink(&s.down.to_bf16_bits())?,
                        gate: sink(&s.gate.to_bf16_bits())?,
                    }),
                    None => None,
                };
                // Stacked: the host holds one layer's experts in bf16 while converting.
                let mats = match experts {
                    ExpertPlace::Resident => {
                        let st = ExpertStacks::of(model, x);
                        Some(ExpertMats {
                            gate_up: sink(&st.gate_up)?,
                            down: sink(&st.down)?,
                            biases: match &st.biases {
                                Some((g, d)) => Some((sink(g)?, sink(d)?)),
                                None => None,
                            },
                        })
                    }
                    ExpertPlace::Streamed => None,
                };
                MlpOf::Experts(ExpertsOf {
                    router: sink(&x.router.to_bf16_bits())?,
                    mats,
                    shared,
                })
            }
        };
        layers.push(LayerOf {
            attn_norm,
            wqkv: sink(&l.wqkv.to_bf16_bits())?,
            bqkv,
            qk_norm,
            wo: sink(&l.wo.to_bf16_bits())?,
            bo: l.bo.as_deref().map(|b| sink(&bf16(b))).transpose()?,
            post_norms,
            mlp_norm,
            mlp,
        });
    }
    let final_norm = sink(&bf16(&w.final_norm))?;
    Ok(ModelOf {
        embed: sink(&w.embed.to_bf16_bits())?,
        layers,
        final_norm,
        lm_head: w
            .lm_head
            .as_ref()
            .map(|h| sink(&h.to_bf16_bits()))
            .transpose()?,
    })
}

/// A state layer's recurrence parameters, f32 on the device as the kernels read them
/// (small: a few KiB per layer). Its fused input projection `[q | k | v | z | b | a]` is
/// the layer's `wqkv`, its `out_proj` the layer's `wo`.
pub struct DeltaW {
    _bufs: Vec<Buf>,
    pub conv: DevPtr<f32>,       // [conv_channels, kernel]
    pub decay_rate: DevPtr<f32>, // [v_heads]: A = −exp(A_log)
    pub dt_bias: DevPtr<f32>,    // [v_heads]
    pub norm: DevPtr<f32>,       // [dv]
}

/// Uploads `v` as f32, keeping its buffer in `bufs`.
fn upload_f32(exec: &dyn Exec, bufs: &mut Vec<Buf>, v: &[f32]) -> Result<DevPtr<f32>> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let (b, p) = exec.upload(&bytes)?;
    bufs.push(b);
    Ok(p.cast())
}

/// gpt-oss's f32 parameters of a layer, kept f32 as the CPU model uses them: a sink is a
/// logit beside the scores, a router bias joins the f32 router logits (bf16 rounding of
/// either could change a softmax or a routing tie).
pub struct LayerF32 {
    _bufs: Vec<Buf>,
    pub sinks: Option<DevPtr<f32>>,       // [num_heads]
    pub router_bias: Option<DevPtr<f32>>, // [experts]
}

impl LayerF32 {
    fn upload(exec: &dyn Exec, l: &LayerWeights) -> Result<Self> {
        let mut bufs = Vec::new();
        let sinks = l.sinks.as_deref();
        let sinks = sinks.map(|s| upload_f32(exec, &mut bufs, s)).transpose()?;
        let router_bias = match &l.mlp {
            Mlp::Experts(x) => x.router_bias.as_deref(),
            Mlp::Dense { .. } => None,
        };
        let router_bias = router_bias
            .map(|b| upload_f32(exec, &mut bufs, b))
            .transpose()?;
        Ok(Self {
            _bufs: bufs,
            sinks,
            router_bias,
        })
    }

    fn none() -> Self {
        Self {
            _bufs: Vec::new(),
            sinks: None,
            router_bias: None,
        }
    }
}

impl DeltaW {
    fn upload(exec: &dyn Exec, d: &DeltaWeights) -> Result<Self> {
        let mut bufs = Vec::with_capacity(4);
        let mut up = |v: &[f32]| upload_f32(exec, &mut bufs, v);
        let (conv, decay_rate) = (up(&d.conv)?, up(&d.decay_rate)?);
        let (dt_bias, norm) = (up(&d.dt_bias)?, up(&d.norm)?);
        Ok(Self {
            _bufs: bufs,
            conv,
            decay_rate,
            dt_bias,
            norm,
        })
    }
}

pub struct CudaWeights {
    pub embed: Tensor, // [vocab, hidden]
    pub layers: Vec<Arc<LayerW>>,
    /// Per layer: a state layer's recurrence parameters (`None`: attention).
    pub delta: Vec<Option<DeltaW>>,
    /// Per layer: its f32 parameters (gpt-oss's sinks and router bias; none elsewhere).
    pub layer_f32: Vec<LayerF32>,
    pub final_norm: Tensor,      // [hidden]
    pub lm_head: Option<Tensor>, // [vocab, hidden]; None = tied to embed
    pub bytes: usize,            // distinct bytes uploaded
}

impl CudaWeights {
    pub fn lm_head(&self) -> DevPtr<bf16> {
        self.lm_head.as_ref().unwrap_or(&self.embed).ptr
    }

    /// Uploads a loaded model's weights, converted to bf16 tensor by tensor.
    pub fn from_model(exec: &dyn Exec, model: &Model) -> Result<Self> {
        Self::from_model_placed(exec, model, ExpertPlace::Resident)
    }

    /// `from_model`, the routed experts uploaded or left for a stream as `experts` says.
    pub fn from_model_placed(exec: &dyn Exec, model: &Model, experts: ExpertPlace) -> Result<Self> {
        // Before uploading gigabytes (`CudaModel::new` checks it again for any weights).
        crate::device::cuda::ops::check_head_dim(model.cfg.head_dim)?;
        let mut bytes = 0;
        let m = convert_each(model, experts, |bits| {
            bytes += 2 * bits.len();
            Tensor::from_bf16(exec, bits)
        })?;
        let delta = model
            .weights
            .layers
            .iter()
            .map(|l| {
                l.delta
                    .as_ref()
                    .map(|d| DeltaW::upload(exec, d))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        let layer_f32 = model
            .weights
            .layers
            .iter()
            .map(|l| LayerF32::upload(exec, l))
            .collect::<Result<_>>()?;
        Ok(Self {
            embed: m.embed,
            layers: m.layers.into_iter().map(Arc::new).collect(),
            delta,
            layer_f32,
            final_norm: m.final_norm,
            lm_head: m.lm_head,
            bytes,
        })
    }

    /// Random bf16 weights of `cfg`'s shape generated on the host by a cheap hash (fast
    /// enough for Qwen3-4B's 390M-entry embedding), every layer sharing one set.
    pub fn random_shared(exec: &dyn Exec, cfg: &ModelConfig, seed: u64) -> Result<Self> {
        if cfg.has_state_layers() || cfg.attn_output_gate || cfg.moe.is_some() {
            bail!("random shared weights are attention layers without output gates only");
        }
        if cfg.attn_sinks || cfg.out_bias {
            bail!("random shared weights have no attention sinks or output-projection bias");
        }
        let (h, qd, kvd, inter, hd) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
            cfg.head_dim,
        );
        let mut n = 0u64;
        let mut gen = |len: usize, center: f32, scale: f32| -> Result<Tensor> {
            n += 1;
            let bits: Vec<u16> = (0..len)
                .map(|i| {
                    let u = splitmix(seed ^ (n << 40) ^ i as u64);
                    let r = (u >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0; // [-1, 1)
                    f32_to_bf16(center + scale * r)
                })
                .collect();
            Tensor::from_bf16(exec, &bits)
        };
        let s = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
        let layer = Arc::new(LayerW {
            attn_norm: gen(h, 1.0, 0.1)?,
            wqkv: gen((qd + 2 * kvd) * h, 0.0, s(h))?,
            bqkv: if cfg.attention_bias {
                Some(gen(qd + 2 * kvd, 0.0, 0.1)?)
            } else {
                None
            },
            qk_norm: if cfg.qk_norm {
                Some((gen(hd, 1.0, 0.1)?, gen(hd, 1.0, 0.1)?))
            } else {
                None
            },
            wo: gen(h * qd, 0.0, s(qd))?,
            bo: None,
            post_norms: if cfg.sandwich_norms {
                Some((gen(h, 1.0, 0.1)?, gen(h, 1.0, 0.1)?))
            } else {
                None
            },
            mlp_norm: gen(h, 1.0, 0.1)?,
            mlp: MlpOf::Dense {
                gate_up: gen(2 * inter * h, 0.0, s(h))?,
                down: gen(h * inter, 0.0, s(inter))?,
            },
        });
        let bias = if cfg.attention_bias { qd + 2 * kvd } else { 0 };
        let post = if cfg.sandwich_norms { 2 * h } else { 0 };
        let qk = if cfg.qk_norm { 2 * hd } else { 0 };
        let layer_bytes =
            2 * (2 * h + (qd + 2 * kvd) * h + bias + qk + post + h * qd + 3 * inter * h);
        Ok(Self {
            embed: gen(cfg.vocab_size * h, 0.0, 1.0)?,
            layers: vec![layer; cfg.num_layers],
            delta: (0..cfg.num_layers).map(|_| None).collect(),
            layer_f32: (0..cfg.num_layers).map(|_| LayerF32::none()).collect(),
            final_norm: gen(h, 1.0, 0.1)?,
            lm_head: None,
            bytes: layer_bytes + 2 * (cfg.vocab_size * h + h),
        })
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
