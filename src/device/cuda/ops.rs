//! Launch wrappers for `kernels/*.cu` and raw asynchronous copies, on device pointers.
//!
//! Everything here takes raw `CUdeviceptr`s (`u64`) rather than `CudaSlice` views: the
//! model and the offload engine address sub-ranges of ring slots and fused buffers by
//! offset, and cudarc's safe copies from a `PinnedHostSlice` wait on and record that
//! slice's own event, which would silently serialise the prefetch and offload streams
//! that share the host KV. Event tracking is off (`CudaDevice::new`), so the pointer
//! getters below add no waits either. Every argument list mirrors its kernel's signature;
//! the `.cu` file is named beside each launch.

use super::context::CudaDevice;
use anyhow::{anyhow, bail, Result};
use cudarc::cublas::{self, CudaBlas};
use cudarc::driver::{
    result, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// A device address (`CUdeviceptr`).
pub type DPtr = u64;

/// The address of `s[0]`. With event tracking off the returned guard records nothing.
pub fn dptr<T>(s: &CudaSlice<T>, st: &Arc<CudaStream>) -> DPtr {
    s.device_ptr(st).0
}

/// The address of element `i` of a `T` array at `p`.
pub fn at<T>(p: DPtr, i: usize) -> DPtr {
    p + (i * std::mem::size_of::<T>()) as u64
}

fn drv<T>(what: &str, r: Result<T, cudarc::driver::DriverError>) -> Result<T> {
    r.map_err(|e| anyhow!("{what} failed: {e:?}"))
}

/// `bytes` host → device on `st`. `src` must stay valid until the copy runs (pinned host
/// memory owned by the caller), or be pageable (staged by the driver before returning).
///
/// # Safety
/// `dst` must hold `bytes`; `src` must point to `bytes` readable bytes.
pub unsafe fn htod(st: &CudaStream, dst: DPtr, src: *const u8, bytes: usize) -> Result<()> {
    let s = std::slice::from_raw_parts(src, bytes);
    drv(
        "cuMemcpyHtoDAsync",
        result::memcpy_htod_async(dst, s, st.cu_stream()),
    )
}

/// # Safety
/// `src` must hold `bytes`; `dst` must point to `bytes` writable bytes that outlive the copy.
pub unsafe fn dtoh(st: &CudaStream, dst: *mut u8, src: DPtr, bytes: usize) -> Result<()> {
    let d = std::slice::from_raw_parts_mut(dst, bytes);
    drv(
        "cuMemcpyDtoHAsync",
        result::memcpy_dtoh_async(d, src, st.cu_stream()),
    )
}

/// # Safety
/// Both ranges must be live device memory of at least `bytes`.
pub unsafe fn dtod(st: &CudaStream, dst: DPtr, src: DPtr, bytes: usize) -> Result<()> {
    drv(
        "cuMemcpyDtoDAsync",
        result::memcpy_dtod_async(dst, src, bytes, st.cu_stream()),
    )
}

/// Fills `bytes` with 0xFF: every bf16 becomes 0xFFFF, a NaN (the sanitizer's poison).
///
/// # Safety
/// `dst` must hold `bytes`.
pub unsafe fn poison(st: &CudaStream, dst: DPtr, bytes: usize) -> Result<()> {
    drv(
        "cuMemsetD8Async",
        result::memset_d8_async(dst, 0xff, bytes, st.cu_stream()),
    )
}

/// Threads per block for the element-wise kernels.
const EW: u32 = 256;

fn grid1(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(block).max(1), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rows(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn i(n: usize) -> i32 {
    n as i32
}

/// Every kernel the model needs, loaded once.
pub struct Kernels {
    embedding: CudaFunction,
    rms_norm: CudaFunction,
    add_rms_norm: CudaFunction,
    head_rms_norm: CudaFunction,
    rope: CudaFunction,
    silu_mul: CudaFunction,
    kv_store: CudaFunction,
    prefill: CudaFunction,
    decode: CudaFunction,
    decode_reduce: CudaFunction,
}

/// Attention over one contiguous cache `[capacity, kv_heads, head_dim]` (a ring slot or
/// a resident layer): the kernels' block table with one block of `capacity` tokens.
#[derive(Clone, Copy, Debug)]
pub struct AttnArgs {
    pub q: DPtr,          // bf16 [tokens, q_stride]: q heads first (inside fused QKV)
    pub k: DPtr,          // bf16 [capacity, kv_dim]
    pub v: DPtr,          // bf16 [capacity, kv_dim]
    pub out: DPtr,        // bf16 [tokens, num_heads × head_dim]
    pub cu_seqlens: DPtr, // i32 [2] = {0, tokens}
    pub ctx_len: DPtr,    // i32 [1] = pos0 + tokens
    pub table: DPtr,      // i32 [1] = {0}
    pub capacity: usize,
    pub tokens: usize,
    pub ctx: usize, // pos0 + tokens (host copy, sizes the decode grid)
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub q_stride: usize,
}

/// Flash-decoding scratch: `part_o` f32 `[num_heads, max_splits, head_dim]`, `part_ml`
/// f32 `[num_heads, max_splits, 2]`.
#[derive(Clone, Copy, Debug)]
pub struct DecodeScratch {
    pub part_o: DPtr,
    pub part_ml: DPtr,
    pub split_len: usize,
    pub max_splits: usize,
}

impl Kernels {
    pub fn load(dev: &CudaDevice, head_dim: usize) -> Result<Self> {
        if head_dim != 64 && head_dim != 128 {
            bail!(
                "the CUDA attention kernels support head_dim 64 and 128, this model has {head_dim}"
            );
        }
        Ok(Self {
            embedding: dev.function("embedding.cu", "embedding_gather")?,
            rms_norm: dev.function("norm.cu", "rms_norm")?,
            add_rms_norm: dev.function("norm.cu", "add_rms_norm")?,
            head_rms_norm: dev.function("norm.cu", "head_rms_norm")?,
            rope: dev.function("rope.cu", "rope_neox")?,
            silu_mul: dev.function("activation.cu", "silu_mul")?,
            kv_store: dev.function("kv_store.cu", "kv_store")?,
            prefill: dev.function(
                "attention_prefill.cu",
                &format!("attn_prefill_hd{head_dim}"),
            )?,
            decode: dev.function("attention_decode.cu", &format!("attn_decode_hd{head_dim}"))?,
            decode_reduce: dev.function("attention_decode.cu", "attn_decode_reduce")?,
        })
    }

    /// embedding.cu: `out[t] = table[ids[t]]`.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding(
        &self,
        st: &Arc<CudaStream>,
        table: DPtr,
        ids: DPtr,
        out: DPtr,
        tokens: usize,
        vocab: usize,
        dim: usize,
    ) -> Result<()> {
        let (v, d) = (i(vocab), i(dim));
        // SAFETY: (table, ids, out, vocab, dim) as in embedding.cu; sizes from the caller.
        unsafe {
            st.launch_builder(&self.embedding)
                .arg(&table)
                .arg(&ids)
                .arg(&out)
                .arg(&v)
                .arg(&d)
                .launch(rows(tokens, EW))?;
        }
        Ok(())
    }

    /// norm.cu `rms_norm`: `out[r] = x[r] / rms(x[r]) * w`, one block per row.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        st: &Arc<CudaStream>,
        x: DPtr,
        w: DPtr,
        out: DPtr,
        n_rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        let d = i(dim);
        // SAFETY: (x, w, out, dim, eps) as in norm.cu.
        unsafe {
            st.launch_builder(&self.rms_norm)
                .arg(&x)
                .arg(&w)
                .arg(&out)
                .arg(&d)
                .arg(&eps)
                .launch(rows(n_rows, EW))?;
        }
        Ok(())
    }

    /// norm.cu `add_rms_norm`: `x += delta; out = rms_norm(x) * w`.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        st: &Arc<CudaStream>,
        x: DPtr,
        delta: DPtr,
        w: DPtr,
        out: DPtr,
        n_rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        let d = i(dim);
        // SAFETY: (x, delta, w, out, dim, eps) as in norm.cu.
        unsafe {
            st.launch_builder(&self.add_rms_norm)
                .arg(&x)
                .arg(&delta)
                .arg(&w)
                .arg(&out)
                .arg(&d)
                .arg(&eps)
                .launch(rows(n_rows, EW))?;
        }
        Ok(())
    }

    /// norm.cu `head_rms_norm`, in place on `heads` heads of each strided row.
    #[allow(clippy::too_many_arguments)]
    pub fn head_rms_norm(
        &self,
        st: &Arc<CudaStream>,
        x: DPtr,
        w: DPtr,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        row_stride: usize,
        eps: f32,
    ) -> Result<()> {
        let (t, h, d, s) = (i(tokens), i(heads), i(head_dim), i(row_stride));
        // SAFETY: (x, w, tokens, heads, head_dim, row_stride, eps) as in norm.cu; one
        // warp per (token, head), 4 warps per block.
        unsafe {
            st.launch_builder(&self.head_rms_norm)
                .arg(&x)
                .arg(&w)
                .arg(&t)
                .arg(&h)
                .arg(&d)
                .arg(&s)
                .arg(&eps)
                .launch(grid1(tokens * heads * 32, 128))?;
        }
        Ok(())
    }

    /// rope.cu `rope_neox` on `heads` adjacent heads (q then k in the fused QKV row).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        st: &Arc<CudaStream>,
        x: DPtr,
        pos: DPtr,
        cos: DPtr,
        sin: DPtr,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        row_stride: usize,
    ) -> Result<()> {
        let (t, h, d, s) = (i(tokens), i(heads), i(head_dim), i(row_stride));
        // SAFETY: (x, pos, cos, sin, tokens, heads, head_dim, row_stride) as in rope.cu.
        unsafe {
            st.launch_builder(&self.rope)
                .arg(&x)
                .arg(&pos)
                .arg(&cos)
                .arg(&sin)
                .arg(&t)
                .arg(&h)
                .arg(&d)
                .arg(&s)
                .launch(grid1(tokens * heads * (head_dim / 2), EW))?;
        }
        Ok(())
    }

    /// activation.cu `silu_mul`: `out[t, j] = silu(gu[t, j]) * gu[t, inter + j]`.
    pub fn silu_mul(
        &self,
        st: &Arc<CudaStream>,
        gu: DPtr,
        out: DPtr,
        tokens: usize,
        inter: usize,
    ) -> Result<()> {
        let (t, n) = (i(tokens), i(inter));
        // SAFETY: (gu, out, tokens, inter) as in activation.cu.
        unsafe {
            st.launch_builder(&self.silu_mul)
                .arg(&gu)
                .arg(&out)
                .arg(&t)
                .arg(&n)
                .launch(grid1(tokens * inter, EW))?;
        }
        Ok(())
    }

    /// kv_store.cu: rows `k[t]`, `v[t]` (strided inside fused QKV) to cache rows `slots[t]`.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        st: &Arc<CudaStream>,
        k: DPtr,
        v: DPtr,
        k_cache: DPtr,
        v_cache: DPtr,
        slots: DPtr,
        tokens: usize,
        kv_dim: usize,
        src_stride: usize,
    ) -> Result<()> {
        let (t, d, s) = (i(tokens), i(kv_dim), i(src_stride));
        // SAFETY: (k, v, k_cache, v_cache, slots, tokens, kv_dim, src_stride) as in kv_store.cu.
        unsafe {
            st.launch_builder(&self.kv_store)
                .arg(&k)
                .arg(&v)
                .arg(&k_cache)
                .arg(&v_cache)
                .arg(&slots)
                .arg(&t)
                .arg(&d)
                .arg(&s)
                .launch(grid1(tokens * kv_dim, EW))?;
        }
        Ok(())
    }

    /// attention_prefill.cu: causal flash attention of `tokens` queries at the end of a
    /// `ctx`-token context; grid (⌈tokens / 16⌉, num_heads, 1), 128 threads.
    pub fn attn_prefill(&self, st: &Arc<CudaStream>, a: &AttnArgs, head_dim: usize) -> Result<()> {
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (mb, bs, h, kvh, qs) = (
            1i32,
            i(a.capacity),
            i(a.num_heads),
            i(a.num_kv_heads),
            i(a.q_stride),
        );
        let cfg = LaunchConfig {
            grid_dim: ((a.tokens as u32).div_ceil(16), a.num_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: (q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
        // max_blocks, block_size, num_heads, num_kv_heads, q_stride, scale) as in the .cu.
        unsafe {
            st.launch_builder(&self.prefill)
                .arg(&a.q)
                .arg(&a.k)
                .arg(&a.v)
                .arg(&a.out)
                .arg(&a.cu_seqlens)
                .arg(&a.ctx_len)
                .arg(&a.table)
                .arg(&mb)
                .arg(&bs)
                .arg(&h)
                .arg(&kvh)
                .arg(&qs)
                .arg(&scale)
                .launch(cfg)?;
        }
        Ok(())
    }

    /// attention_decode.cu: one query, split-K over `split_len` keys per block, then the
    /// merge. Partials are laid out with stride `max_splits`; only ⌈ctx / split_len⌉
    /// splits are launched.
    pub fn attn_decode(
        &self,
        st: &Arc<CudaStream>,
        a: &AttnArgs,
        s: &DecodeScratch,
        head_dim: usize,
    ) -> Result<()> {
        let splits = a.ctx.div_ceil(s.split_len);
        if splits > s.max_splits {
            bail!(
                "decode attention: {} keys need {splits} splits, scratch holds {}",
                a.ctx,
                s.max_splits
            );
        }
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (mb, bs, h, kvh, qs, sl, ms, hd) = (
            1i32,
            i(a.capacity),
            i(a.num_heads),
            i(a.num_kv_heads),
            i(a.q_stride),
            i(s.split_len),
            i(s.max_splits),
            i(head_dim),
        );
        let cfg = LaunchConfig {
            grid_dim: (a.num_heads as u32, splits as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let cfg_r = LaunchConfig {
            grid_dim: (a.num_heads as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: (q, k_cache, v_cache, part_o, part_ml, context_lens, block_tables,
        // max_blocks, block_size, num_heads, num_kv_heads, q_stride, split_len, max_splits,
        // scale) and (part_o, part_ml, out, context_lens, num_heads, head_dim, split_len,
        // max_splits) as in attention_decode.cu.
        unsafe {
            st.launch_builder(&self.decode)
                .arg(&a.q)
                .arg(&a.k)
                .arg(&a.v)
                .arg(&s.part_o)
                .arg(&s.part_ml)
                .arg(&a.ctx_len)
                .arg(&a.table)
                .arg(&mb)
                .arg(&bs)
                .arg(&h)
                .arg(&kvh)
                .arg(&qs)
                .arg(&sl)
                .arg(&ms)
                .arg(&scale)
                .launch(cfg)?;
            st.launch_builder(&self.decode_reduce)
                .arg(&s.part_o)
                .arg(&s.part_ml)
                .arg(&a.out)
                .arg(&a.ctx_len)
                .arg(&h)
                .arg(&hd)
                .arg(&sl)
                .arg(&ms)
                .launch(cfg_r)?;
        }
        Ok(())
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` (bf16 in, f32 accumulate; `out` bf16, or f32 when
/// `out_f32`), on the handle's stream. Same transposition as `context::linear`.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    blas: &CudaBlas,
    x: DPtr,
    w: DPtr,
    out: DPtr,
    m: usize,
    k: usize,
    n: usize,
    out_f32: bool,
) -> Result<()> {
    let out_type = if out_f32 {
        cublas::sys::cudaDataType::CUDA_R_32F
    } else {
        cublas::sys::cudaDataType::CUDA_R_16BF
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
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
            w as *const _,
            cublas::sys::cudaDataType::CUDA_R_16BF,
            k as i32,
            x as *const _,
            cublas::sys::cudaDataType::CUDA_R_16BF,
            k as i32,
            &beta as *const f32 as *const _,
            out as *mut _,
            out_type,
            n as i32,
            cublas::sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| anyhow!("cublasGemmEx [{m}, {k}]·[{n}, {k}]ᵀ failed: {e:?}"))
}

/// Device memory in use (total − free), for the offload memory comparison.
pub fn mem_used() -> Result<usize> {
    let (free, total) = drv("cuMemGetInfo", result::mem_get_info())?;
    Ok(total - free)
}
