//! Layerwise KV offload on CUDA: the twin of `crate::offload::OffloadEngine`, with the
//! same memory layout, streams, events, ring state machine (`offload::ring`) and plan
//! (`OffloadConfig::plan`), in bf16. See `docs/offload.md` for the design and
//! `docs/cuda.md` for why this is a twin rather than a generic engine.
//!
//! - host KV, pinned (not write-combined), K and V each `[layers, cpu_blocks, block, row]`;
//! - ring, K and V each `num_kv_buffers × [slot_tokens, row]`;
//! - decode buffer, K and V each `[layers, block, row]`.
//!
//! Streams: the model's compute stream, `h2d-prefetch`, `d2h-offload-{0,1}`. Events: per
//! slot `ready`, `compute_done`, `offload_done`; per layer `layer_stored`.

use super::context::CudaDevice;
use super::exec::Buf;
use super::kv::{CudaKv, LayerSlot};
use super::offload_dev::{
    Copy, CudaOffloadDev, EventId, HostMem, OffloadDev, StreamId, COMPUTE, PREFETCH,
};
use super::ops::{at, DPtr};
use crate::device::cpu::stream::TraceEvent;
use crate::model::ModelConfig;
use crate::offload::ring::{ReleasedAfter, Ring};
use crate::offload::{MemoryPlan, OffloadConfig};
use anyhow::{bail, Result};
use cudarc::driver::CudaStream;
use std::sync::Arc;

const OFFLOAD_STREAMS: usize = 2;
/// bf16.
const ELEM: usize = 2;

struct SlotEvents {
    ready: EventId,
    compute_done: EventId,
    offload_done: EventId,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Idle,
    Prefill { tokens: usize },
    Decode { pos: usize },
}

pub struct CudaOffloadEngine {
    cfg: OffloadConfig,
    plan: MemoryPlan,
    d: Box<dyn OffloadDev>,
    num_layers: usize,
    row: usize,
    depth: usize,
    _host: Vec<HostMem>, // K, V: [layers, cpu_blocks, block, row]
    host_k: *mut u16,
    host_v: *mut u16,
    _dev: Vec<Buf>, // ring 2 × num_kv_buffers × [slot_tokens, row], decode buffer K, V
    ring_k: Vec<DPtr>, // [num_kv_buffers]
    ring_v: Vec<DPtr>,
    dbuf_k: DPtr, // [layers, block, row]
    dbuf_v: DPtr,
    slots: Vec<SlotEvents>,
    layer_stored: Vec<EventId>,
    ring: Ring,
    ahead: usize,
    seq_len: usize,
    step: Step,
}

impl CudaOffloadEngine {
    /// `compute`: the model's stream (the engine queues its waits and copies there too).
    pub fn new(
        dev: Arc<CudaDevice>,
        compute: Arc<CudaStream>,
        model: &ModelConfig,
        cfg: OffloadConfig,
    ) -> Result<Self> {
        let d = CudaOffloadDev::new(dev, compute, OFFLOAD_STREAMS)?;
        Self::with_dev(Box::new(d), model, cfg)
    }

    /// On any `OffloadDev` (the host twin in tests).
    pub fn with_dev(
        mut d: Box<dyn OffloadDev>,
        model: &ModelConfig,
        cfg: OffloadConfig,
    ) -> Result<Self> {
        if cfg.link_gbps > 0.0 {
            bail!(
                "--sim-link-gbps throttles the CPU device only; the CUDA device uses the real link"
            );
        }
        if cfg.drop_wait.is_some() {
            bail!("fault injection (drop_wait) exists on the CPU device only");
        }
        let plan = cfg.plan_for(model, ELEM)?;
        let row = model.kv_dim();
        let (l, bs, n) = (model.num_layers, cfg.block_size, cfg.num_kv_buffers);
        let host_bytes = l * plan.num_cpu_blocks * bs * row * ELEM;
        let (hk, host_k) = d.alloc_host(host_bytes)?;
        let (hv, host_v) = d.alloc_host(host_bytes)?;
        let (mut bufs, mut ptrs) = (Vec::new(), Vec::new());
        for i in 0..2 * n + 2 {
            let bytes = if i < 2 * n { plan.slot_tokens } else { l * bs } * row * ELEM;
            let (b, p) = d.alloc_device(bytes)?;
            bufs.push(b);
            ptrs.push(p);
        }
        let mut slots = Vec::new();
        for _ in 0..n {
            slots.push(SlotEvents {
                ready: d.new_event()?,
                compute_done: d.new_event()?,
                offload_done: d.new_event()?,
            });
        }
        let layer_stored = (0..l).map(|_| d.new_event()).collect::<Result<Vec<_>>>()?;
        let mut e = Self {
            depth: (n - 1).min(l),
            num_layers: l,
            row,
            _host: vec![hk, hv],
            host_k: host_k as *mut u16,
            host_v: host_v as *mut u16,
            ring_k: ptrs[..n].to_vec(),
            ring_v: ptrs[n..2 * n].to_vec(),
            dbuf_k: ptrs[2 * n],
            dbuf_v: ptrs[2 * n + 1],
            _dev: bufs,
            d,
            slots,
            layer_stored,
            ring: Ring::new(n, l),
            ahead: 0,
            seq_len: 0,
            step: Step::Idle,
            cfg,
            plan,
        };
        e.reset()?;
        Ok(e)
    }

    pub fn plan(&self) -> MemoryPlan {
        self.plan
    }

    /// Traces every copy and layer from now on (timed events; see `trace.rs`).
    pub fn set_tracing(&mut self, on: bool) -> Result<()> {
        self.d.set_tracing(on)
    }

    /// The ops traced so far (waits for them).
    pub fn take_trace(&mut self) -> Result<Vec<TraceEvent>> {
        self.d.take_trace()
    }

    fn host_off(&self, layer: usize, block: usize) -> usize {
        (layer * self.plan.num_cpu_blocks + block) * self.cfg.block_size * self.row
    }

    fn dbuf_off(&self, layer: usize) -> usize {
        layer * self.cfg.block_size * self.row
    }

    fn offload_stream(&self, layer: usize) -> StreamId {
        2 + layer % self.d.num_offload_streams()
    }

    fn wait(&self, st: StreamId, e: EventId) -> Result<()> {
        self.d.wait(st, e)
    }

    fn record(&self, st: StreamId, e: EventId) -> Result<()> {
        self.d.record(st, e)
    }

    fn wait_released(&self, st: StreamId, slot: usize, after: ReleasedAfter) -> Result<()> {
        match after {
            ReleasedAfter::Nothing => Ok(()),
            ReleasedAfter::Compute => self.wait(st, self.slots[slot].compute_done),
            ReleasedAfter::Offload => self.wait(st, self.slots[slot].offload_done),
        }
    }

    /// One copy of `elems` bf16 values on `st` (traced and NVTX-marked on CUDA).
    fn copy(
        &mut self,
        st: StreamId,
        name: &'static str,
        layer: usize,
        c: Copy,
        elems: usize,
    ) -> Result<()> {
        let bytes = elems * ELEM;
        if bytes == 0 {
            return Ok(());
        }
        if self.cfg.sanitize {
            // The CPU sanitizer's random copy delay has no CUDA counterpart that stays
            // on the device; a host sleep here only delays the enqueue.
            std::thread::sleep(std::time::Duration::from_micros(rand::random_range(
                0..1500,
            )));
        }
        // SAFETY: every pointer is inside a buffer this engine owns, sized by the plan
        // (host KV, ring slot, decode buffer), and `elems` stays within them; the events
        // waited on before each copy order it against the kernels that use the memory.
        unsafe { self.d.copy(st, name, layer, c, bytes) }
    }

    fn host_ptr(&self, base: *mut u16, off: usize) -> *mut u8 {
        // SAFETY: offsets come from host_off, inside the allocation.
        unsafe { base.add(off) as *mut u8 }
    }

    /// Decode: H2D of `layer`'s full host blocks into its slot (this step or the next).
    fn prefetch_layer(&mut self, layer: usize, full_blocks: usize, next_step: bool) -> Result<()> {
        let (s, after) = self.ring.begin_load(layer, next_step)?;
        let p = PREFETCH;
        self.wait_released(p, s, after)?;
        self.wait(p, self.layer_stored[layer])?;
        let len = full_blocks * self.cfg.block_size * self.row;
        let off = self.host_off(layer, 0);
        let (hk, hv) = (
            self.host_ptr(self.host_k, off),
            self.host_ptr(self.host_v, off),
        );
        let (rk, rv) = (self.ring_k[s], self.ring_v[s]);
        self.copy(p, "h2d-k", layer, Copy::H2D { dst: rk, src: hk }, len)?;
        self.copy(p, "h2d-v", layer, Copy::H2D { dst: rv, src: hv }, len)?;
        self.record(p, self.slots[s].ready)
    }

    /// Same schedule as the CPU engine: `depth` layers ahead, across the step boundary.
    fn prefetch_after(&mut self, layer: usize, next_pos: usize) -> Result<()> {
        let target = layer + self.depth;
        if target < self.num_layers {
            if let Step::Decode { pos } = self.step {
                self.prefetch_layer(target, pos / self.cfg.block_size, false)?;
            }
        } else if target - self.num_layers < self.depth && next_pos < self.capacity() {
            self.prefetch_layer(
                target - self.num_layers,
                next_pos / self.cfg.block_size,
                true,
            )?;
            self.ahead += 1;
        }
        if layer + 1 == self.num_layers {
            self.seq_len = next_pos;
            self.ring.advance();
        }
        Ok(())
    }

    fn poison_slot(&self, st: StreamId, s: usize, tokens: usize) -> Result<()> {
        let bytes = tokens * self.row * ELEM;
        // SAFETY: within the slot (tokens ≤ slot_tokens).
        unsafe {
            self.d.poison(st, self.ring_k[s], bytes)?;
            self.d.poison(st, self.ring_v[s], bytes)
        }
    }

    fn synchronize_all(&self) -> Result<()> {
        self.d.sync_all()
    }
}

impl CudaKv for CudaOffloadEngine {
    /// After a full synchronize every recorded event has completed, so the events are
    /// reused (a wait on a completed event is free).
    fn reset(&mut self) -> Result<()> {
        self.synchronize_all()?;
        self.ring.reset();
        self.ahead = 0;
        self.seq_len = 0;
        self.step = Step::Idle;
        if self.cfg.sanitize {
            let c = COMPUTE;
            let host = self.host_off(self.num_layers, 0) * ELEM;
            // SAFETY: every stream is idle; sizes are the allocations'.
            unsafe {
                std::ptr::write_bytes(self.host_k as *mut u8, 0xff, host);
                std::ptr::write_bytes(self.host_v as *mut u8, 0xff, host);
                let d = self.dbuf_off(self.num_layers) * ELEM;
                self.d.poison(c, self.dbuf_k, d)?;
                self.d.poison(c, self.dbuf_v, d)?;
            }
            for s in 0..self.slots.len() {
                self.poison_slot(c, s, self.plan.slot_tokens)?;
            }
            self.d.sync(c)?;
        }
        Ok(())
    }

    fn capacity(&self) -> usize {
        self.cfg
            .max_model_len
            .min(self.plan.num_cpu_blocks * self.cfg.block_size)
    }

    fn begin_step(&mut self, pos0: usize, tokens: usize) -> Result<()> {
        let cap = self.capacity();
        if pos0 + tokens > cap {
            bail!(
                "offload KV is full: {} tokens need {} blocks of {}, the engine holds {} tokens (raise --max-model-len or --num-cpu-blocks)",
                pos0 + tokens,
                (pos0 + tokens).div_ceil(self.cfg.block_size),
                self.cfg.block_size,
                cap
            );
        }
        self.step = if pos0 == 0 && self.seq_len == 0 {
            Step::Prefill { tokens }
        } else if tokens == 1 && pos0 == self.seq_len {
            Step::Decode { pos: pos0 }
        } else {
            bail!("offload engine: a step must be a whole-prompt prefill or one decode token (got {tokens} tokens at position {pos0}, {} stored)", self.seq_len);
        };
        if let Step::Decode { pos } = self.step {
            let full = pos / self.cfg.block_size;
            for layer in self.ahead..self.depth {
                self.prefetch_layer(layer, full, false)?;
            }
        }
        self.ahead = 0;
        Ok(())
    }

    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot> {
        let c = COMPUTE;
        let s = match self.step {
            Step::Prefill { .. } => {
                let (s, after) = self.ring.begin_prefill_compute(layer)?;
                self.wait_released(c, s, after)?;
                s
            }
            Step::Decode { pos } => {
                let s = self.ring.begin_decode_compute(layer)?;
                self.wait(c, self.slots[s].ready)?;
                // The decode buffer of this layer may still be read by an offload stream.
                self.wait(c, self.layer_stored[layer])?;
                // Append the partial block so the attention sees one contiguous context.
                let (r, base) = (pos % self.cfg.block_size, pos - pos % self.cfg.block_size);
                let d = self.dbuf_off(layer);
                let (dk, dv) = (at::<u16>(self.dbuf_k, d), at::<u16>(self.dbuf_v, d));
                let (sk, sv) = (
                    at::<u16>(self.ring_k[s], base * self.row),
                    at::<u16>(self.ring_v[s], base * self.row),
                );
                self.copy(
                    c,
                    "dbuf-to-slot-k",
                    layer,
                    Copy::D2D { dst: sk, src: dk },
                    r * self.row,
                )?;
                self.copy(
                    c,
                    "dbuf-to-slot-v",
                    layer,
                    Copy::D2D { dst: sv, src: dv },
                    r * self.row,
                )?;
                s
            }
            Step::Idle => bail!("offload engine: begin_layer outside a step"),
        };
        self.d.layer_begin(layer)?;
        Ok(LayerSlot {
            k: self.ring_k[s],
            v: self.ring_v[s],
            capacity: self.plan.slot_tokens,
        })
    }

    fn end_layer(&mut self, layer: usize) -> Result<()> {
        let bs = self.cfg.block_size;
        let s = self.ring.slot_of(layer);
        let c = COMPUTE;
        self.d.layer_end(layer)?;
        match self.step {
            Step::Prefill { tokens } => {
                self.ring.end_compute(layer)?;
                self.record(c, self.slots[s].compute_done)?;
                // Offload this layer's KV while the next layers compute.
                let o = self.offload_stream(layer);
                self.wait(o, self.slots[s].compute_done)?;
                let (full, rem) = (tokens / bs, tokens % bs);
                let len = full * bs * self.row;
                let off = self.host_off(layer, 0);
                let (hk, hv) = (
                    self.host_ptr(self.host_k, off),
                    self.host_ptr(self.host_v, off),
                );
                let (rk, rv) = (self.ring_k[s], self.ring_v[s]);
                self.copy(o, "d2h-k", layer, Copy::D2H { dst: hk, src: rk }, len)?;
                self.copy(o, "d2h-v", layer, Copy::D2H { dst: hv, src: rv }, len)?;
                let d = self.dbuf_off(layer);
                let (dk, dv) = (at::<u16>(self.dbuf_k, d), at::<u16>(self.dbuf_v, d));
                let (sk, sv) = (at::<u16>(rk, len), at::<u16>(rv, len));
                self.copy(
                    o,
                    "slot-to-dbuf-k",
                    layer,
                    Copy::D2D { dst: dk, src: sk },
                    rem * self.row,
                )?;
                self.copy(
                    o,
                    "slot-to-dbuf-v",
                    layer,
                    Copy::D2D { dst: dv, src: sv },
                    rem * self.row,
                )?;
                if self.cfg.sanitize {
                    self.poison_slot(o, s, tokens)?;
                }
                self.record(o, self.slots[s].offload_done)?;
                self.record(o, self.layer_stored[layer])?;
                self.prefetch_after(layer, tokens)?;
            }
            Step::Decode { pos } => {
                // The new token's K/V (written into the slot by kv_store) joins the
                // decode buffer.
                let (full, r) = (pos / bs, pos % bs);
                let d = self.dbuf_off(layer) + r * self.row;
                let (dk, dv) = (at::<u16>(self.dbuf_k, d), at::<u16>(self.dbuf_v, d));
                let (sk, sv) = (
                    at::<u16>(self.ring_k[s], pos * self.row),
                    at::<u16>(self.ring_v[s], pos * self.row),
                );
                self.copy(
                    c,
                    "slot-to-dbuf-k",
                    layer,
                    Copy::D2D { dst: dk, src: sk },
                    self.row,
                )?;
                self.copy(
                    c,
                    "slot-to-dbuf-v",
                    layer,
                    Copy::D2D { dst: dv, src: sv },
                    self.row,
                )?;
                if self.cfg.sanitize {
                    self.poison_slot(c, s, pos + 1)?;
                }
                self.ring.end_compute(layer)?;
                self.record(c, self.slots[s].compute_done)?;
                if r + 1 == bs {
                    // The decode buffer filled a block: move it to the host, by event.
                    let o = self.offload_stream(layer);
                    self.wait(o, self.slots[s].compute_done)?;
                    let (db, h) = (self.dbuf_off(layer), self.host_off(layer, full));
                    let (hk, hv) = (self.host_ptr(self.host_k, h), self.host_ptr(self.host_v, h));
                    let (dk, dv) = (at::<u16>(self.dbuf_k, db), at::<u16>(self.dbuf_v, db));
                    self.copy(
                        o,
                        "d2h-flush-k",
                        layer,
                        Copy::D2H { dst: hk, src: dk },
                        bs * self.row,
                    )?;
                    self.copy(
                        o,
                        "d2h-flush-v",
                        layer,
                        Copy::D2H { dst: hv, src: dv },
                        bs * self.row,
                    )?;
                    self.record(o, self.layer_stored[layer])?;
                }
                self.prefetch_after(layer, pos + 1)?;
            }
            Step::Idle => bail!("offload engine: end_layer outside a step"),
        }
        Ok(())
    }
}

impl Drop for CudaOffloadEngine {
    fn drop(&mut self) {
        let _ = self.synchronize_all();
    }
}
