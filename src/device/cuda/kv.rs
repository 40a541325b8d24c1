//! The CUDA side of the KV seam. Same protocol as `crate::kv::KvView`
//! (`begin_step → [begin_layer → layer kernels → end_layer]*`), but the layer's work is
//! not a closure: the model enqueues kernels on the shared compute stream between
//! `begin_layer`, which queues the waits (and copies) that make the layer's KV valid and
//! returns where it lives, and `end_layer`, which records the events and queues what
//! follows (offload, next prefetch). The host never blocks inside a step.

use super::context::CudaDevice;
use super::ops::{dptr, DPtr};
use anyhow::{bail, Result};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// Where one layer's K and V live while it computes: bf16 `[capacity, kv_dim]` each,
/// positions `0..pos0 + tokens` valid once the layer's kv_store has run.
#[derive(Clone, Copy, Debug)]
pub struct LayerSlot {
    pub k: DPtr,
    pub v: DPtr,
    pub capacity: usize,
}

pub trait CudaKv {
    /// Forgets the previous request (before each prefill).
    fn reset(&mut self) -> Result<()>;
    /// Tokens one request may hold.
    fn capacity(&self) -> usize;
    fn begin_step(&mut self, pos0: usize, tokens: usize) -> Result<()>;
    /// Queues on the compute stream what makes `layer`'s KV usable; returns where it is.
    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot>;
    /// The layer's kernels are queued: record, offload, prefetch ahead.
    fn end_layer(&mut self, layer: usize) -> Result<()>;
}

/// Every layer's KV resident on the device: `num_layers × [capacity, kv_dim]` bf16 for K
/// and V, allocated up front. Same stream as the model, so nothing to wait for.
pub struct ResidentKv {
    capacity: usize,
    k: Vec<CudaSlice<u16>>, // [num_layers][capacity * kv_dim]
    v: Vec<CudaSlice<u16>>,
    compute: Arc<CudaStream>,
}

impl ResidentKv {
    pub fn new(
        dev: &CudaDevice,
        compute: &Arc<CudaStream>,
        num_layers: usize,
        kv_dim: usize,
        capacity: usize,
    ) -> Result<Self> {
        let alloc = |_| dev.alloc_zeros::<u16>(compute, capacity * kv_dim);
        Ok(Self {
            capacity,
            k: (0..num_layers).map(alloc).collect::<Result<_>>()?,
            v: (0..num_layers).map(alloc).collect::<Result<_>>()?,
            compute: compute.clone(),
        })
    }

    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|b| b.len() * 2).sum()
    }
}

impl CudaKv for ResidentKv {
    fn reset(&mut self) -> Result<()> {
        Ok(())
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn begin_step(&mut self, pos0: usize, tokens: usize) -> Result<()> {
        if pos0 + tokens > self.capacity {
            bail!(
                "KV cache full: {} tokens needed, room for {}",
                pos0 + tokens,
                self.capacity
            );
        }
        Ok(())
    }

    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot> {
        Ok(LayerSlot {
            k: dptr(&self.k[layer], &self.compute),
            v: dptr(&self.v[layer], &self.compute),
            capacity: self.capacity,
        })
    }

    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }
}
