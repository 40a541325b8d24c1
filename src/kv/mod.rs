//! The KV seam: the model's layer loop talks to a per-step KV view through
//! `begin_layer / layer / end_layer` and never knows where the cache lives.

use anyhow::{bail, Result};

/// One layer's K and V as the attention sees them: `[capacity, kv_heads, head_dim]`,
/// positions `0..len` valid once the step's new tokens are stored.
pub struct LayerKv<'a> {
    pub k: &'a mut [f32],
    pub v: &'a mut [f32],
}

/// What the layer loop needs from a KV cache during one forward step.
pub trait KvView {
    /// Before layer `layer` attends: make its KV usable (e.g. wait for a prefetch).
    fn begin_layer(&mut self, layer: usize) -> Result<()>;
    /// The layer's K/V, with room for positions `0..end` (`end` = after this step).
    fn layer(&mut self, layer: usize, end: usize) -> Result<LayerKv<'_>>;
    /// After layer `layer` is done with its KV (e.g. start an offload or the next prefetch).
    fn end_layer(&mut self, layer: usize) -> Result<()>;
}

/// A contiguous per-sequence cache in device memory: `num_layers × [capacity, kv_heads, head_dim]`
/// for K and for V. begin/end are no-ops: everything is resident.
pub struct ContiguousKv {
    row: usize, // kv_heads * head_dim
    capacity: usize,
    k: Vec<Vec<f32>>, // [num_layers][capacity * row]
    v: Vec<Vec<f32>>,
}

impl ContiguousKv {
    /// Room for `capacity` tokens per layer (allocated lazily as positions are used).
    pub fn new(num_layers: usize, kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        Self {
            row: kv_heads * head_dim,
            capacity,
            k: vec![Vec::new(); num_layers],
            v: vec![Vec::new(); num_layers],
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes currently held.
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|b| b.len() * 4).sum()
    }
}

impl KvView for ContiguousKv {
    fn begin_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }

    fn layer(&mut self, layer: usize, end: usize) -> Result<LayerKv<'_>> {
        if end > self.capacity {
            bail!(
                "KV cache full: {end} tokens needed, room for {}",
                self.capacity
            );
        }
        let need = end * self.row;
        for buf in [&mut self.k[layer], &mut self.v[layer]] {
            if buf.len() < need {
                // Grow geometrically so decode does not reallocate every step.
                let target = (need.max(buf.len() * 2)).min(self.capacity * self.row);
                buf.resize(target, 0.0);
            }
        }
        Ok(LayerKv {
            k: &mut self.k[layer],
            v: &mut self.v[layer],
        })
    }

    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }
}
