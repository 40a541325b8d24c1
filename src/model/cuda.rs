//! The model on the GPU: the same layer loop as `Model::forward`, enqueued from the host
//! thread on one compute stream (CUDA's own asynchrony replaces the CPU device's worker
//! threads), with the KV behind the `KvCache` seam (`crate::kv`). Activations bf16; cuBLAS and the
//! kernels accumulate in f32; logits f32.

pub mod weights;

use self::weights::{CudaWeights, ExpertsOf, MlpOf, Tensor};
use crate::device::cpu::ops::rope_tables;
use crate::device::cuda::exec::alloc;
use crate::device::cuda::exec::{Buf, Exec};
use crate::device::cuda::ops::{self, AttnArgs, DecodeScratch, GemmOut, GemmShape, PagedAttn};
use crate::device::delta::DeltaShape;
use crate::device::{DevPtr, MlpAct};
use crate::kv::{KvCache, LayerSlot, NewRow, Query};
use crate::model::{check_ids, config, ModelConfig};
use anyhow::{bail, Context, Result};
use half::bf16;
use std::sync::Arc;

/// MLP rows at once (as on the CPU), bounding the `[rows, 2 inter]` activation.
const MLP_CHUNK: usize = 1024;
/// Keys per flash-decoding split.
const SPLIT_LEN: usize = 512;

/// Which GEMM a step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gemm {
    /// `Exec::gemm`: cuBLAS on the GPU (its algorithm, hence a row's reduction order,
    /// depends on the shape).
    Fast,
    /// `ops::gemm_fixed`: every output a fixed-order reduction, whatever the batch.
    BatchInvariant,
    /// `Exec::gemm` one row at a time: each row rounds as in a one-token step, which a row
    /// inside a taller cuBLAS GEMM need not (verified sparse decode's verify step).
    FastRows,
}

/// How a step's attention runs.
enum StepAttn {
    /// One sequence over a contiguous slot (K/V and capacity filled in per layer): the
    /// prefill kernel for a chunk, the decode kernel for one token. `selected`: i32 [2] =
    /// {the new token's slot row, rows attended}, written when the cache selects the rows
    /// (sparse decode, `KvCache::select_rows`).
    Contiguous {
        args: AttnArgs,
        selected: DevPtr<i32>,
    },
    /// Every row its own query over the page pool (K/V filled in per layer) through the
    /// flash-decoding kernel: the same kernel and split for a row whatever its batch, its
    /// chunk, or whether it is a decode token or a (re)computed prompt token.
    PerRow(PagedAttn, DecodeScratch),
    /// One sequence's rows over a contiguous slot (K/V and block size filled in per
    /// layer; every table entry 0), each through the flash-decoding kernel over the keys up
    /// to its own position: row `r` attends as a one-token step at `pos0 + r` does (the
    /// verify step, `CudaModel::forward_rows`).
    DecodeRows(PagedAttn, DecodeScratch),
}

/// One forward step as every layer runs it.
struct StepPlan {
    rows: usize,
    pos: DevPtr<i32>,        // i32 [rows] positions (RoPE)
    cache_rows: DevPtr<i32>, // i32 [rows] slot row each new token's K/V is stored at
    gemm: Gemm,
    attn: StepAttn,
    /// The sliding-window layers' rows over a window pool (the batched forward's), if any.
    window: Option<WindowRows>,
    /// Each sequence's rows, for the state layers (which run a sequence's rows in order
    /// from its recurrent state).
    seqs: Vec<SeqRows>,
}

/// One sequence's rows in a step.
#[derive(Clone, Copy, Debug)]
struct SeqRows {
    row0: usize,
    tokens: usize,
    pos0: usize,
    /// Its recurrent-state slot (`KvCache::layer_state`).
    state_slot: usize,
}

impl SeqRows {
    /// A single-sequence step: its `tokens` rows from position `pos0`, state slot 0.
    fn one(pos0: usize, tokens: usize) -> Self {
        Self {
            row0: 0,
            tokens,
            pos0,
            state_slot: 0,
        }
    }
}

/// A batched step's addresses in a window pool, for the sliding-window layers.
#[derive(Clone, Copy)]
struct WindowRows {
    cache_rows: DevPtr<i32>, // i32 [rows] window-pool row of each new token's K/V
    tables: DevPtr<i32>,     // i32 [rows, max_blocks] the row's window pages
}

mod batch;

/// Where a streamed layer's routed experts are for its MLP (`weights::ExpertMats`'
/// layout, one layer's).
#[derive(Clone, Copy, Debug)]
pub struct ExpertPtrs {
    pub gate_up: DevPtr<bf16>, // [experts, 2 inter, hidden]
    pub down: DevPtr<bf16>,    // [experts, hidden, inter]
    pub biases: Option<(DevPtr<bf16>, DevPtr<bf16>)>, // [experts, 2 inter], [experts, hidden]
}

impl ExpertPtrs {
    fn of(m: &weights::ExpertMats<Tensor>) -> Self {
        Self {
            gate_up: m.gate_up.ptr,
            down: m.down.ptr,
            biases: m.biases.as_ref().map(|(g, d)| (g.ptr, d.ptr)),
        }
    }
}

/// Routed experts kept in host memory and brought to the device a layer at a time (the
/// mirror of layerwise KV offload; `offload::experts::ExpertStream`). The model calls
/// `begin` before an experts layer's MLP and `end` after its last kernel is queued; the
/// pointers are valid in between, for work on the compute stream.
pub trait ExpertSource: Send {
    fn begin(&mut self, layer: usize) -> Result<ExpertPtrs>;
    fn end(&mut self, layer: usize) -> Result<()>;
}

/// Queues `v` → `dst` on the model's stream, in stream order (a pageable source: the
/// driver stages it before returning, so `v` may go at once).
///
/// # Safety
/// `dst` must hold `v.len()` i32.
unsafe fn htod_i32(exec: &dyn Exec, dst: DevPtr<i32>, v: &[i32]) -> Result<()> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
    exec.htod(dst.cast(), &bytes)
}

pub struct CudaModel {
    pub cfg: ModelConfig,
    /// The GPU (`CudaExec`, on the compute stream) or the kernel emulator (`EmuExec`).
    exec: Arc<dyn Exec>,
    pub w: CudaWeights,
    max_pos: usize,
    _bufs: Vec<Buf>, // RoPE tables, decode scratch, the ring table
    /// (cos, sin) f32 `[max_pos, head_dim / 2]` each, per distinct RoPE (a sliding-window
    /// layer may have its own base), and each layer's.
    rope: Vec<(DevPtr<f32>, DevPtr<f32>)>,
    layer_rope: Vec<usize>,
    /// i32 [max_pos] zeros: the block table of a ring slot (every block is the slot, so
    /// key p is row p % rows), shared by every row of a step (stride 0).
    ring_table: DevPtr<i32>,
    scratch: DecodeScratch,
    acts: Option<Acts>,
    /// The batched forward's per-step buffers (`batch`).
    batch: batch::BatchBufs,
    /// NVTX ranges around each layer, attention and MLP (host enqueue side).
    pub nvtx: bool,
    /// The routed experts' stream when they live in host memory (`ExpertPlace::Streamed`).
    experts: Option<std::sync::Mutex<Box<dyn ExpertSource>>>,
}

/// A mixture of experts' buffers for one MLP chunk of `chunk` rows (`k` = top_k).
struct MoeActs {
    logits: DevPtr<f32>,      // [chunk, experts] router logits
    ids: DevPtr<i32>,         // [chunk, k] chosen experts, ascending
    weights: DevPtr<f32>,     // [chunk, k]
    gu: DevPtr<bf16>,         // [chunk · k, gate | up]
    act: DevPtr<bf16>,        // [chunk · k, inter]
    y: DevPtr<bf16>,          // [chunk · k, hidden] each chosen expert's output
    shared_gu: DevPtr<bf16>,  // [chunk, gate | up] (shared_inter each)
    shared_act: DevPtr<bf16>, // [chunk, shared_inter]
    shared_out: DevPtr<bf16>, // [chunk, hidden]
    shared_gate: DevPtr<f32>, // [chunk]
}

/// Step activations for up to `rows` tokens, reused across steps.
struct Acts {
    rows: usize,
    chunk: usize,
    _bufs: Vec<Buf>,
    vocab: usize,
    x: DevPtr<bf16>,    // [rows, hidden] residual stream
    hn: DevPtr<bf16>,   // [rows, hidden] normalised input of the next block
    qkv: DevPtr<bf16>,  // [rows, q | k | v (| gate)], a state layer's [rows, q | k | v | z | b | a]
    attn: DevPtr<bf16>, // [rows, q_dim], a state layer's [rows, v_heads · dv]
    /// State-layer models: the conv's output f32 [rows, conv_channels] and the delta
    /// rule's f32 [rows, v_heads · dv] (the widest state layer's).
    delta: Option<(DevPtr<f32>, DevPtr<f32>)>,
    /// Mixture-of-experts models: an MLP chunk's expert buffers.
    moe: Option<MoeActs>,
    proj: DevPtr<bf16>,  // [rows, hidden]
    gu: DevPtr<bf16>,    // [chunk, gate | up]
    act: DevPtr<bf16>,   // [chunk, inter]
    meta: DevPtr<i32>, // [ids: rows | pos: rows | cu_seqlens: 2 | ctx_len: 1 | table: 1 | selected: 2]
    logits: DevPtr<f32>, // [vocab]
}

impl CudaModel {
    /// `max_pos`: the longest context this model will run (sizes the RoPE tables and the
    /// decode scratch). `w` must have been uploaded through `x`.
    pub fn new(
        exec: Arc<dyn Exec>,
        cfg: ModelConfig,
        w: CudaWeights,
        max_pos: usize,
    ) -> Result<Self> {
        // The attention kernels are instantiated for these head dims only.
        ops::check_head_dim(cfg.head_dim)?;
        if w.layers.len() != cfg.num_layers {
            bail!(
                "weights have {} layers, config {}",
                w.layers.len(),
                cfg.num_layers
            );
        }
        let f32_bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|f| f.to_le_bytes()).collect() };
        let (mut bufs, mut rope) = (Vec::new(), Vec::new());
        let (inv_freq, layer_rope) = config::distinct_ropes(&cfg);
        for f in &inv_freq {
            let (cos_h, sin_h) = rope_tables(f, 0, max_pos);
            let (cos_b, cos) = exec.upload(&f32_bytes(&cos_h))?;
            let (sin_b, sin) = exec.upload(&f32_bytes(&sin_h))?;
            bufs.extend([cos_b, sin_b]);
            rope.push((cos.cast(), sin.cast()));
        }
        let (zb, ring_table) = exec.upload(&vec![0u8; 4 * max_pos])?;
        let max_splits = max_pos.div_ceil(SPLIT_LEN);
        let nh = cfg.num_heads;
        let (po_b, part_o) = alloc::<f32>(&*exec, nh * max_splits * cfg.head_dim)?;
        let (pm_b, part_ml) = alloc::<f32>(&*exec, nh * max_splits * 2)?;
        bufs.extend([zb, po_b, pm_b]);
        Ok(Self {
            _bufs: bufs,
            rope,
            layer_rope,
            ring_table: ring_table.cast(),
            scratch: DecodeScratch {
                part_o,
                part_ml,
                split_len: SPLIT_LEN,
                max_splits,
            },
            cfg,
            exec,
            w,
            max_pos,
            acts: None,
            batch: Default::default(),
            nvtx: true,
            experts: None,
        })
    }

    /// The executor the model runs on (allocations for a KV beside it).
    pub fn exec(&self) -> &Arc<dyn Exec> {
        &self.exec
    }

    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    /// Allocates activations for `tokens`-token steps now (benchmarks: keeps the
    /// allocation out of the timed prefill).
    pub fn reserve(&mut self, tokens: usize) -> Result<()> {
        self.ensure_acts(tokens)
    }

    /// Activations for `t` tokens; grows (after a synchronize) when a step needs more.
    fn ensure_acts(&mut self, t: usize) -> Result<()> {
        if self.acts.as_ref().is_some_and(|a| a.rows >= t) {
            return Ok(());
        }
        self.exec.sync()?;
        self.acts = None; // free before allocating the larger set
        let c = &self.cfg;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let chunk = t.min(MLP_CHUNK);
        let mut bufs = Vec::new();
        let mut bf = |n: usize| -> Result<DevPtr<bf16>> {
            let (b, p) = alloc::<bf16>(&*self.exec, n)?;
            bufs.push(b);
            Ok(p)
        };
        let (x, hn, qkv) = (bf(t * h)?, bf(t * h)?, bf(t * c.qkv_width())?);
        let (attn, proj) = (bf(t * c.mixer_width())?, bf(t * h)?);
        let (gu, act) = (bf(chunk * 2 * inter)?, bf(chunk * inter)?);
        let (meta_b, meta) = alloc::<i32>(&*self.exec, 2 * t + 6)?;
        let (logits_b, logits) = alloc::<f32>(&*self.exec, c.vocab_size)?;
        bufs.extend([meta_b, logits_b]);
        let shapes = || (0..c.num_layers).filter_map(|l| c.state(l));
        let moe = match c.moe {
            None => None,
            Some(m) => {
                let (k, si) = (m.top_k, m.shared_intermediate.unwrap_or(0));
                let (cb, ck) = (chunk, chunk * k);
                let (lb, logits) = alloc::<f32>(&*self.exec, cb * m.num_experts)?;
                let (ib, ids) = alloc::<i32>(&*self.exec, ck)?;
                let (wb, weights) = alloc::<f32>(&*self.exec, ck)?;
                let (gb, shared_gate) = alloc::<f32>(&*self.exec, cb)?;
                bufs.extend([lb, ib, wb, gb]);
                let mut bf = |n: usize| -> Result<DevPtr<bf16>> {
                    let (b, p) = alloc::<bf16>(&*self.exec, n.max(1))?;
                    bufs.push(b);
                    Ok(p)
                };
                Some(MoeActs {
                    logits,
                    ids,
                    weights,
                    gu: bf(ck * 2 * inter)?,
                    act: bf(ck * inter)?,
                    y: bf(ck * h)?,
                    shared_gu: bf(cb * 2 * si)?,
                    shared_act: bf(cb * si)?,
                    shared_out: bf(cb * h)?,
                    shared_gate,
                })
            }
        };
        let delta = match shapes().map(|s| s.conv_channels()).max() {
            None => None,
            Some(channels) => {
                let (cb, conv) = alloc::<f32>(&*self.exec, t * channels)?;
                let (ob, out) = alloc::<f32>(&*self.exec, t * c.mixer_width())?;
                bufs.extend([cb, ob]);
                Some((conv, out))
            }
        };
        self.acts = Some(Acts {
            rows: t,
            chunk,
            vocab: c.vocab_size,
            x,
            hn,
            qkv,
            attn,
            delta,
            moe,
            proj,
            gu,
            act,
            meta,
            logits,
            _bufs: bufs,
        });
        Ok(())
    }

    /// Enqueues the tokens at positions `pos0..` and returns the last token's logits
    /// `[vocab]` (the only synchronisation).
    pub fn forward(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<bf16>,
    ) -> Result<Vec<f32>> {
        self.enqueue(tokens, pos0, kv)?;
        let a = self
            .acts
            .as_ref()
            .expect("enqueue allocated the activations");
        let mut logits = vec![0f32; a.vocab];
        // SAFETY: the logits buffer holds `vocab` f32; `download` waits for the step.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(logits.as_mut_ptr() as *mut u8, a.vocab * 4);
            self.exec.download(a.logits.cast(), dst)?;
        }
        Ok(logits)
    }

    /// Everything of `forward` but the download: the host returns once the work is queued.
    /// Steps of at most `kv.max_step_tokens()` (one, unless a sliding-window ring bounds
    /// them), as `Model::forward` takes them.
    pub fn enqueue(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<bf16>,
    ) -> Result<()> {
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        let n = kv.max_step_tokens().max(1);
        let mut t = 0;
        for (i, chunk) in tokens.chunks(n).enumerate() {
            self.enqueue_step(chunk, pos0 + i * n, kv)?;
            t = chunk.len();
        }
        let (c, a) = (
            &self.cfg,
            self.acts.as_ref().expect("allocated by the step"),
        );
        self.range("lm_head");
        let h = c.hidden_size;
        let shape = GemmShape {
            m: 1,
            k: h,
            n: c.vocab_size,
        };
        let last = a.hn.at((t - 1) * h);
        let out = GemmOut::F32(a.logits);
        self.gemm(Gemm::Fast, last, self.w.lm_head(), out, shape)?;
        self.pop();
        Ok(())
    }

    /// One step: its tokens through every layer, the final norm in `a.hn`.
    fn enqueue_step(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<bf16>,
    ) -> Result<()> {
        self.begin(tokens, pos0, kv)?;
        let (t, c) = (tokens.len(), self.cfg.clone());
        let a = self.acts.as_ref().expect("allocated by begin");
        let exec = &self.exec;
        // Step metadata in one upload (pageable: the driver stages it before returning).
        let mut meta: Vec<i32> = tokens.iter().map(|&id| id as i32).collect();
        meta.extend((pos0..pos0 + t).map(|p| p as i32));
        meta.extend([0, t as i32, (pos0 + t) as i32, 0]);
        // SAFETY: `meta` fits the [2 rows + 6] buffer.
        unsafe { htod_i32(&**exec, a.meta, &meta)? };
        let (ids, pos) = (a.meta, a.meta.at(t));
        let step = StepPlan {
            rows: t,
            pos,
            cache_rows: pos, // one sequence in a contiguous slot: row = position
            window: None,
            seqs: vec![SeqRows::one(pos0, t)],
            gemm: Gemm::Fast,
            attn: StepAttn::Contiguous {
                selected: a.meta.at(2 * t + 4),
                args: AttnArgs {
                    q: a.qkv,
                    k: DevPtr::from_addr(0), // the layer's slot
                    v: DevPtr::from_addr(0),
                    out: a.attn,
                    cu_seqlens: a.meta.at(2 * t),
                    ctx_len: a.meta.at(2 * t + 2),
                    table: a.meta.at(2 * t + 3),
                    capacity: 0,
                    tokens: t,
                    ctx: pos0 + t,
                    num_heads: c.num_heads,
                    num_kv_heads: c.num_kv_heads,
                    q_stride: c.attn_qkv_dim(),
                    scale: c.attn_scale,
                    window: None, // the layer's
                    sinks: None,  // the layer's
                },
            },
        };
        self.embed(ids, t)?;
        self.layers(&step, kv)
    }

    /// Checks one sequence's step of `tokens` at `pos0..`, begins it on `kv` and
    /// allocates its activations.
    fn begin(&mut self, tokens: &[u32], pos0: usize, kv: &mut dyn KvCache<bf16>) -> Result<()> {
        let t = tokens.len();
        if t == 0 {
            bail!("forward called with no tokens");
        }
        check_ids(&self.cfg, tokens)?;
        if pos0 + t > self.max_pos {
            bail!(
                "position {} is past the {} positions this CUDA model was built for",
                pos0 + t,
                self.max_pos
            );
        }
        kv.begin_step(pos0, t)?;
        self.ensure_acts(t)
    }

    /// A step of `tokens` at `pos0..` whose every row runs as a one-token step at its
    /// position does (cuBLAS a row at a time; row `r` through the decode kernel over the
    /// keys up to `pos0 + r`): every row's logits `[vocab]`, in order, each bitwise those
    /// `forward` of that token alone gives after the rows before it. Verified sparse
    /// decode's verify step, which must equal a run that decodes one token at a time.
    pub fn forward_rows(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<bf16>,
    ) -> Result<Vec<Vec<f32>>> {
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        let n = kv.max_step_tokens().max(1);
        let mut logits = Vec::with_capacity(tokens.len());
        for (i, chunk) in tokens.chunks(n).enumerate() {
            logits.extend(self.forward_rows_step(chunk, pos0 + i * n, kv)?);
        }
        Ok(logits)
    }

    /// `forward_rows` of one step.
    fn forward_rows_step(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<bf16>,
    ) -> Result<Vec<Vec<f32>>> {
        self.begin(tokens, pos0, kv)?;
        let (t, c) = (tokens.len(), self.cfg.clone());
        let ctx = pos0 + t;
        // i32 [ids: t | pos: t | ctx lens: t | tables: t × 1 block]
        let mut meta: Vec<i32> = tokens.iter().map(|&id| id as i32).collect();
        meta.extend((pos0..ctx).map(|p| p as i32));
        meta.extend((pos0..ctx).map(|p| p as i32 + 1));
        meta.extend(std::iter::repeat_n(0, t));
        let meta_d = self.upload_meta(&meta)?;
        let scratch = self.rows_scratch(t, ctx)?;
        let logits = self.batch.logits.ensure(&*self.exec, t * c.vocab_size)?;
        let a = self.acts.as_ref().expect("allocated by begin");
        let pos = meta_d.at(t);
        let step = StepPlan {
            rows: t,
            pos,
            cache_rows: pos, // a contiguous slot: row = position
            window: None,
            seqs: vec![SeqRows::one(pos0, t)],
            gemm: Gemm::FastRows,
            attn: StepAttn::DecodeRows(
                PagedAttn {
                    q: a.qkv,
                    k: DevPtr::from_addr(0), // the layer's slot
                    v: DevPtr::from_addr(0),
                    out: a.attn,
                    cu_seqlens: DevPtr::from_addr(0), // unused by the decode kernel
                    ctx_lens: meta_d.at(2 * t),
                    tables: meta_d.at(3 * t),
                    max_blocks: 1,
                    block_size: 0, // the layer's slot rows
                    num_heads: c.num_heads,
                    num_kv_heads: c.num_kv_heads,
                    q_stride: c.attn_qkv_dim(),
                    head_dim: c.head_dim,
                    batch: t,
                    max_q_len: 1,
                    max_ctx: ctx,
                    scale: c.attn_scale,
                    window: None, // the layer's
                    sinks: None,  // the layer's
                },
                scratch,
            ),
        };
        let hn = a.hn;
        self.embed(meta_d, t)?;
        self.layers(&step, kv)?;
        self.range("lm_head");
        let shape = GemmShape {
            m: t,
            k: c.hidden_size,
            n: c.vocab_size,
        };
        let out = GemmOut::F32(logits);
        self.gemm(Gemm::FastRows, hn, self.w.lm_head(), out, shape)?;
        self.pop();
        self.download_logits(logits, t)
    }

    /// `r` rows of logits `[vocab]` at `out` (waits for the step).
    fn download_logits(&self, out: DevPtr<f32>, r: usize) -> Result<Vec<Vec<f32>>> {
        let vocab = self.cfg.vocab_size;
        let mut flat = vec![0f32; r * vocab];
        // SAFETY: `out` holds r · vocab f32; `download` waits for the step.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(flat.as_mut_ptr() as *mut u8, flat.len() * 4);
            self.exec.download(out.cast(), dst)?;
        }
        Ok(flat.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
    }

    fn range(&self, name: &str) {
        if self.nvtx {
            nvtx::range_push!("{name}");
        }
    }

    fn range_l(&self, name: &str, l: usize) {
        if self.nvtx {
            nvtx::range_push!("{name} {l}");
        }
    }

    fn pop(&self) {
        if self.nvtx {
            nvtx::range_pop!();
        }
    }

    /// Embeds `ids` into `a.x` and normalises for layer 0 into `a.hn`.
    fn embed(&self, ids: DevPtr<i32>, t: usize) -> Result<()> {
        let (c, a) = (
            &self.cfg,
            self.acts.as_ref().expect("allocated by the caller"),
        );
        let h = c.hidden_size;
        self.range("embed");
        let table = self.w.embed.ptr;
        let scale = c.embed_scale.unwrap_or(1.0);
        self.exec
            .launch(&ops::embedding(table, ids, a.x, t, c.vocab_size, h, scale))?;
        let norm = self.w.layers[0].attn_norm.ptr;
        let eps = c.rms_norm_eps;
        self.exec
            .launch(&ops::rms_norm(a.x, norm, a.hn, t, h, eps))?;
        self.pop();
        Ok(())
    }

    /// Every layer of `step`, each pulling its KV (a state layer: its sequences'
    /// recurrent states) from `kv` and handing it back.
    fn layers(&self, step: &StepPlan, kv: &mut dyn KvCache<bf16>) -> Result<()> {
        if self.cfg.has_state_layers() {
            for s in &step.seqs {
                kv.begin_state(s.state_slot, s.pos0, s.tokens)?;
            }
        }
        for l in 0..self.cfg.num_layers {
            // A state layer still takes its turn in the cache's schedule (an offload
            // engine's slots turn over), but its memory is the recurrent state.
            let slot = kv.begin_layer(l)?;
            self.range_l("layer", l);
            match self.cfg.state(l) {
                Some(s) => self.state_mixer(l, s, step, kv)?,
                None => self.attention(l, step, slot, &mut |q| kv.select_rows(l, q))?,
            }
            self.finish_layer(l, step.rows, step.gemm)?;
            self.pop();
            kv.end_layer(l)?;
        }
        Ok(())
    }

    /// A state layer's token mixer: the fused projection `[q | k | v | z | b | a]`, each
    /// sequence's rows in order through the causal conv and the gated delta rule from and
    /// into its recurrent state, then the gated norm of every row; leaves
    /// `[rows, v_heads · dv]` in `a.attn` for `out_proj`.
    fn state_mixer(
        &self,
        l: usize,
        s: DeltaShape,
        step: &StepPlan,
        kv: &mut dyn KvCache<bf16>,
    ) -> Result<()> {
        let c = &self.cfg;
        let a = self.acts.as_ref().expect("allocated by the step");
        let (exec, lw) = (&*self.exec, &self.w.layers[l]);
        let d = self.w.delta[l]
            .as_ref()
            .context("a state layer without its recurrence's weights")?;
        let (conv, out) = a.delta.expect("allocated for a state-layer model");
        let (t, width) = (step.rows, s.proj_width());
        let (channels, vd) = (s.conv_channels(), s.v_heads * s.dv);
        self.range("recurrence");
        let shape = GemmShape {
            m: t,
            k: c.hidden_size,
            n: width,
        };
        self.gemm(step.gemm, a.hn, lw.wqkv.ptr, GemmOut::Bf16(a.qkv), shape)?;
        for seq in &step.seqs {
            let state = kv.layer_state(l, seq.state_slot)?;
            if state.len != s.seq_state_len() {
                bail!(
                    "layer {l}: a recurrent state of {} floats, the layer's is {}",
                    state.len,
                    s.seq_state_len()
                );
            }
            let (tail, matrix) = (state.ptr, state.ptr.at(s.conv_tail_len()));
            let (r0, n) = (seq.row0, seq.tokens);
            let rows = a.qkv.at(r0 * width); // [n, q | k | v | z | b | a]
            let conv_rows = conv.at(r0 * channels);
            exec.launch(&ops::delta_conv(rows, tail, d.conv, conv_rows, n, width, s))?;
            exec.launch(&ops::delta_rule(
                conv_rows,
                rows.at(channels + vd), // b | a
                matrix,
                d.decay_rate,
                d.dt_bias,
                out.at(r0 * vd),
                n,
                width,
                s,
            ))?;
        }
        let (z, eps) = (a.qkv.at(channels), c.rms_norm_eps);
        exec.launch(&ops::delta_gated_norm(
            out, z, d.norm, a.attn, t, width, s, eps,
        ))?;
        self.pop();
        Ok(())
    }

    /// `out = x · wᵀ` with the step's GEMM.
    fn gemm(
        &self,
        g: Gemm,
        x: DevPtr<bf16>,
        w: DevPtr<bf16>,
        out: GemmOut,
        s: GemmShape,
    ) -> Result<()> {
        match g {
            Gemm::Fast => self.exec.gemm(x, w, out, s),
            Gemm::BatchInvariant => self.exec.launch(&ops::gemm_fixed(x, w, out, s)),
            Gemm::FastRows => {
                let GemmShape { m, k, n } = s;
                for r in 0..m {
                    let row = GemmShape { m: 1, k, n };
                    self.exec.gemm(x.at(r * k), w, out.at(r * n), row)?;
                }
                Ok(())
            }
        }
    }

    /// An attention layer's token mixer on `a.hn`, its output `[rows, q_dim]` in
    /// `a.attn`; K/V of the new tokens stored into `slot` at the step's cache rows, or where
    /// `select` (the cache's `select_rows`, given a decode token's query) puts them.
    fn attention(
        &self,
        l: usize,
        step: &StepPlan,
        slot: LayerSlot<bf16>,
        select: &mut dyn FnMut(Query<bf16>) -> Result<Option<NewRow>>,
    ) -> Result<()> {
        let c = &self.cfg;
        let a = self.acts.as_ref().expect("allocated by enqueue");
        let (exec, lw) = (&*self.exec, &self.w.layers[l]);
        let (h, qd, kvd, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
        let (nh, nkv, eps) = (c.num_heads, c.num_kv_heads, c.rms_norm_eps);
        let qkv_dim = c.attn_qkv_dim(); // q | k | v (| the output gates)
        let t = step.rows;
        self.range("attention");
        // 1. Fused QKV projection (and Qwen3.5's output gates).
        let shape = GemmShape {
            m: t,
            k: h,
            n: qkv_dim,
        };
        self.gemm(step.gemm, a.hn, lw.wqkv.ptr, GemmOut::Bf16(a.qkv), shape)?;
        if let Some(b) = &lw.bqkv {
            exec.launch(&ops::add_bias(a.qkv, b.ptr, t, qkv_dim))?;
        }
        // 2. Qwen3, Gemma 3: per-head RMSNorm of q and k before RoPE.
        if let Some((qn, kn)) = &lw.qk_norm {
            exec.launch(&ops::head_rms_norm(a.qkv, qn.ptr, t, nh, hd, qkv_dim, eps))?;
            let k_heads = a.qkv.at(qd);
            exec.launch(&ops::head_rms_norm(
                k_heads, kn.ptr, t, nkv, hd, qkv_dim, eps,
            ))?;
        }
        // 3. RoPE on q and k together (adjacent heads in the fused row), the layer's own
        //    (a window may have its own base).
        let ((cos, sin), pos) = (self.rope[self.layer_rope[l]], step.pos);
        let dims = (hd, c.rotary_dim);
        exec.launch(&ops::rope(a.qkv, pos, cos, sin, t, nh + nkv, dims, qkv_dim))?;
        // 4. Sparse decode: the cache chooses the rows to attend from the query (a decode
        //    token's, the head of its fused row) and says where the new K/V goes; in a
        //    prefill it sees the last token's query (the first decode step's prediction).
        let chosen = match &step.attn {
            StepAttn::PerRow(..) => None,
            _ => select(Query {
                ptr: a.qkv.at((t - 1) * qkv_dim),
                len: qd,
            })?,
        };
        let selected = match (chosen, &step.attn) {
            (None, _) => None,
            (Some(NewRow(r)), StepAttn::Contiguous { selected, .. }) if t == 1 => {
                Some((r, *selected))
            }
            (Some(_), _) => bail!("sparse decode: the cache chose rows for a step of {t} tokens"),
        };
        if let Some((r, at)) = selected {
            // SAFETY: `at` is the step's i32 [2].
            unsafe { htod_i32(exec, at, &[r as i32, r as i32 + 1])? };
        }
        // 5. Store the new K/V at their cache rows (a ring's: position modulo its rows),
        //    attend (a sliding-window layer: its window).
        let (kp, vp) = (a.qkv.at(qd), a.qkv.at(qd + kvd));
        let (window, sinks) = (c.window(l), self.w.layer_f32[l].sinks);
        let pool_rows = step.window.filter(|_| window.is_some());
        let slots = selected.map_or(step.cache_rows, |(_, at)| at);
        let slots = pool_rows.map_or(slots, |w| w.cache_rows);
        let ring = slot.ring.then_some(slot.rows);
        exec.launch(&ops::kv_store(
            kp, vp, slot.k, slot.v, slots, t, kvd, qkv_dim, ring,
        ))?;
        match &step.attn {
            StepAttn::Contiguous { args, .. } => {
                let mut args = AttnArgs {
                    k: slot.k,
                    v: slot.v,
                    capacity: slot.rows,
                    window,
                    sinks,
                    scale: c.layer_attn_scale(l), // YaRN's factor folded in
                    ..*args
                };
                if let Some((r, at)) = selected {
                    (args.ctx_len, args.ctx) = (at.at(1), r + 1);
                }
                if ring.is_some() {
                    args.table = self.ring_table; // ctx ≤ max_pos entries
                } else if args.ctx > slot.rows {
                    bail!(
                        "layer {l}: {} tokens in a KV slot of {}",
                        args.ctx,
                        slot.rows
                    );
                }
                if t == 1 {
                    for l in ops::attn_decode(&args.paged(hd), &self.scratch)? {
                        exec.launch(&l)?;
                    }
                } else {
                    exec.launch(&ops::attn_prefill(&args.paged(hd)))?;
                }
            }
            StepAttn::PerRow(paged, scratch) => {
                let paged = PagedAttn {
                    k: slot.k,
                    v: slot.v,
                    tables: pool_rows.map_or(paged.tables, |w| w.tables),
                    window,
                    sinks,
                    scale: c.layer_attn_scale(l), // YaRN's factor folded in
                    ..*paged
                };
                for l in ops::attn_decode(&paged, scratch)? {
                    exec.launch(&l)?;
                }
            }
            StepAttn::DecodeRows(paged, scratch) => {
                if ring.is_none() && paged.max_ctx > slot.rows {
                    bail!(
                        "layer {l}: {} tokens in a KV slot of {}",
                        paged.max_ctx,
                        slot.rows
                    );
                }
                // One block of the slot's rows: key `i` is slot row `i` (a ring's: every
                // row's table the ring table).
                let mut paged = PagedAttn {
                    k: slot.k,
                    v: slot.v,
                    block_size: slot.rows,
                    window,
                    sinks,
                    scale: c.layer_attn_scale(l), // YaRN's factor folded in
                    ..*paged
                };
                if ring.is_some() {
                    (paged.tables, paged.max_blocks) = (self.ring_table, 0);
                }
                for l in ops::attn_decode(&paged, scratch)? {
                    exec.launch(&l)?;
                }
            }
        }
        // 6. Qwen3.5: each head's output times σ(its gate).
        if c.attn_output_gate {
            let gates = a.qkv.at(qd + 2 * kvd);
            exec.launch(&ops::sigmoid_gate(a.attn, gates, t, qd, qkv_dim))?;
        }
        self.pop();
        Ok(())
    }

    /// The rest of layer `l` after its token mixer left `[rows, mixer width]` in
    /// `a.attn`: output projection, (Gemma: its norm,) residual add into `a.x`, the MLP's
    /// input norm, the MLP in row chunks, and the next block's normalised input in `a.hn`.
    fn finish_layer(&self, l: usize, t: usize, gemm: Gemm) -> Result<()> {
        let c = &self.cfg;
        let a = self.acts.as_ref().expect("allocated by the step");
        let (exec, lw) = (&*self.exec, &self.w.layers[l]);
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let width = c.state(l).map_or(c.q_dim(), |s| s.v_heads * s.dv);
        let shape = |m, k, n| GemmShape { m, k, n };
        let linear = |x, w, out, s| self.gemm(gemm, x, w, GemmOut::Bf16(out), s);
        self.range("out_proj");
        linear(a.attn, lw.wo.ptr, a.proj, shape(t, width, h))?;
        if let Some(bo) = &lw.bo {
            exec.launch(&ops::add_bias(a.proj, bo.ptr, t, h))?;
        }
        let post = lw.post_norms.as_ref().map(|(at, mlp)| (at.ptr, mlp.ptr));
        let add_norm = |x, d, post: Option<DevPtr<bf16>>, w, out, n| {
            exec.launch(&ops::add_rms_norm(x, d, post, w, out, n, h, eps))
        };
        add_norm(a.x, a.proj, post.map(|p| p.0), lw.mlp_norm.ptr, a.hn, t)?;
        self.pop();
        // 7. MLP in row chunks; the residual add is fused with the next block's norm.
        self.range("mlp");
        let next_norm = self
            .w
            .layers
            .get(l + 1)
            .map_or(self.w.final_norm.ptr, |n| n.attn_norm.ptr);
        let streamed = self.begin_experts(l)?;
        for r0 in (0..t).step_by(a.chunk) {
            let n = a.chunk.min(t - r0);
            let row = |p: DevPtr<bf16>| p.at(r0 * h);
            self.mlp(l, gemm, row(a.hn), row(a.proj), n, streamed)?;
            let (x, d, out) = (row(a.x), row(a.proj), row(a.hn));
            add_norm(x, d, post.map(|p| p.1), next_norm, out, n)?;
        }
        self.end_experts(l, streamed)?;
        self.pop();
        Ok(())
    }

    /// Streams routed experts from host memory through `source` (the model's weights
    /// were uploaded without them: `ExpertPlace::Streamed`).
    pub fn stream_experts(&mut self, source: Box<dyn ExpertSource>) {
        self.experts = Some(std::sync::Mutex::new(source));
    }

    /// Layer `l`'s streamed experts, if it has experts and they are streamed.
    fn begin_experts(&self, l: usize) -> Result<Option<ExpertPtrs>> {
        let streamed = matches!(&self.w.layers[l].mlp, MlpOf::Experts(x) if x.mats.is_none());
        match (&self.experts, streamed) {
            (Some(s), true) => Ok(Some(s.lock().expect("expert stream").begin(l)?)),
            (None, true) => bail!("layer {l}: its experts are streamed, and no stream was set"),
            _ => Ok(None),
        }
    }

    /// Hands layer `l`'s streamed experts back after its MLP's work is queued.
    fn end_experts(&self, l: usize, streamed: Option<ExpertPtrs>) -> Result<()> {
        match (&self.experts, streamed) {
            (Some(s), Some(_)) => s.lock().expect("expert stream").end(l),
            _ => Ok(()),
        }
    }

    /// Layer `l`'s MLP on `n` ≤ `MLP_CHUNK` normalised rows `hn` → `out` `[n, hidden]`;
    /// `streamed`: where its routed experts are when they are streamed.
    fn mlp(
        &self,
        l: usize,
        gemm: Gemm,
        hn: DevPtr<bf16>,
        out: DevPtr<bf16>,
        n: usize,
        streamed: Option<ExpertPtrs>,
    ) -> Result<()> {
        let c = &self.cfg;
        let a = self.acts.as_ref().expect("allocated by the step");
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let shape = |m, k, n| GemmShape { m, k, n };
        let linear = |x, w, out, s| self.gemm(gemm, x, w, GemmOut::Bf16(out), s);
        match &self.w.layers[l].mlp {
            MlpOf::Dense { gate_up, down } => {
                linear(hn, gate_up.ptr, a.gu, shape(n, h, 2 * inter))?;
                self.exec
                    .launch(&ops::gated_mul(c.mlp_act, a.gu, a.act, n, inter))?;
                linear(a.act, down.ptr, out, shape(n, inter, h))
            }
            MlpOf::Experts(x) => {
                let mats = match (&x.mats, streamed) {
                    (Some(m), _) => ExpertPtrs::of(m),
                    (None, Some(p)) => p,
                    (None, None) => bail!("layer {l}: streamed experts outside begin_experts"),
                };
                self.experts(l, x, mats, gemm, hn, out, n)
            }
        }
    }

    /// Layer `l`'s MLP alone on the normalised rows `x` (f32 `[rows, hidden]`, rows ≤
    /// 1,024, rounded to bf16 on upload): its output `[rows, hidden]`. gpu-check's
    /// block-level comparison with the CPU model's, where a whole model's bf16 noise would
    /// hide a fault (a mixture of experts on a chaotic random checkpoint).
    pub(crate) fn mlp_alone(&mut self, l: usize, x: &[f32]) -> Result<Vec<f32>> {
        let h = self.cfg.hidden_size;
        let rows = x.len() / h;
        if rows == 0 || rows * h != x.len() || rows > MLP_CHUNK || l >= self.cfg.num_layers {
            bail!(
                "mlp_alone: {} values for layer {l} (rows of {h}, at most {MLP_CHUNK})",
                x.len()
            );
        }
        self.ensure_acts(rows)?;
        let a = self.acts.as_ref().expect("allocated above");
        let (hn, out) = (a.hn, a.proj);
        let streamed = self.begin_experts(l)?;
        let bits: Vec<u8> = x
            .iter()
            .flat_map(|&v| crate::device::bf16::f32_to_bf16(v).to_le_bytes())
            .collect();
        // SAFETY: `hn` holds `rows · hidden` bf16.
        unsafe { self.exec.htod(hn.cast(), &bits)? };
        self.mlp(l, Gemm::Fast, hn, out, rows, streamed)?;
        self.end_experts(l, streamed)?;
        let mut raw = vec![0u8; 2 * x.len()];
        // SAFETY: `out` holds `rows · hidden` bf16; `download` waits for the work.
        unsafe { self.exec.download(out.cast(), &mut raw)? };
        Ok(raw
            .chunks_exact(2)
            .map(|b| crate::device::bf16::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect())
    }

    /// A mixture of experts on `n` normalised rows `x` → `out` `[n, hidden]`: the router
    /// (f32 logits, gpt-oss's bias added), each row's experts (`moe_route`), each (row,
    /// expert) pair through its expert's gate/up, activation (SwiGLU, gpt-oss's clamped
    /// one) and down (`moe_matvec`: only the chosen experts' rows are read, gpt-oss's
    /// biases added), the shared expert over every row, and the weighted sum.
    #[allow(clippy::too_many_arguments)]
    fn experts(
        &self,
        l: usize,
        x: &ExpertsOf<Tensor>,
        mats: ExpertPtrs,
        gemm: Gemm,
        hn: DevPtr<bf16>,
        out: DevPtr<bf16>,
        n: usize,
    ) -> Result<()> {
        let c = &self.cfg;
        let a = self.acts.as_ref().expect("allocated by the step");
        let (m, moe) = (
            a.moe.as_ref().expect("allocated for an experts model"),
            c.moe.expect("an experts layer has a mixture config"),
        );
        let exec = &*self.exec;
        let (h, inter, e, k) = (
            c.hidden_size,
            c.intermediate_size,
            moe.num_experts,
            moe.top_k,
        );
        let shape = |m, k, n| GemmShape { m, k, n };
        self.gemm(
            gemm,
            hn,
            x.router.ptr,
            GemmOut::F32(m.logits),
            shape(n, h, e),
        )?;
        let router_bias = self.w.layer_f32[l].router_bias;
        exec.launch(&ops::moe_route(
            m.logits,
            router_bias,
            m.ids,
            m.weights,
            n,
            e,
            k,
        ))?;
        let (gu_bias, down_bias) = mats.biases.unzip();
        exec.launch(&ops::moe_matvec(
            hn,
            m.ids,
            mats.gate_up,
            gu_bias,
            m.gu,
            n * k,
            2 * inter,
            h,
            k,
        ))?;
        exec.launch(&ops::expert_act(moe.act, m.gu, m.act, n * k, inter))?;
        exec.launch(&ops::moe_matvec(
            m.act,
            m.ids,
            mats.down,
            down_bias,
            m.y,
            n * k,
            h,
            inter,
            1,
        ))?;
        let shared = match (&x.shared, moe.shared_intermediate) {
            (Some(s), Some(si)) => {
                let linear = |x, w, out, s| self.gemm(gemm, x, w, GemmOut::Bf16(out), s);
                linear(hn, s.gate_up.ptr, m.shared_gu, shape(n, h, 2 * si))?;
                exec.launch(&ops::gated_mul(
                    MlpAct::Silu,
                    m.shared_gu,
                    m.shared_act,
                    n,
                    si,
                ))?;
                linear(m.shared_act, s.down.ptr, m.shared_out, shape(n, si, h))?;
                self.gemm(
                    gemm,
                    hn,
                    s.gate.ptr,
                    GemmOut::F32(m.shared_gate),
                    shape(n, h, 1),
                )?;
                Some((m.shared_out, m.shared_gate))
            }
            _ => None,
        };
        exec.launch(&ops::moe_combine(m.y, m.weights, shared, out, n, k, h))
    }
}
