//! Every layer's KV resident on the CUDA device (or the emulator's memory): the
//! `KvCache` seam with nothing to wait for, since it shares the model's stream.

use crate::device::cuda::exec::{Buf, Exec};
use crate::device::DevPtr;
use crate::kv::{KvCache, LayerSlot};
use anyhow::{bail, Result};
use half::bf16;

/// `num_layers × [capacity, kv_dim]` bf16 for K and V, allocated up front.
pub struct ResidentKv {
    capacity: usize,
    bytes: usize,
    _bufs: Vec<Buf>,      // 2 × num_layers × bf16 [capacity, kv_dim]
    k: Vec<DevPtr<bf16>>, // [num_layers]
    v: Vec<DevPtr<bf16>>,
}

impl ResidentKv {
    /// On `exec`'s stream (the model's compute stream).
    pub fn new(exec: &dyn Exec, num_layers: usize, kv_dim: usize, capacity: usize) -> Result<Self> {
        let (mut bufs, mut ptrs) = (Vec::new(), Vec::new());
        for _ in 0..2 * num_layers {
            let (b, p) = exec.alloc(capacity * kv_dim * 2)?;
            bufs.push(b);
            ptrs.push(p.cast());
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

// SAFETY: the memory is this cache's; the model's stream is the only one that touches it.
unsafe impl KvCache<bf16> for ResidentKv {
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

    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot<bf16>> {
        Ok(LayerSlot {
            k: self.k[layer],
            v: self.v[layer],
            rows: self.capacity,
            ring: false,
        })
    }

    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }

    fn truncate(&mut self, _len: usize) -> Result<()> {
        Ok(()) // rows are addressed by position: the next step overwrites from `len`
    }
}
