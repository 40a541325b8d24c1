//! Kernel launches as values, and raw asynchronous copies, on device pointers.
//!
//! A launch is a `Launch` (kernel, grid, arguments in signature order) built by one pure
//! function per kernel below; whatever can run a launch (`Exec::launch`: the GPU here, a
//! CPU emulator of the `.cu` sources) runs the same values, so each argument list exists
//! once. Every argument list mirrors its kernel's signature, named in its doc comment.
//!
//! Everything here takes raw `CUdeviceptr`s (`u64`) rather than `CudaSlice` views: the
//! model and the offload engine address sub-ranges of ring slots and fused buffers by
//! offset, and cudarc's safe copies from a `PinnedHostSlice` wait on and record that
//! slice's own event, which would silently serialise the prefetch and offload streams
//! that share the host KV. Event tracking is off (`CudaDevice::new`), so the pointer
//! getters below add no waits either.

use super::context::CudaDevice;
use crate::device::delta::{DeltaShape, ValueHeadOrder};
use crate::device::DevPtr;
use crate::device::{ExpertAct, MlpAct};
use anyhow::{anyhow, bail, Result};
use cudarc::cublas::{self, CudaBlas};
use cudarc::driver::{
    result, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use half::bf16;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use KArg::F32;

/// The address of `s[0]`. With event tracking off the returned guard records nothing.
pub fn dptr<T>(s: &CudaSlice<T>, st: &Arc<CudaStream>) -> DevPtr<T> {
    DevPtr::from_addr(s.device_ptr(st).0)
}

/// A pointer argument.
pub(super) fn arg<T>(p: DevPtr<T>) -> KArg {
    KArg::Ptr(p.addr())
}

/// An optional pointer argument: null for `None`.
fn opt<T>(p: Option<DevPtr<T>>) -> KArg {
    KArg::Ptr(p.map_or(0, |p| p.addr()))
}

fn drv<T>(what: &str, r: Result<T, cudarc::driver::DriverError>) -> Result<T> {
    r.map_err(|e| anyhow!("{what} failed: {e:?}"))
}

/// `bytes` host → device on `st`. `src` must stay valid until the copy runs (pinned host
/// memory owned by the caller), or be pageable (staged by the driver before returning).
///
/// # Safety
/// `dst` must hold `bytes`; `src` must point to `bytes` readable bytes.
pub unsafe fn htod(st: &CudaStream, dst: DevPtr<u8>, src: *const u8, bytes: usize) -> Result<()> {
    let s = std::slice::from_raw_parts(src, bytes);
    drv(
        "cuMemcpyHtoDAsync",
        result::memcpy_htod_async(dst.addr(), s, st.cu_stream()),
    )
}

/// # Safety
/// `src` must hold `bytes`; `dst` must point to `bytes` writable bytes that outlive the copy.
pub unsafe fn dtoh(st: &CudaStream, dst: *mut u8, src: DevPtr<u8>, bytes: usize) -> Result<()> {
    let d = std::slice::from_raw_parts_mut(dst, bytes);
    drv(
        "cuMemcpyDtoHAsync",
        result::memcpy_dtoh_async(d, src.addr(), st.cu_stream()),
    )
}

/// # Safety
/// Both ranges must be live device memory of at least `bytes`.
pub unsafe fn dtod(st: &CudaStream, dst: DevPtr<u8>, src: DevPtr<u8>, bytes: usize) -> Result<()> {
    drv(
        "cuMemcpyDtoDAsync",
        result::memcpy_dtod_async(dst.addr(), src.addr(), bytes, st.cu_stream()),
    )
}

/// Fills `bytes` with 0xFF: every bf16 becomes 0xFFFF, a NaN (the sanitizer's poison).
///
/// # Safety
/// `dst` must hold `bytes`.
pub unsafe fn poison(st: &CudaStream, dst: DevPtr<u8>, bytes: usize) -> Result<()> {
    fill(st, dst, 0xff, bytes)
}

/// Queues a fill of `bytes` at `dst` with `byte` on `st`.
///
/// # Safety
/// `dst` must hold `bytes`.
pub unsafe fn fill(st: &CudaStream, dst: DevPtr<u8>, byte: u8, bytes: usize) -> Result<()> {
    drv(
        "cuMemsetD8Async",
        result::memset_d8_async(dst.addr(), byte, bytes, st.cu_stream()),
    )
}

/// One kernel argument, as the kernel's C signature takes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KArg {
    /// A pointer (`const T*` / `T*`): a device address.
    Ptr(u64),
    I32(i32),
    F32(f32),
}

/// A kernel launch as a value: which kernel, the grid, the arguments in signature order.
/// Built by the functions below (one per kernel), run by `Exec::launch` on any backend.
#[derive(Clone, Debug)]
pub struct Launch {
    pub file: &'static str, // e.g. "norm.cu"
    pub func: String,       // e.g. "rms_norm", "attn_prefill_hd128"
    pub cfg: LaunchConfig,
    pub args: Vec<KArg>,
}

/// Every kernel the runtime may launch: (file, function names), one entry per
/// `extern "C" __global__` function of `kernels/*.cu` (the `INSTANTIATE(HD)` macros expand
/// to `_hd64`, `_hd96`, `_hd128` and `_hd256`). The single list both the CUDA loader and
/// the emulator read.
pub const KERNELS: &[(&str, &[&str])] = &[
    (
        "activation.cu",
        &[
            "silu_mul",
            "gelu_tanh_mul",
            "sigmoid_gate",
            "clamped_swiglu_mul",
        ],
    ),
    (
        "attention_decode.cu",
        &[
            "attn_decode_hd64",
            "attn_decode_hd96",
            "attn_decode_hd128",
            "attn_decode_hd256",
            "attn_decode_reduce",
        ],
    ),
    (
        "attention_prefill.cu",
        &[
            "attn_prefill_hd64",
            "attn_prefill_hd96",
            "attn_prefill_hd128",
            "attn_prefill_hd256",
        ],
    ),
    ("bias.cu", &["add_bias"]),
    (
        "delta_net.cu",
        &["delta_conv", "delta_rule", "delta_gated_norm"],
    ),
    ("embedding.cu", &["embedding_gather"]),
    (
        "gemm.cu",
        &["gemm_fixed_bm4", "gemm_fixed_bm16", "gemm_fixed_bm64"],
    ),
    ("kv_store.cu", &["kv_store"]),
    ("moe.cu", &["moe_route", "moe_matvec", "moe_combine"]),
    (
        "norm.cu",
        &[
            "rms_norm",
            "add_rms_norm",
            "norm_add_rms_norm",
            "head_rms_norm",
        ],
    ),
    ("rope.cu", &["rope_neox"]),
    ("sampling.cu", &["argmax", "sample"]),
    ("sparse.cu", &["page_bounds", "head_bounds"]),
];

/// Whether `func` is listed in `KERNELS` under `file`.
pub fn is_listed(file: &str, func: &str) -> bool {
    KERNELS
        .iter()
        .any(|(f, fns)| *f == file && fns.contains(&func))
}

/// The head dims the attention kernels are instantiated for (`INSTANTIATE(HD)`).
pub fn check_head_dim(head_dim: usize) -> Result<()> {
    if !HEAD_DIMS.contains(&head_dim) {
        bail!(
            "the CUDA attention kernels support head_dim 64, 96, 128 and 256, this model has {head_dim}"
        );
    }
    Ok(())
}

/// The attention kernels' instantiations (`INSTANTIATE(HD)` in the .cu files). A head dim
/// must be a multiple of 32 (one lane per 32 dims) and fit the prefill kernel's 48 KiB of
/// static shared memory (at 256 with fewer queries per block and one staging tile).
pub const HEAD_DIMS: [usize; 4] = [64, 96, 128, 256];

/// Queries per block of `attn_prefill_hd{head_dim}` (its `INSTANTIATE` line's BQ).
pub fn prefill_queries_per_block(head_dim: usize) -> usize {
    if head_dim > 128 {
        8
    } else {
        16
    }
}

/// Threads per block for the element-wise kernels.
pub(super) const EW: u32 = 256;

/// One thread per element, `block` threads per block.
pub(super) fn grid1(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(block).max(1), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row.
fn rows(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn i(n: usize) -> KArg {
    KArg::I32(n as i32)
}

pub(super) fn launch(file: &'static str, func: &str, cfg: LaunchConfig, args: Vec<KArg>) -> Launch {
    Launch {
        file,
        func: func.to_string(),
        cfg,
        args,
    }
}

/// embedding.cu `embedding_gather(table, ids, out, vocab, dim, scale)`:
/// `out[t] = table[ids[t]] · scale` (a zero row for an id outside the vocabulary), one
/// block per token.
pub fn embedding(
    table: DevPtr<bf16>, // bf16 [vocab, dim]
    ids: DevPtr<i32>,    // i32 [tokens]
    out: DevPtr<bf16>,   // bf16 [tokens, dim]
    tokens: usize,
    vocab: usize,
    dim: usize,
    scale: f32,
) -> Launch {
    let args = vec![arg(table), arg(ids), arg(out), i(vocab), i(dim), F32(scale)];
    launch("embedding.cu", "embedding_gather", rows(tokens, EW), args)
}

/// norm.cu `rms_norm(x, w, out, dim, eps)`: `out[r] = x[r] / rms(x[r]) * w`, one block
/// per row.
pub fn rms_norm(
    x: DevPtr<bf16>,   // bf16 [n_rows, dim]
    w: DevPtr<bf16>,   // bf16 [dim]
    out: DevPtr<bf16>, // bf16 [n_rows, dim]
    n_rows: usize,
    dim: usize,
    eps: f32,
) -> Launch {
    let args = vec![arg(x), arg(w), arg(out), i(dim), F32(eps)];
    launch("norm.cu", "rms_norm", rows(n_rows, EW), args)
}

/// norm.cu `add_rms_norm(x, delta, w, out, dim, eps)`: `x += delta` (stored in bf16),
/// then `out = rms_norm(x) * w`, one block per row; with `delta_norm: Some(w_delta)`
/// (Gemma's sandwich norms) `norm_add_rms_norm(x, delta, w_delta, w, out, dim, eps)`:
/// `x += rms_norm(delta) * w_delta` (the normed delta rounded to bf16) instead.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(
    x: DevPtr<bf16>,                  // bf16 [n_rows, dim], updated in place
    delta: DevPtr<bf16>,              // bf16 [n_rows, dim]
    delta_norm: Option<DevPtr<bf16>>, // bf16 [dim]
    w: DevPtr<bf16>,                  // bf16 [dim]
    out: DevPtr<bf16>,                // bf16 [n_rows, dim]
    n_rows: usize,
    dim: usize,
    eps: f32,
) -> Launch {
    let (func, mut args) = match delta_norm {
        None => ("add_rms_norm", vec![arg(x), arg(delta)]),
        Some(wd) => ("norm_add_rms_norm", vec![arg(x), arg(delta), arg(wd)]),
    };
    args.extend([arg(w), arg(out), i(dim), F32(eps)]);
    launch("norm.cu", func, rows(n_rows, EW), args)
}

/// delta_net.cu `delta_conv`: one sequence's `tokens` rows of q/k/v projections (the
/// first `conv_channels` of each `x_stride`-wide row) through the causal conv and SiLU,
/// continuing from and updating the conv `tail`; one thread per channel.
pub fn delta_conv(
    x: DevPtr<bf16>,   // bf16 [tokens, x_stride]
    tail: DevPtr<f32>, // f32 [kernel - 1, channels]
    w: DevPtr<f32>,    // f32 [channels, kernel]
    out: DevPtr<f32>,  // f32 [tokens, channels]
    tokens: usize,
    x_stride: usize,
    s: DeltaShape,
) -> Launch {
    let c = s.conv_channels();
    let args = vec![
        arg(x),
        arg(tail),
        arg(w),
        arg(out),
        i(tokens),
        i(x_stride),
        i(c),
        i(s.kernel),
    ];
    launch("delta_net.cu", "delta_conv", grid1(c, EW), args)
}

/// delta_net.cu `delta_rule`: the gated delta rule over one sequence's `tokens` rows, one
/// block per value head (a thread per value column, `dv` ≤ 1024, which the config's
/// bounds keep), continuing from and updating `state`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule(
    conv: DevPtr<f32>,       // f32 [tokens, conv_channels]: the conv's output
    ba: DevPtr<bf16>,        // bf16 [tokens, ba_stride]: b [v_heads] | a [v_heads]
    state: DevPtr<f32>,      // f32 [v_heads, dk, dv]
    decay_rate: DevPtr<f32>, // f32 [v_heads]
    dt_bias: DevPtr<f32>,    // f32 [v_heads]
    out: DevPtr<f32>,        // f32 [tokens, v_heads · dv]
    tokens: usize,
    ba_stride: usize,
    s: DeltaShape,
) -> Launch {
    let tiled = matches!(s.value_heads, ValueHeadOrder::Tiled) as usize;
    let args = vec![
        arg(conv),
        arg(ba),
        arg(state),
        arg(decay_rate),
        arg(dt_bias),
        arg(out),
        i(tokens),
        i(ba_stride),
        i(s.k_heads),
        i(s.v_heads),
        i(s.dk),
        i(s.dv),
        i(tiled),
    ];
    let cfg = LaunchConfig {
        grid_dim: (s.v_heads as u32, 1, 1),
        block_dim: (s.dv.next_multiple_of(32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch("delta_net.cu", "delta_rule", cfg, args)
}

/// delta_net.cu `delta_gated_norm`: each (token, value head)'s `dv` outputs RMS-normed,
/// times `w` and SiLU(z), into bf16; one block per (token, head).
#[allow(clippy::too_many_arguments)]
pub fn delta_gated_norm(
    o: DevPtr<f32>,    // f32 [tokens, v_heads · dv]
    z: DevPtr<bf16>,   // bf16 [tokens, z_stride]: z [v_heads · dv]
    w: DevPtr<f32>,    // f32 [dv]
    out: DevPtr<bf16>, // bf16 [tokens, v_heads · dv]
    tokens: usize,
    z_stride: usize,
    s: DeltaShape,
    eps: f32,
) -> Launch {
    let args = vec![
        arg(o),
        arg(z),
        arg(w),
        arg(out),
        i(s.v_heads),
        i(s.dv),
        i(z_stride),
        F32(eps),
    ];
    launch(
        "delta_net.cu",
        "delta_gated_norm",
        rows(tokens * s.v_heads, 128),
        args,
    )
}

/// moe.cu `moe_route`: each token's `top_k` experts (the largest logits, a NaN below any
/// number, a tie to the lower expert) and their softmax weights, in ascending expert
/// order (`model::moe::route`); one thread per token. A router `bias` (gpt-oss) is
/// added to `logits` in place first.
pub fn moe_route(
    logits: DevPtr<f32>,       // f32 [tokens, experts]
    bias: Option<DevPtr<f32>>, // f32 [experts]
    ids: DevPtr<i32>,          // i32 [tokens, top_k]
    weights: DevPtr<f32>,      // f32 [tokens, top_k]
    tokens: usize,
    experts: usize,
    top_k: usize,
) -> Launch {
    let args = vec![
        arg(logits),
        opt(bias),
        arg(ids),
        arg(weights),
        i(tokens),
        i(experts),
        i(top_k),
    ];
    launch("moe.cu", "moe_route", grid1(tokens, 64), args)
}

/// moe.cu `moe_matvec`: `out[r] = w[ids[r]] · x[r / x_div]` for each of `rows` (token,
/// chosen expert) rows, `w` a stack of every expert's `[n, kdim]` matrix; one warp per
/// output, a fixed-order reduction (batch-invariant). `x_div`: `top_k` when a token's
/// chosen rows all read its input (gate/up), 1 when each reads its own (down). `bias`
/// (gpt-oss): each expert's output bias.
#[allow(clippy::too_many_arguments)]
pub fn moe_matvec(
    x: DevPtr<bf16>,            // bf16 [rows / x_div, kdim]
    ids: DevPtr<i32>,           // i32 [rows]
    w: DevPtr<bf16>,            // bf16 [experts, n, kdim]
    bias: Option<DevPtr<bf16>>, // bf16 [experts, n]
    out: DevPtr<bf16>,          // bf16 [rows, n]
    rows: usize,
    n: usize,
    kdim: usize,
    x_div: usize,
) -> Launch {
    let args = vec![
        arg(x),
        arg(ids),
        arg(w),
        opt(bias),
        arg(out),
        i(rows),
        i(n),
        i(kdim),
        i(x_div),
    ];
    launch("moe.cu", "moe_matvec", grid1(rows * n * 32, 256), args)
}

/// moe.cu `moe_combine`: each token's chosen experts' outputs weighted and summed in
/// slot (ascending expert) order, plus σ(gate) · the shared expert's output where there
/// is one; one thread per output.
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    y: DevPtr<bf16>,                             // bf16 [tokens · top_k, hidden]
    weights: DevPtr<f32>,                        // f32 [tokens, top_k]
    shared: Option<(DevPtr<bf16>, DevPtr<f32>)>, // bf16 [tokens, hidden], f32 gate [tokens]
    out: DevPtr<bf16>,                           // bf16 [tokens, hidden]
    tokens: usize,
    top_k: usize,
    hidden: usize,
) -> Launch {
    let (s, g) = shared.map_or((0, 0), |(s, g)| (s.addr(), g.addr()));
    let args = vec![
        arg(y),
        arg(weights),
        KArg::Ptr(s),
        KArg::Ptr(g),
        arg(out),
        i(tokens),
        i(top_k),
        i(hidden),
    ];
    launch("moe.cu", "moe_combine", grid1(tokens * hidden, EW), args)
}

/// norm.cu `head_rms_norm(x, w, tokens, heads, head_dim, row_stride, eps)`, in place on
/// the first `heads` heads of each strided row; one warp per (token, head), 4 warps per
/// block.
pub fn head_rms_norm(
    x: DevPtr<bf16>, // bf16 [tokens, row_stride]: heads × head_dim used
    w: DevPtr<bf16>, // bf16 [head_dim]
    tokens: usize,
    heads: usize,
    head_dim: usize,
    row_stride: usize,
    eps: f32,
) -> Launch {
    let args = vec![
        arg(x),
        arg(w),
        i(tokens),
        i(heads),
        i(head_dim),
        i(row_stride),
        F32(eps),
    ];
    let cfg = grid1(tokens * heads * 32, 128);
    launch("norm.cu", "head_rms_norm", cfg, args)
}

/// rope.cu `rope_neox(x, pos, cos, sin, tokens, heads, head_dim, row_stride)` on `heads`
/// adjacent heads (q then k in the fused QKV row), one thread per rotated pair.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: DevPtr<bf16>,  // bf16 [tokens, row_stride]: heads × head_dim used, in place
    pos: DevPtr<i32>, // i32 [tokens] absolute positions
    cos: DevPtr<f32>, // f32 [max_pos, rotary_dim / 2]
    sin: DevPtr<f32>, // f32 [max_pos, rotary_dim / 2]
    tokens: usize,
    heads: usize,
    (head_dim, rotary_dim): (usize, usize),
    row_stride: usize,
) -> Launch {
    let args = vec![
        arg(x),
        arg(pos),
        arg(cos),
        arg(sin),
        i(tokens),
        i(heads),
        i(head_dim),
        i(rotary_dim),
        i(row_stride),
    ];
    let cfg = grid1(tokens * heads * (rotary_dim / 2), EW);
    launch("rope.cu", "rope_neox", cfg, args)
}

/// activation.cu `sigmoid_gate(x, gate, tokens, width, gate_stride)`: gated attention's
/// output, `x[t, j] *= σ(gate[t, j])` (Qwen3.5's full layers: the gates ride in the fused
/// projection's rows after v).
pub fn sigmoid_gate(
    x: DevPtr<bf16>,    // bf16 [tokens, width], in place
    gate: DevPtr<bf16>, // bf16 [tokens, gate_stride]: width gates used
    tokens: usize,
    width: usize,
    gate_stride: usize,
) -> Launch {
    let args = vec![arg(x), arg(gate), i(tokens), i(width), i(gate_stride)];
    launch(
        "activation.cu",
        "sigmoid_gate",
        grid1(tokens * width, EW),
        args,
    )
}

/// activation.cu `silu_mul(gu, out, tokens, inter)` (SwiGLU) or `gelu_tanh_mul(...)`
/// (GeGLU), as `act` says: `out[t, j] = act(gu[t, j]) * gu[t, inter + j]`.
pub fn gated_mul(
    act: MlpAct,
    gu: DevPtr<bf16>,  // bf16 [tokens, 2 × inter]: gate then up
    out: DevPtr<bf16>, // bf16 [tokens, inter]
    tokens: usize,
    inter: usize,
) -> Launch {
    let func = match act {
        MlpAct::Silu => "silu_mul",
        MlpAct::GeluTanh => "gelu_tanh_mul",
    };
    let args = vec![arg(gu), arg(out), i(tokens), i(inter)];
    launch("activation.cu", func, grid1(tokens * inter, EW), args)
}

/// An expert's activation as `act` says: SwiGLU (`gated_mul`), or gpt-oss's
/// `clamped_swiglu_mul(gu, out, tokens, inter, alpha, limit)`.
pub fn expert_act(
    act: ExpertAct,
    gu: DevPtr<bf16>,  // bf16 [tokens, 2 × inter]: gate then up
    out: DevPtr<bf16>, // bf16 [tokens, inter]
    tokens: usize,
    inter: usize,
) -> Launch {
    match act {
        ExpertAct::Silu => gated_mul(MlpAct::Silu, gu, out, tokens, inter),
        ExpertAct::ClampedSwiglu { alpha, limit } => {
            let args = vec![
                arg(gu),
                arg(out),
                i(tokens),
                i(inter),
                F32(alpha),
                F32(limit),
            ];
            let grid = grid1(tokens * inter, EW);
            launch("activation.cu", "clamped_swiglu_mul", grid, args)
        }
    }
}

/// bias.cu `add_bias(x, b, rows, n)`: `x[t, j] += b[j]` in place.
pub fn add_bias(
    x: DevPtr<bf16>, // bf16 [rows, n]
    b: DevPtr<bf16>, // bf16 [n]
    rows: usize,
    n: usize,
) -> Launch {
    let args = vec![arg(x), arg(b), i(rows), i(n)];
    launch("bias.cu", "add_bias", grid1(rows * n, EW), args)
}

/// kv_store.cu `kv_store(k, v, k_cache, v_cache, slots, tokens, kv_dim, src_stride,
/// ring_rows)`: rows `k[t]`, `v[t]` (strided inside fused QKV) to cache rows `slots[t]`
/// (−1: skipped), or `slots[t] % rows` in a ring of `ring: Some(rows)`.
#[allow(clippy::too_many_arguments)]
pub fn kv_store(
    k: DevPtr<bf16>,       // bf16 [tokens, src_stride]: kv_dim used
    v: DevPtr<bf16>,       // bf16 [tokens, src_stride]
    k_cache: DevPtr<bf16>, // bf16 [slots, kv_dim]
    v_cache: DevPtr<bf16>, // bf16 [slots, kv_dim]
    slots: DevPtr<i32>,    // i32 [tokens]
    tokens: usize,
    kv_dim: usize,
    src_stride: usize,
    ring: Option<usize>,
) -> Launch {
    let args = vec![
        arg(k),
        arg(v),
        arg(k_cache),
        arg(v_cache),
        arg(slots),
        i(tokens),
        i(kv_dim),
        i(src_stride),
        i(ring.unwrap_or(0)),
    ];
    launch("kv_store.cu", "kv_store", grid1(tokens * kv_dim, EW), args)
}

/// sampling.cu `argmax(logits, out, vocab)`: the first index of each row's maximum, one
/// block of 1,024 threads per row.
pub fn argmax(
    logits: DevPtr<f32>, // f32 [n_rows, vocab]
    out: DevPtr<i32>,    // i32 [n_rows]
    n_rows: usize,
    vocab: usize,
) -> Launch {
    let args = vec![arg(logits), arg(out), i(vocab)];
    launch("sampling.cu", "argmax", rows(n_rows, 1024), args)
}

/// sampling.cu `sample(logits, uniform, out, vocab, temperature, top_k, top_p)`: one
/// token per row drawn with `uniform[r]` (top_k 0: no top-k cut), one block of 1,024
/// threads per row.
#[allow(clippy::too_many_arguments)]
pub fn sample(
    logits: DevPtr<f32>,  // f32 [n_rows, vocab]
    uniform: DevPtr<f32>, // f32 [n_rows] in [0, 1)
    out: DevPtr<i32>,     // i32 [n_rows]
    n_rows: usize,
    vocab: usize,
    temperature: f32,
    top_k: usize,
    top_p: f32,
) -> Launch {
    let args = vec![
        arg(logits),
        arg(uniform),
        arg(out),
        i(vocab),
        F32(temperature),
        i(top_k),
        F32(top_p),
    ];
    launch("sampling.cu", "sample", rows(n_rows, 1024), args)
}

/// Paged attention over `batch` sequences, as both attention kernels take it. Sequence
/// `b` has `ctx_lens[b]` keys (its new tokens included); its key `j` is cache row
/// `tables[b][j / block_size] · block_size + j % block_size`. Prefill: its queries are
/// rows `cu_seqlens[b]..cu_seqlens[b + 1]` of `q`, the last ones of its context. Decode:
/// one query per sequence, row `b` of `q`.
#[derive(Clone, Copy, Debug)]
pub struct PagedAttn {
    pub q: DevPtr<bf16>,   // bf16 [total_q, q_stride]: num_heads × head_dim used
    pub k: DevPtr<bf16>,   // bf16 [cache rows, num_kv_heads × head_dim]
    pub v: DevPtr<bf16>,   // bf16 [cache rows, num_kv_heads × head_dim]
    pub out: DevPtr<bf16>, // bf16 [total_q, num_heads × head_dim]
    pub cu_seqlens: DevPtr<i32>, // i32 [batch + 1] query offsets (prefill only)
    pub ctx_lens: DevPtr<i32>, // i32 [batch]
    pub tables: DevPtr<i32>, // i32 [batch, max_blocks]
    pub max_blocks: usize,
    pub block_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub q_stride: usize,
    pub head_dim: usize, // picks the kernel instantiation (`HEAD_DIMS`)
    pub batch: usize,
    pub max_q_len: usize, // longest query run (host copy, sizes the prefill grid)
    pub max_ctx: usize,   // longest context (host copy, sizes the decode grid)
    pub scale: f32,       // score scale (`ModelConfig::attn_scale`)
    pub window: Option<usize>, // a sliding-window layer's window (`ModelConfig::window`)
    pub sinks: Option<DevPtr<f32>>, // f32 [num_heads]: gpt-oss's attention sinks
}

impl PagedAttn {
    /// (q, k_cache, v_cache): the first three arguments of both kernels.
    fn qkv(&self) -> [KArg; 3] {
        [arg(self.q), arg(self.k), arg(self.v)]
    }

    /// (max_blocks, block_size, num_heads, num_kv_heads, q_stride): shared by both kernels.
    fn shape(&self) -> [KArg; 5] {
        [
            i(self.max_blocks),
            i(self.block_size),
            i(self.num_heads),
            i(self.num_kv_heads),
            i(self.q_stride),
        ]
    }

    /// (window, scale): the last two arguments of both kernels (window 0: none).
    fn mask(&self) -> [KArg; 2] {
        [i(self.window.unwrap_or(0)), F32(self.scale)]
    }
}

/// Attention over one contiguous cache `[capacity, kv_heads, head_dim]` (a ring slot or
/// a resident layer), for one sequence: the kernels' block table with one block of
/// `capacity` tokens (`paged`).
#[derive(Clone, Copy, Debug)]
pub struct AttnArgs {
    pub q: DevPtr<bf16>, // bf16 [tokens, q_stride]: q heads first (inside fused QKV)
    pub k: DevPtr<bf16>, // bf16 [capacity, kv_dim]
    pub v: DevPtr<bf16>, // bf16 [capacity, kv_dim]
    pub out: DevPtr<bf16>, // bf16 [tokens, num_heads × head_dim]
    pub cu_seqlens: DevPtr<i32>, // i32 [2] = {0, tokens}
    pub ctx_len: DevPtr<i32>, // i32 [1] = pos0 + tokens
    pub table: DevPtr<i32>, // i32 [1] = {0}
    pub capacity: usize,
    pub tokens: usize,
    pub ctx: usize, // pos0 + tokens (host copy, sizes the decode grid)
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub q_stride: usize,
    pub scale: f32,
    pub window: Option<usize>,
    pub sinks: Option<DevPtr<f32>>, // f32 [num_heads]
}

impl AttnArgs {
    /// The general form: batch 1, one block of `capacity` tokens.
    pub fn paged(&self, head_dim: usize) -> PagedAttn {
        PagedAttn {
            q: self.q,
            k: self.k,
            v: self.v,
            out: self.out,
            cu_seqlens: self.cu_seqlens,
            ctx_lens: self.ctx_len,
            tables: self.table,
            max_blocks: 1,
            block_size: self.capacity,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            q_stride: self.q_stride,
            head_dim,
            batch: 1,
            max_q_len: self.tokens,
            max_ctx: self.ctx,
            scale: self.scale,
            window: self.window,
            sinks: self.sinks,
        }
    }
}

/// Flash-decoding scratch: `part_o` f32 `[batch, num_heads, max_splits, head_dim]`,
/// `part_ml` f32 `[batch, num_heads, max_splits, 2]`.
#[derive(Clone, Copy, Debug)]
pub struct DecodeScratch {
    pub part_o: DevPtr<f32>,
    pub part_ml: DevPtr<f32>,
    pub split_len: usize,
    pub max_splits: usize,
}

/// attention_prefill.cu `attn_prefill_hd{64,96,128,256}(q, k_cache, v_cache, out,
/// cu_seqlens_q, context_lens, block_tables, max_blocks, block_size, num_heads,
/// num_kv_heads, q_stride, window, scale, sinks)`: causal flash attention; grid
/// (⌈max_q_len / BQ⌉, num_heads, batch) with BQ `prefill_queries_per_block`, 128 threads
/// (blocks past a sequence's queries return at once).
pub fn attn_prefill(a: &PagedAttn) -> Launch {
    let mut args = a.qkv().to_vec();
    args.extend([
        arg(a.out),
        arg(a.cu_seqlens),
        arg(a.ctx_lens),
        arg(a.tables),
    ]);
    args.extend(a.shape());
    args.extend(a.mask());
    args.push(opt(a.sinks));
    let bq = prefill_queries_per_block(a.head_dim) as u32;
    let cfg = LaunchConfig {
        grid_dim: (
            (a.max_q_len as u32).div_ceil(bq),
            a.num_heads as u32,
            a.batch as u32,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let func = format!("attn_prefill_hd{}", a.head_dim);
    launch("attention_prefill.cu", &func, cfg, args)
}

/// attention_decode.cu: `attn_decode_hd{64,96,128,256}(q, k_cache, v_cache, part_o,
/// part_ml, context_lens, block_tables, max_blocks, block_size, num_heads, num_kv_heads,
/// q_stride, split_len, max_splits, window, scale)`, one query per sequence split over
/// `split_len` keys per block, grid (num_heads, ⌈max_ctx / split_len⌉, batch); then
/// `attn_decode_reduce(part_o, part_ml, out, context_lens, num_heads, head_dim, split_len,
/// max_splits, window, sinks)` merging the splits (and the sinks), grid (num_heads, batch).
/// Both 128 threads.
/// Partials are laid out with stride `max_splits`; only the splits the longest context
/// needs are launched (a window's: those before it return at once and are not merged).
pub fn attn_decode(a: &PagedAttn, s: &DecodeScratch) -> Result<[Launch; 2]> {
    let splits = a.max_ctx.div_ceil(s.split_len);
    if splits > s.max_splits {
        bail!(
            "decode attention: {} keys need {splits} splits, scratch holds {}",
            a.max_ctx,
            s.max_splits
        );
    }
    let mut args = a.qkv().to_vec();
    args.extend([
        arg(s.part_o),
        arg(s.part_ml),
        arg(a.ctx_lens),
        arg(a.tables),
    ]);
    args.extend(a.shape());
    args.extend([i(s.split_len), i(s.max_splits)]);
    args.extend(a.mask());
    let block = (128, 1, 1);
    let cfg = LaunchConfig {
        grid_dim: (a.num_heads as u32, splits as u32, a.batch as u32),
        block_dim: block,
        shared_mem_bytes: 0,
    };
    let func = format!("attn_decode_hd{}", a.head_dim);
    let reduce_args = vec![
        arg(s.part_o),
        arg(s.part_ml),
        arg(a.out),
        arg(a.ctx_lens),
        i(a.num_heads),
        i(a.head_dim),
        i(s.split_len),
        i(s.max_splits),
        i(a.window.unwrap_or(0)),
        opt(a.sinks),
    ];
    let reduce_cfg = LaunchConfig {
        grid_dim: (a.num_heads as u32, a.batch as u32, 1),
        block_dim: block,
        shared_mem_bytes: 0,
    };
    Ok([
        launch("attention_decode.cu", &func, cfg, args),
        launch(
            "attention_decode.cu",
            "attn_decode_reduce",
            reduce_cfg,
            reduce_args,
        ),
    ])
}

/// The kernels of `KERNELS` on one GPU, by name: compiled (or read from the CUBIN cache)
/// and loaded on first launch, so a file that fails to compile fails only its own
/// launches (each of gpu-check step 1's rows on its own).
pub struct Kernels {
    dev: Arc<CudaDevice>,
    loaded: Mutex<HashMap<String, CudaFunction>>, // by function name (unique across files)
}

impl Kernels {
    pub fn new(dev: Arc<CudaDevice>) -> Self {
        Self {
            dev,
            loaded: Mutex::new(HashMap::new()),
        }
    }

    /// `func` of `kernels/<file>`, which must be listed in `KERNELS`.
    pub fn function(&self, file: &str, func: &str) -> Result<CudaFunction> {
        if !is_listed(file, func) {
            bail!("kernel {func} of {file} is not listed in ops::KERNELS");
        }
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = loaded.get(func) {
            return Ok(f.clone());
        }
        let f = self.dev.function(file, func)?;
        loaded.insert(func.to_string(), f.clone());
        Ok(f)
    }

    /// Enqueues `l` on `st`.
    pub fn launch(&self, st: &CudaStream, l: &Launch) -> Result<()> {
        let f = self.function(l.file, &l.func)?;
        let mut b = st.launch_builder(&f);
        // References into `l.args`, which outlives the builder.
        for a in &l.args {
            match a {
                KArg::Ptr(p) => b.arg(p),
                KArg::I32(v) => b.arg(v),
                KArg::F32(v) => b.arg(v),
            };
        }
        // SAFETY: the builders above push each kernel's arguments with its C signature's
        // types and order; the addresses and sizes are the caller's, as for any launch.
        unsafe { b.launch(l.cfg) }
            .map_err(|e| anyhow!("launching {} ({}) failed: {e:?}", l.func, l.file))?;
        Ok(())
    }
}

/// A GEMM's shape: `out[m, n] = x[m, k] · w[n, k]ᵀ` (`m` rows of activations, `n`
/// output features, `k` the reduced dimension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// Where a GEMM writes, in which type: activations stay bf16, logits are f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GemmOut {
    Bf16(DevPtr<bf16>),
    F32(DevPtr<f32>),
}

impl GemmOut {
    /// `i` elements on.
    pub fn at(self, i: usize) -> Self {
        match self {
            GemmOut::Bf16(p) => GemmOut::Bf16(p.at(i)),
            GemmOut::F32(p) => GemmOut::F32(p.at(i)),
        }
    }

    pub fn addr(self) -> u64 {
        match self {
            GemmOut::Bf16(p) => p.addr(),
            GemmOut::F32(p) => p.addr(),
        }
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` (bf16 in, f32 accumulate), on the handle's stream.
/// Row-major `out` is column-major `outᵀ`, so cuBLAS computes `outᵀ[n, m] = W · xᵀ` with
/// W transposed from its `[n, k]` storage.
pub fn gemm(
    blas: &CudaBlas,
    x: DevPtr<bf16>,
    w: DevPtr<bf16>,
    out: GemmOut,
    s: GemmShape,
) -> Result<()> {
    let out_type = match out {
        GemmOut::F32(_) => cublas::sys::cudaDataType::CUDA_R_32F,
        GemmOut::Bf16(_) => cublas::sys::cudaDataType::CUDA_R_16BF,
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    let GemmShape { m, k, n } = s;
    // SAFETY: the caller passes live allocations of [m, k], [n, k] and [m, n].
    unsafe {
        cublas::result::gemm_ex(
            *blas.handle(),
            cublas::sys::cublasOperation_t::CUBLAS_OP_T,
            cublas::sys::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            m as i32,
            k as i32,
            &alpha as *const f32 as *const _,
            w.addr() as *const _,
            cublas::sys::cudaDataType::CUDA_R_16BF,
            k as i32,
            x.addr() as *const _,
            cublas::sys::cudaDataType::CUDA_R_16BF,
            k as i32,
            &beta as *const f32 as *const _,
            out.addr() as *mut _,
            out_type,
            n as i32,
            cublas::sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| anyhow!("cublasGemmEx [{m}, {k}]·[{n}, {k}]ᵀ failed: {e:?}"))
}

/// gemm.cu `gemm_fixed_bm{4,16,64}(x, w, out, m, k, n, out_f32)`: `out[m, n] = x[m, k] ·
/// w[n, k]ᵀ` with every output one thread's sequential f32 `fmaf` over `k` in order, so a
/// row's result never depends on `m` (the batch-invariant GEMM of the serving path; cuBLAS
/// is not). The tile height follows `m` to waste little on decode batches; it picks which
/// thread computes an output, never its arithmetic. Grid (⌈n / 64⌉, ⌈m / BM⌉), 256 threads.
pub fn gemm_fixed(
    x: DevPtr<bf16>, // bf16 [m, k]
    w: DevPtr<bf16>, // bf16 [n, k]
    out: GemmOut,    // [m, n]
    s: GemmShape,
) -> Launch {
    let GemmShape { m, k, n } = s;
    let bm = match m {
        0..=4 => 4,
        5..=16 => 16,
        _ => 64,
    };
    let out_f32 = matches!(out, GemmOut::F32(_));
    let args = vec![
        arg(x),
        arg(w),
        KArg::Ptr(out.addr()),
        i(m),
        i(k),
        i(n),
        i(out_f32 as usize),
    ];
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(64) as u32, m.div_ceil(bm).max(1) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch("gemm.cu", &format!("gemm_fixed_bm{bm}"), cfg, args)
}

/// Device memory in use (total − free), for the offload memory comparison.
pub fn mem_used() -> Result<usize> {
    let (free, total) = drv("cuMemGetInfo", result::mem_get_info())?;
    Ok(total - free)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cuda::nvrtc::SOURCES;

    /// The `extern "C" __global__` functions of one `.cu` source; a name built with
    /// `##HD` inside `INSTANTIATE(HD, ...)` is expanded for each `INSTANTIATE(<n>, ...)`
    /// line (the head dim is the first argument).
    fn global_functions(src: &str) -> Vec<String> {
        let instantiations: Vec<&str> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("INSTANTIATE(")?.strip_suffix(')'))
            .filter_map(|args| args.split(',').next())
            .filter(|n| n.chars().all(|c| c.is_ascii_digit()))
            .collect();
        let mut names = Vec::new();
        for (at, _) in src.match_indices("extern \"C\" __global__ void") {
            let mut rest = src[at..]
                .trim_start_matches("extern \"C\" __global__ void")
                .trim_start();
            if let Some(r) = rest.strip_prefix("__launch_bounds__(") {
                rest = r[r.find(')').expect("launch bounds closed") + 1..].trim_start();
            }
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '#')
                .collect();
            match name.split_once("##") {
                Some((prefix, _)) => {
                    assert!(
                        !instantiations.is_empty(),
                        "{name}: no INSTANTIATE(<n>) lines"
                    );
                    names.extend(instantiations.iter().map(|n| format!("{prefix}{n}")));
                }
                None => names.push(name),
            }
        }
        names
    }

    #[test]
    fn kernels_lists_every_global_function() {
        let mut files: Vec<&str> = KERNELS.iter().map(|(f, _)| *f).collect();
        files.sort();
        files.dedup();
        assert_eq!(files.len(), KERNELS.len(), "a file listed twice");
        for (file, src) in SOURCES {
            let mut want = global_functions(src);
            want.sort();
            let listed = KERNELS.iter().find(|(f, _)| f == file);
            let mut got: Vec<String> = listed
                .map(|(_, fns)| fns.iter().map(|s| s.to_string()).collect())
                .unwrap_or_default();
            got.sort();
            assert_eq!(got, want, "KERNELS entry of {file}");
        }
        for (file, _) in KERNELS {
            assert!(
                SOURCES.iter().any(|(f, _)| f == file),
                "{file} is not embedded"
            );
        }
        // The parser itself: both attention files expand their instantiations.
        let decode = SOURCES
            .iter()
            .find(|(f, _)| *f == "attention_decode.cu")
            .unwrap();
        assert!(global_functions(decode.1).contains(&"attn_decode_hd128".to_string()));
    }

    #[test]
    fn every_builder_launches_a_listed_kernel() {
        // Distinct, recognisable addresses.
        fn p<T>(n: u64) -> DevPtr<T> {
            DevPtr::from_addr(n << 12)
        }
        let mut launches = vec![
            embedding(p(1), p(2), p(3), 7, 100, 64, 1.0),
            rms_norm(p(1), p(2), p(3), 5, 64, 1e-6),
            add_rms_norm(p(1), p(2), None, p(3), p(4), 5, 64, 1e-6),
            add_rms_norm(p(1), p(2), Some(p(3)), p(4), p(5), 5, 64, 1e-6),
            head_rms_norm(p(1), p(2), 5, 4, 64, 384, 1e-6),
            rope(p(1), p(2), p(3), p(4), 5, 6, (64, 16), 384),
            gated_mul(MlpAct::Silu, p(1), p(2), 5, 96),
            gated_mul(MlpAct::GeluTanh, p(1), p(2), 5, 96),
            kv_store(p(1), p(2), p(3), p(4), p(5), 5, 128, 384, None),
            argmax(p(1), p(2), 2, 1000),
            sample(p(1), p(2), p(3), 2, 1000, 0.7, 50, 0.9),
        ];
        launches.push(add_bias(p(1), p(2), 5, 96));
        let scratch = DecodeScratch {
            part_o: p(8),
            part_ml: p(9),
            split_len: 512,
            max_splits: 4,
        };
        for hd in HEAD_DIMS {
            let a = AttnArgs {
                q: p(1),
                k: p(2),
                v: p(3),
                out: p(4),
                cu_seqlens: p(5),
                ctx_len: p(6),
                table: p(7),
                capacity: 2048,
                tokens: 1,
                ctx: 1500,
                num_heads: 8,
                num_kv_heads: 2,
                q_stride: 12 * hd,
                scale: 0.125,
                window: None,
                sinks: Some(p(9)),
            }
            .paged(hd);
            launches.push(attn_prefill(&a));
            launches.extend(attn_decode(&a, &scratch).unwrap());
        }
        let s = DeltaShape {
            k_heads: 2,
            v_heads: 4,
            dk: 16,
            dv: 32,
            kernel: 4,
            value_heads: ValueHeadOrder::Tiled,
        };
        launches.extend([
            sigmoid_gate(p(1), p(2), 5, 256, 640),
            delta_conv(p(1), p(2), p(3), p(4), 5, 400, s),
            delta_rule(p(1), p(2), p(3), p(4), p(5), p(6), 5, 8, s),
            delta_gated_norm(p(1), p(2), p(3), p(4), 5, 400, s, 1e-6),
            moe_route(p(1), Some(p(2)), p(3), p(4), 5, 16, 4),
            moe_matvec(p(1), p(2), p(3), None, p(4), 20, 64, 32, 4),
            moe_combine(p(1), p(2), Some((p(3), p(4))), p(5), 5, 4, 32),
        ]);
        for l in &launches {
            assert!(is_listed(l.file, &l.func), "{} of {}", l.func, l.file);
        }
        // Three splits of 512 for 1,500 keys; too many for the scratch is an error.
        assert_eq!(launches[13].func, "attn_decode_hd64");
        assert_eq!(launches[13].cfg.grid_dim, (8, 3, 1));
        let mut long = AttnArgs {
            q: DevPtr::from_addr(0),
            k: DevPtr::from_addr(0),
            v: DevPtr::from_addr(0),
            out: DevPtr::from_addr(0),
            cu_seqlens: DevPtr::from_addr(0),
            ctx_len: DevPtr::from_addr(0),
            table: DevPtr::from_addr(0),
            capacity: 4096,
            tokens: 1,
            ctx: 2049,
            num_heads: 8,
            num_kv_heads: 2,
            q_stride: 768,
            scale: 0.125,
            window: None,
            sinks: None,
        };
        assert!(attn_decode(&long.paged(64), &scratch).is_err());
        long.ctx = 2048;
        assert!(attn_decode(&long.paged(64), &scratch).is_ok());
        assert!(check_head_dim(80).is_err() && check_head_dim(96).is_ok());
        assert!(check_head_dim(256).is_ok() && check_head_dim(512).is_err());
    }

    /// The contiguous form is the paged one with one block of `capacity` tokens, the
    /// prefill grid covers its queries in tiles of 16 (8 at head_dim 256), and the window,
    /// scale and sinks are the last arguments.
    #[test]
    fn contiguous_attention_is_one_block() {
        let a = AttnArgs {
            q: DevPtr::from_addr(1),
            k: DevPtr::from_addr(2),
            v: DevPtr::from_addr(3),
            out: DevPtr::from_addr(4),
            cu_seqlens: DevPtr::from_addr(5),
            ctx_len: DevPtr::from_addr(6),
            table: DevPtr::from_addr(7),
            capacity: 300,
            tokens: 33,
            ctx: 40,
            num_heads: 9,
            num_kv_heads: 3,
            q_stride: 960,
            scale: 0.0625,
            window: Some(512),
            sinks: None,
        };
        let l = attn_prefill(&a.paged(64));
        assert_eq!(l.func, "attn_prefill_hd64");
        assert_eq!(l.cfg.grid_dim, (3, 9, 1));
        assert_eq!(l.cfg.block_dim, (128, 1, 1));
        let want = [1, 2, 3, 4, 5, 6, 7].map(KArg::Ptr).to_vec();
        let want: Vec<KArg> = want
            .into_iter()
            .chain([1, 300, 9, 3, 960, 512].map(KArg::I32))
            .chain([F32(0.0625), KArg::Ptr(0)]) // scale, no sinks
            .collect();
        assert_eq!(l.args, want);
        assert_eq!(attn_prefill(&a.paged(256)).cfg.grid_dim, (5, 9, 1));
    }
}
