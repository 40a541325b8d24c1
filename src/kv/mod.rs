//! The KV seam: the model's layer loop talks to a per-step KV view through
//! `begin_layer / layer / end_layer` and never knows where the cache lives.

use anyhow::{bail, Result};

/// One layer's K and V as the attention sees them: `[capacity, kv_heads, head_dim]`,
/// positions `0..len` valid once the step's new tokens are stored.
pub struct LayerKv<'a> {
    pub k: &'a mut [f32],
    pub v: &'a mut [f32],
}

/// Work for the compute stream.
pub type Work = Box<dyn FnOnce() + Send>;
/// One layer's compute, handed that layer's KV when it runs.
pub type LayerWork = Box<dyn for<'a> FnOnce(LayerKv<'a>) + Send>;

/// What the layer loop needs from a KV cache during one forward step. Work is handed
/// over, not run by the caller, so an implementation may queue it on a device stream and
/// return at once; `synchronize` waits for all of it.
pub trait KvView {
    /// Forgets everything of the previous request (called before each request's prefill).
    fn reset(&mut self) -> Result<()> {
        Ok(())
    }
    /// A forward step over positions `pos0..pos0 + tokens` begins (e.g. start prefetching).
    fn begin_step(&mut self, _pos0: usize, _tokens: usize) -> Result<()> {
        Ok(())
    }
    /// Runs non-layer work (embedding, lm_head) on the compute stream.
    fn run(&mut self, name: &'static str, work: Work) -> Result<()>;
    /// Before layer `layer` attends: make its KV usable (e.g. wait for a prefetch).
    fn begin_layer(&mut self, layer: usize) -> Result<()>;
    /// Runs layer `layer`'s compute, which stores K/V for positions `pos0..pos0 + tokens`
    /// and attends over `0..pos0 + tokens`.
    fn run_layer(
        &mut self,
        layer: usize,
        pos0: usize,
        tokens: usize,
        work: LayerWork,
    ) -> Result<()>;
    /// After layer `layer` is done with its KV (e.g. start an offload or the next prefetch).
    fn end_layer(&mut self, layer: usize) -> Result<()>;
    /// Blocks until every piece of work handed over so far has run.
    fn synchronize(&mut self) -> Result<()>;
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

impl ContiguousKv {
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
}

/// Everything is resident and the caller's thread is the compute stream: work runs inline.
impl KvView for ContiguousKv {
    fn run(&mut self, _name: &'static str, work: Work) -> Result<()> {
        work();
        Ok(())
    }

    fn begin_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }

    fn run_layer(
        &mut self,
        layer: usize,
        pos0: usize,
        tokens: usize,
        work: LayerWork,
    ) -> Result<()> {
        work(self.layer(layer, pos0 + tokens)?);
        Ok(())
    }

    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}
