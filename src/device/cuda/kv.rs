//! The CUDA side of the KV seam. Same protocol as `crate::kv::KvView`
//! (`begin_step → [begin_layer → layer kernels → end_layer]*`), but the layer's work is
//! not a closure: the model enqueues kernels on the shared compute stream between
//! `begin_layer`, which queues the waits (and copies) that make the layer's KV valid and
//! returns where it lives, and `end_layer`, which records the events and queues what
//! follows (offload, next prefetch). The host never blocks inside a step.

use super::exec::{Buf, Exec};
use super::ops::DPtr;
use anyhow::{bail, Result};

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
    bytes: usize,
    _bufs: Vec<Buf>, // 2 × num_layers × bf16 [capacity, kv_dim]
    k: Vec<DPtr>,    // [num_layers]
    v: Vec<DPtr>,
}

impl ResidentKv {
    /// On `x`'s stream (the model's compute stream).
    pub fn new(x: &dyn Exec, num_layers: usize, kv_dim: usize, capacity: usize) -> Result<Self> {
        let (mut bufs, mut ptrs) = (Vec::new(), Vec::new());
        for _ in 0..2 * num_layers {
            let (b, p) = x.alloc(capacity * kv_dim * 2)?;
            bufs.push(b);
            ptrs.push(p);
        }
        Ok(Self {
            capacity,
            bytes: 2 * num_layers * capacity * kv_dim * 2,
            k: ptrs[..num_layers].to_vec(),
            v: ptrs[num_layers..].to_vec(),
            _bufs: bufs,
        })
    }

    pub fn bytes(&self) -> usize {
        self.bytes
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
            k: self.k[layer],
            v: self.v[layer],
            capacity: self.capacity,
        })
    }

    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }
}
