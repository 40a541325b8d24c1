//! What the CUDA model needs from a device: memory, copies on its stream, kernel launches
//! and the GEMM, on typed device addresses (`DevPtr<T>`). The model builds each launch
//! with its `ops` builder and hands the value to `launch`, so every backend that runs
//! launches (`CudaExec`, the GPU; a CPU emulator of the `.cu` sources,
//! `crate::gpucheck::emu::EmuExec`) runs the same ones: the model's orchestration (buffer
//! offsets, strides, step metadata, chunking) and the kernels themselves are tested on
//! machines without a GPU.

use super::context::CudaDevice;
use super::ops::{self, GemmOut, GemmShape, Kernels, Launch};
use crate::device::DevPtr;
use anyhow::{anyhow, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use std::sync::Arc;

/// An allocation owned by an `Exec`; its address stays fixed while it lives.
pub enum Buf {
    Cuda(CudaSlice<u8>),
    /// u128: 16-byte alignment, as the kernels' vector loads expect.
    Host(Vec<u128>),
    /// Memory owned by another backend (e.g. the kernel emulator's guarded pages), kept
    /// alive for as long as the `Buf` is.
    Other(Box<dyn std::any::Any + Send + Sync>),
}

/// Typed allocation helpers over `Exec`'s byte-level memory.
pub fn alloc<T>(exec: &dyn Exec, elems: usize) -> Result<(Buf, DevPtr<T>)> {
    let (b, p) = exec.alloc(elems * std::mem::size_of::<T>())?;
    Ok((b, p.cast()))
}

/// A device buffer that only grows, for per-step data whose size varies (batch metadata,
/// scratch, logits): reallocated, after a sync, when a step needs more.
pub struct GrowBuf<T> {
    cur: Option<(Buf, DevPtr<T>, usize)>, // (allocation, address, elements)
}

impl<T> Default for GrowBuf<T> {
    fn default() -> Self {
        Self { cur: None }
    }
}

impl<T> GrowBuf<T> {
    /// Room for `elems` elements (at least one), and where it is.
    pub fn ensure(&mut self, exec: &dyn Exec, elems: usize) -> Result<DevPtr<T>> {
        match &self.cur {
            Some((_, p, cap)) if *cap >= elems => Ok(*p),
            _ => {
                exec.sync()?; // nothing queued may still use the old buffer
                self.cur = None;
                let n = elems.max(1).next_power_of_two();
                let (b, p) = alloc::<T>(exec, n)?;
                self.cur = Some((b, p, n));
                Ok(p)
            }
        }
    }
}

pub trait Exec: Send + Sync {
    /// Zeroed memory of `bytes`, and its address.
    fn alloc(&self, bytes: usize) -> Result<(Buf, DevPtr<u8>)>;
    fn upload(&self, data: &[u8]) -> Result<(Buf, DevPtr<u8>)>;
    /// Queues `src` → `dst` on the stream (`src` may be dropped on return).
    ///
    /// # Safety
    /// `dst` must hold `src.len()` bytes.
    unsafe fn htod(&self, dst: DevPtr<u8>, src: &[u8]) -> Result<()>;
    /// Waits for the stream, then copies `src` → `dst`.
    ///
    /// # Safety
    /// `src` must hold `dst.len()` bytes.
    unsafe fn download(&self, src: DevPtr<u8>, dst: &mut [u8]) -> Result<()>;
    /// Queues a zero fill of `bytes` at `dst` on the stream. Default: copies of a zero
    /// buffer (at most 1 MiB at a time).
    ///
    /// # Safety
    /// `dst` must hold `bytes` bytes.
    unsafe fn zero(&self, dst: DevPtr<u8>, bytes: usize) -> Result<()> {
        const CHUNK: usize = 1 << 20;
        let zeros = vec![0u8; bytes.min(CHUNK)];
        for at in (0..bytes).step_by(CHUNK) {
            self.htod(dst.at(at), &zeros[..CHUNK.min(bytes - at)])?;
        }
        Ok(())
    }
    fn sync(&self) -> Result<()>;

    /// Queues one kernel launch on the stream. The addresses in `l.args` must be live
    /// allocations of the sizes the kernel reads and writes, as for any launch.
    fn launch(&self, l: &Launch) -> Result<()>;

    /// `out[m, n] = x[m, k] · w[n, k]ᵀ`, bf16 in, f32 accumulate, out bf16 or f32.
    fn gemm(&self, x: DevPtr<bf16>, w: DevPtr<bf16>, out: GemmOut, s: GemmShape) -> Result<()>;
}

/// The GPU: one stream (the model's compute stream), its kernels and a cuBLAS handle.
pub struct CudaExec {
    dev: Arc<CudaDevice>,
    st: Arc<CudaStream>,
    k: Kernels,
    blas: CudaBlas,
}

impl CudaExec {
    pub fn new(dev: Arc<CudaDevice>, st: Arc<CudaStream>) -> Result<Self> {
        Ok(Self {
            k: Kernels::new(dev.clone()),
            blas: dev.blas(&st)?,
            dev,
            st,
        })
    }
}

impl Exec for CudaExec {
    fn alloc(&self, bytes: usize) -> Result<(Buf, DevPtr<u8>)> {
        let b = self.dev.alloc_zeros::<u8>(&self.st, bytes.max(1))?;
        let p = ops::dptr(&b, &self.st);
        Ok((Buf::Cuda(b), p))
    }

    fn upload(&self, data: &[u8]) -> Result<(Buf, DevPtr<u8>)> {
        let b = super::context::upload(&self.st, data)?;
        let p = ops::dptr(&b, &self.st);
        Ok((Buf::Cuda(b), p))
    }

    unsafe fn htod(&self, dst: DevPtr<u8>, src: &[u8]) -> Result<()> {
        // Pageable source: the driver stages it before returning.
        ops::htod(&self.st, dst, src.as_ptr(), src.len())
    }

    unsafe fn download(&self, src: DevPtr<u8>, dst: &mut [u8]) -> Result<()> {
        ops::dtoh(&self.st, dst.as_mut_ptr(), src, dst.len())?;
        self.sync()
    }

    unsafe fn zero(&self, dst: DevPtr<u8>, bytes: usize) -> Result<()> {
        ops::fill(&self.st, dst, 0, bytes)
    }

    fn sync(&self) -> Result<()> {
        self.st
            .synchronize()
            .map_err(|e| anyhow!("cuStreamSynchronize failed: {e:?}"))
    }

    fn launch(&self, l: &Launch) -> Result<()> {
        self.k.launch(&self.st, l)
    }

    fn gemm(&self, x: DevPtr<bf16>, w: DevPtr<bf16>, out: GemmOut, s: GemmShape) -> Result<()> {
        ops::gemm(&self.blas, x, w, out, s)
    }
}
