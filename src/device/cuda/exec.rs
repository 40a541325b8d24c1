//! What the CUDA model needs from a device: memory, copies on its stream, and the kernels,
//! all on addresses (`DPtr`). `CudaExec` is the GPU; `hosttwin::HostExec` runs the same
//! calls on host memory with the kernels' semantics, so the model's orchestration (buffer
//! offsets, strides, step metadata, chunking) is tested on machines without a GPU.

use super::context::CudaDevice;
use super::ops::{self, AttnArgs, DPtr, DecodeScratch, Kernels};
use anyhow::{anyhow, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// An allocation owned by an `Exec`; its address stays fixed while it lives.
pub enum Buf {
    Cuda(CudaSlice<u8>),
    /// u128: 16-byte alignment, as the kernels' vector loads expect.
    Host(Vec<u128>),
}

#[allow(clippy::too_many_arguments)]
pub trait Exec {
    /// Zeroed memory of `bytes`, and its address.
    fn alloc(&self, bytes: usize) -> Result<(Buf, DPtr)>;
    fn upload(&self, data: &[u8]) -> Result<(Buf, DPtr)>;
    /// Queues `src` → `dst` on the stream (`src` may be dropped on return).
    ///
    /// # Safety
    /// `dst` must hold `src.len()` bytes.
    unsafe fn htod(&self, dst: DPtr, src: &[u8]) -> Result<()>;
    /// Waits for the stream, then copies `src` → `dst`.
    ///
    /// # Safety
    /// `src` must hold `dst.len()` bytes.
    unsafe fn download(&self, src: DPtr, dst: &mut [u8]) -> Result<()>;
    fn sync(&self) -> Result<()>;

    fn embedding(
        &self,
        table: DPtr,
        ids: DPtr,
        out: DPtr,
        tokens: usize,
        vocab: usize,
        dim: usize,
    ) -> Result<()>;
    fn rms_norm(
        &self,
        x: DPtr,
        w: DPtr,
        out: DPtr,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()>;
    fn add_rms_norm(
        &self,
        x: DPtr,
        delta: DPtr,
        w: DPtr,
        out: DPtr,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()>;
    fn head_rms_norm(
        &self,
        x: DPtr,
        w: DPtr,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        stride: usize,
        eps: f32,
    ) -> Result<()>;
    fn rope(
        &self,
        x: DPtr,
        pos: DPtr,
        cos: DPtr,
        sin: DPtr,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        stride: usize,
    ) -> Result<()>;
    fn silu_mul(&self, gu: DPtr, out: DPtr, tokens: usize, inter: usize) -> Result<()>;
    fn kv_store(
        &self,
        k: DPtr,
        v: DPtr,
        k_cache: DPtr,
        v_cache: DPtr,
        slots: DPtr,
        tokens: usize,
        kv_dim: usize,
        stride: usize,
    ) -> Result<()>;
    fn attn_prefill(&self, a: &AttnArgs, head_dim: usize) -> Result<()>;
    fn attn_decode(&self, a: &AttnArgs, s: &DecodeScratch, head_dim: usize) -> Result<()>;
    /// `out[m, n] = x[m, k] · w[n, k]ᵀ`, bf16 in, f32 accumulate, out bf16 or f32.
    fn gemm(
        &self,
        x: DPtr,
        w: DPtr,
        out: DPtr,
        m: usize,
        k: usize,
        n: usize,
        out_f32: bool,
    ) -> Result<()>;
}

/// The GPU: one stream (the model's compute stream), its kernels and a cuBLAS handle.
pub struct CudaExec {
    dev: Arc<CudaDevice>,
    st: Arc<CudaStream>,
    k: Kernels,
    blas: CudaBlas,
}

impl CudaExec {
    pub fn new(dev: Arc<CudaDevice>, st: Arc<CudaStream>, head_dim: usize) -> Result<Self> {
        Ok(Self {
            k: Kernels::load(&dev, head_dim)?,
            blas: dev.blas(&st)?,
            dev,
            st,
        })
    }
}

impl Exec for CudaExec {
    fn alloc(&self, bytes: usize) -> Result<(Buf, DPtr)> {
        let b = self.dev.alloc_zeros::<u8>(&self.st, bytes.max(1))?;
        let p = ops::dptr(&b, &self.st);
        Ok((Buf::Cuda(b), p))
    }

    fn upload(&self, data: &[u8]) -> Result<(Buf, DPtr)> {
        let b = super::context::upload(&self.st, data)?;
        let p = ops::dptr(&b, &self.st);
        Ok((Buf::Cuda(b), p))
    }

    unsafe fn htod(&self, dst: DPtr, src: &[u8]) -> Result<()> {
        // Pageable source: the driver stages it before returning.
        ops::htod(&self.st, dst, src.as_ptr(), src.len())
    }

    unsafe fn download(&self, src: DPtr, dst: &mut [u8]) -> Result<()> {
        ops::dtoh(&self.st, dst.as_mut_ptr(), src, dst.len())?;
        self.sync()
    }

    fn sync(&self) -> Result<()> {
        self.st
            .synchronize()
            .map_err(|e| anyhow!("cuStreamSynchronize failed: {e:?}"))
    }

    fn embedding(
        &self,
        table: DPtr,
        ids: DPtr,
        out: DPtr,
        tokens: usize,
        vocab: usize,
        dim: usize,
    ) -> Result<()> {
        self.k
            .embedding(&self.st, table, ids, out, tokens, vocab, dim)
    }

    fn rms_norm(
        &self,
        x: DPtr,
        w: DPtr,
        out: DPtr,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        self.k.rms_norm(&self.st, x, w, out, rows, dim, eps)
    }

    fn add_rms_norm(
        &self,
        x: DPtr,
        delta: DPtr,
        w: DPtr,
        out: DPtr,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        self.k
            .add_rms_norm(&self.st, x, delta, w, out, rows, dim, eps)
    }

    fn head_rms_norm(
        &self,
        x: DPtr,
        w: DPtr,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        stride: usize,
        eps: f32,
    ) -> Result<()> {
        self.k
            .head_rms_norm(&self.st, x, w, tokens, heads, head_dim, stride, eps)
    }

    fn rope(
        &self,
        x: DPtr,
        pos: DPtr,
        cos: DPtr,
        sin: DPtr,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        stride: usize,
    ) -> Result<()> {
        self.k
            .rope(&self.st, x, pos, cos, sin, tokens, heads, head_dim, stride)
    }

    fn silu_mul(&self, gu: DPtr, out: DPtr, tokens: usize, inter: usize) -> Result<()> {
        self.k.silu_mul(&self.st, gu, out, tokens, inter)
    }

    fn kv_store(
        &self,
        k: DPtr,
        v: DPtr,
        k_cache: DPtr,
        v_cache: DPtr,
        slots: DPtr,
        tokens: usize,
        kv_dim: usize,
        stride: usize,
    ) -> Result<()> {
        self.k.kv_store(
            &self.st, k, v, k_cache, v_cache, slots, tokens, kv_dim, stride,
        )
    }

    fn attn_prefill(&self, a: &AttnArgs, head_dim: usize) -> Result<()> {
        self.k.attn_prefill(&self.st, a, head_dim)
    }

    fn attn_decode(&self, a: &AttnArgs, s: &DecodeScratch, head_dim: usize) -> Result<()> {
        self.k.attn_decode(&self.st, a, s, head_dim)
    }

    fn gemm(
        &self,
        x: DPtr,
        w: DPtr,
        out: DPtr,
        m: usize,
        k: usize,
        n: usize,
        out_f32: bool,
    ) -> Result<()> {
        ops::gemm(&self.blas, x, w, out, m, k, n, out_f32)
    }
}
