//! Every layer's KV resident on the CUDA device (or the emulator's memory): the
//! `KvCache` seam with nothing to wait for, since it shares the model's stream.

use crate::device::cuda::exec::{Buf, Exec};
use crate::device::DevPtr;
use crate::kv::state::{ExecMemory, RecurrentStates, StateSlot};
use crate::kv::{KvCache, LayerSlot, WindowRings};
use crate::model::ModelConfig;
use anyhow::{bail, Result};
use half::bf16;
use std::sync::Arc;

/// Per layer bf16 `[rows, kv_dim]` for K and V, allocated up front: `capacity` rows, or a
/// sliding-window layer's ring (`WindowRings`: its window and one step, position `p` at
/// row `p % rows`), so a windowed layer's KV never outgrows its window.
pub struct ResidentKv {
    capacity: usize,
    bytes: usize,
    rings: WindowRings,
    _bufs: Vec<Buf>,      // 2 × num_layers × bf16 [rows, kv_dim]
    k: Vec<DevPtr<bf16>>, // [num_layers]
    v: Vec<DevPtr<bf16>>,
    rows: Vec<usize>, // [num_layers]
    /// The state layers' recurrent states (one sequence: slot 0), in the executor's
    /// memory, zeroed on its stream when a sequence starts.
    states: RecurrentStates,
}

impl ResidentKv {
    /// Room for `capacity` tokens of `cfg`'s model on `exec`'s stream (the model's
    /// compute stream), and a state layer's recurrent state.
    pub fn for_model(exec: &Arc<dyn Exec>, cfg: &ModelConfig, capacity: usize) -> Result<Self> {
        let mut kv = Self::with_rings(
            &**exec,
            cfg.kv_dim(),
            capacity,
            WindowRings::for_model(cfg, capacity),
        )?;
        kv.states = RecurrentStates::in_memory(cfg, Arc::new(ExecMemory(exec.clone())));
        Ok(kv)
    }

    /// Every one of `num_layers` layers keeps every position.
    pub fn new(exec: &dyn Exec, num_layers: usize, kv_dim: usize, capacity: usize) -> Result<Self> {
        Self::with_rings(exec, kv_dim, capacity, WindowRings::none(num_layers))
    }

    fn with_rings(
        exec: &dyn Exec,
        kv_dim: usize,
        capacity: usize,
        rings: WindowRings,
    ) -> Result<Self> {
        let num_layers = rings.layers();
        let rows: Vec<usize> = (0..num_layers)
            .map(|l| rings.rows(l).unwrap_or(capacity))
            .collect();
        let (mut bufs, mut k, mut v, mut bytes) = (Vec::new(), Vec::new(), Vec::new(), 0);
        for &r in &rows {
            for ptrs in [&mut k, &mut v] {
                let (b, p) = exec.alloc(r * kv_dim * 2)?;
                bufs.push(b);
                ptrs.push(p.cast());
                bytes += r * kv_dim * 2;
            }
        }
        Ok(Self {
            capacity,
            bytes,
            rings,
            k,
            v,
            rows,
            _bufs: bufs,
            states: RecurrentStates::default(),
        })
    }

    /// Bytes held: the KV and the recurrent states.
    pub fn bytes(&self) -> usize {
        self.bytes + self.states.bytes()
    }
}

// SAFETY: the memory is this cache's; the model's stream is the only one that touches it.
unsafe impl KvCache<bf16> for ResidentKv {
    fn reset(&mut self) -> Result<()> {
        self.rings.reset();
        self.states.reset();
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
        self.rings.begin_step(pos0, pos0 + tokens)
    }

    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot<bf16>> {
        Ok(LayerSlot {
            k: self.k[layer],
            v: self.v[layer],
            rows: self.rows[layer],
            ring: self.rings.rows(layer).is_some(),
        })
    }

    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }

    /// Rows are addressed by position: the next step overwrites from `len` (a ring's
    /// rewind: `WindowRings::truncate`).
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.states.truncate(0, len)?;
        self.rings.truncate(len)
    }

    fn max_step_tokens(&self) -> usize {
        self.rings.max_step_tokens()
    }

    fn layer_state(&mut self, layer: usize, slot: usize) -> Result<StateSlot> {
        self.states.layer(layer, slot)
    }

    fn begin_state(&mut self, slot: usize, pos0: usize, tokens: usize) -> Result<()> {
        self.states.begin_step(slot, pos0, tokens)
    }
}
