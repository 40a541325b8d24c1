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
use super::kv::{CudaKv, LayerSlot};
use super::ops::{at, dptr, dtod, dtoh, htod, poison, DPtr};
use super::trace::Tracer;
use crate::device::cpu::stream::TraceEvent;
use crate::model::ModelConfig;
use crate::offload::ring::{ReleasedAfter, Ring};
use crate::offload::{MemoryPlan, OffloadConfig};
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use std::sync::Arc;

const OFFLOAD_STREAMS: usize = 2;
/// bf16.
const ELEM: usize = 2;

struct SlotEvents {
    ready: CudaEvent,
    compute_done: CudaEvent,
    offload_done: CudaEvent,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Idle,
    Prefill { tokens: usize },
    Decode { pos: usize },
}

/// A stream and its trace name.
#[derive(Clone)]
struct Named {
    st: Arc<CudaStream>,
    name: String,
}

enum Copy {
    H2D { dst: DPtr, src: *const u8 },
    D2H { dst: *mut u8, src: DPtr },
    D2D { dst: DPtr, src: DPtr },
}

pub struct CudaOffloadEngine {
    cfg: OffloadConfig,
    plan: MemoryPlan,
    dev: Arc<CudaDevice>,
    num_layers: usize,
    row: usize,
    depth: usize,
    _host: (PinnedHostSlice<u16>, PinnedHostSlice<u16>), // [layers, cpu_blocks, block, row]
    host_k: *mut u16,
    host_v: *mut u16,
    _ring: Vec<CudaSlice<u16>>, // 2 × num_kv_buffers × [slot_tokens, row]
    ring_k: Vec<DPtr>,
    ring_v: Vec<DPtr>,
    _dbuf: (CudaSlice<u16>, CudaSlice<u16>), // [layers, block, row]
    dbuf_k: DPtr,
    dbuf_v: DPtr,
    compute: Named,
    prefetch: Named,
    offload: Vec<Named>,
    slots: Vec<SlotEvents>,
    layer_stored: Vec<CudaEvent>,
    ring: Ring,
    ahead: usize,
    seq_len: usize,
    step: Step,
    tracer: Tracer,
    layer_start: Option<CudaEvent>,
}

fn ev(r: Result<(), cudarc::driver::DriverError>, what: &str) -> Result<()> {
    r.map_err(|e| anyhow!("{what} failed: {e:?}"))
}

impl CudaOffloadEngine {
    /// `compute`: the model's stream (the engine queues its waits and copies there too).
    pub fn new(
        dev: Arc<CudaDevice>,
        compute: Arc<CudaStream>,
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
        let (l, bs) = (model.num_layers, cfg.block_size);
        let host_len = l * plan.num_cpu_blocks * bs * row;
        let mut hk = dev.alloc_pinned::<u16>(host_len)?;
        let mut hv = dev.alloc_pinned::<u16>(host_len)?;
        // The raw pointers are used for every copy (see ops.rs); as_mut_ptr only waits
        // on the slice's own (never recorded) event here.
        let host_k = hk
            .as_mut_ptr()
            .map_err(|e| anyhow!("pinned host KV: {e:?}"))?;
        let host_v = hv
            .as_mut_ptr()
            .map_err(|e| anyhow!("pinned host KV: {e:?}"))?;
        let mut ring = Vec::new();
        for _ in 0..2 * cfg.num_kv_buffers {
            ring.push(dev.alloc_zeros::<u16>(&compute, plan.slot_tokens * row)?);
        }
        let ptrs: Vec<DPtr> = ring.iter().map(|b| dptr(b, &compute)).collect();
        let dk = dev.alloc_zeros::<u16>(&compute, l * bs * row)?;
        let dv = dev.alloc_zeros::<u16>(&compute, l * bs * row)?;
        let named = |st: Arc<CudaStream>, name: &str| Named {
            st,
            name: name.to_string(),
        };
        let mut offload = Vec::new();
        for i in 0..OFFLOAD_STREAMS {
            offload.push(named(dev.new_stream()?, &format!("d2h-offload-{i}")));
        }
        let slots = (0..cfg.num_kv_buffers)
            .map(|_| {
                Ok(SlotEvents {
                    ready: dev.new_event()?,
                    compute_done: dev.new_event()?,
                    offload_done: dev.new_event()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let layer_stored = (0..l)
            .map(|_| dev.new_event())
            .collect::<Result<Vec<_>>>()?;
        let n = cfg.num_kv_buffers;
        let mut e = Self {
            depth: (n - 1).min(l),
            num_layers: l,
            row,
            host_k,
            host_v,
            _host: (hk, hv),
            ring_k: ptrs[..n].to_vec(),
            ring_v: ptrs[n..].to_vec(),
            _ring: ring,
            dbuf_k: dptr(&dk, &compute),
            dbuf_v: dptr(&dv, &compute),
            _dbuf: (dk, dv),
            prefetch: named(dev.new_stream()?, "h2d-prefetch"),
            compute: named(compute, "compute"),
            offload,
            slots,
            layer_stored,
            ring: Ring::new(n, l),
            ahead: 0,
            seq_len: 0,
            step: Step::Idle,
            tracer: Tracer::default(),
            layer_start: None,
            cfg,
            plan,
            dev,
        };
        e.reset()?;
        Ok(e)
    }

    pub fn plan(&self) -> MemoryPlan {
        self.plan
    }

    /// Traces every copy and layer from now on (timed events; see `trace.rs`).
    pub fn set_tracing(&mut self, on: bool) -> Result<()> {
        if on {
            self.tracer.enable(&self.dev, &self.compute.st)
        } else {
            self.tracer.disable();
            Ok(())
        }
    }

    /// The ops traced so far (waits for them).
    pub fn take_trace(&mut self) -> Result<Vec<TraceEvent>> {
        self.tracer.take()
    }

    fn host_off(&self, layer: usize, block: usize) -> usize {
        (layer * self.plan.num_cpu_blocks + block) * self.cfg.block_size * self.row
    }

    fn dbuf_off(&self, layer: usize) -> usize {
        layer * self.cfg.block_size * self.row
    }

    fn offload_stream(&self, layer: usize) -> Named {
        self.offload[layer % self.offload.len()].clone()
    }

    fn wait(&self, st: &Named, e: &CudaEvent) -> Result<()> {
        ev(st.st.wait(e), "cuStreamWaitEvent")
    }

    fn record(&self, st: &Named, e: &CudaEvent) -> Result<()> {
        ev(e.record(&st.st), "cuEventRecord")
    }

    fn wait_released(&self, st: &Named, slot: usize, after: ReleasedAfter) -> Result<()> {
        match after {
            ReleasedAfter::Nothing => Ok(()),
            ReleasedAfter::Compute => self.wait(st, &self.slots[slot].compute_done),
            ReleasedAfter::Offload => self.wait(st, &self.slots[slot].offload_done),
        }
    }

    /// One traced, NVTX-marked copy of `elems` bf16 values on `st`.
    fn copy(
        &mut self,
        st: &Named,
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
        nvtx::range_push!("{name} L{layer} {bytes} B");
        let start = self.tracer.start(&self.dev, &st.st)?;
        // SAFETY: every pointer is inside a buffer this engine owns, sized by the plan
        // (host KV, ring slot, decode buffer), and `elems` stays within them; the events
        // waited on before each copy order it against the kernels that use the memory.
        unsafe {
            match c {
                Copy::H2D { dst, src } => htod(&st.st, dst, src, bytes)?,
                Copy::D2H { dst, src } => dtoh(&st.st, dst, src, bytes)?,
                Copy::D2D { dst, src } => dtod(&st.st, dst, src, bytes)?,
            }
        }
        self.tracer
            .end(&self.dev, &st.st, start, &st.name, name, Some(layer), bytes)?;
        nvtx::range_pop!();
        Ok(())
    }

    fn host_ptr(&self, base: *mut u16, off: usize) -> *mut u8 {
        // SAFETY: offsets come from host_off, inside the allocation.
        unsafe { base.add(off) as *mut u8 }
    }

    /// Decode: H2D of `layer`'s full host blocks into its slot (this step or the next).
    fn prefetch_layer(&mut self, layer: usize, full_blocks: usize, next_step: bool) -> Result<()> {
        let (s, after) = self.ring.begin_load(layer, next_step)?;
        let p = self.prefetch.clone();
        self.wait_released(&p, s, after)?;
        self.wait(&p, &self.layer_stored[layer])?;
        let len = full_blocks * self.cfg.block_size * self.row;
        let off = self.host_off(layer, 0);
        let (hk, hv) = (
            self.host_ptr(self.host_k, off),
            self.host_ptr(self.host_v, off),
        );
        let (rk, rv) = (self.ring_k[s], self.ring_v[s]);
        self.copy(&p, "h2d-k", layer, Copy::H2D { dst: rk, src: hk }, len)?;
        self.copy(&p, "h2d-v", layer, Copy::H2D { dst: rv, src: hv }, len)?;
        self.record(&p, &self.slots[s].ready)
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

    fn poison_slot(&self, st: &Named, s: usize, tokens: usize) -> Result<()> {
        let bytes = tokens * self.row * ELEM;
        // SAFETY: within the slot (tokens ≤ slot_tokens).
        unsafe {
            poison(&st.st, self.ring_k[s], bytes)?;
            poison(&st.st, self.ring_v[s], bytes)
        }
    }

    fn synchronize_all(&self) -> Result<()> {
        for st in [&self.compute, &self.prefetch]
            .into_iter()
            .chain(&self.offload)
        {
            ev(st.st.synchronize(), "cuStreamSynchronize")?;
        }
        Ok(())
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
            let c = self.compute.clone();
            let host = self.host_off(self.num_layers, 0) * ELEM;
            // SAFETY: every stream is idle; sizes are the allocations'.
            unsafe {
                std::ptr::write_bytes(self.host_k as *mut u8, 0xff, host);
                std::ptr::write_bytes(self.host_v as *mut u8, 0xff, host);
                let d = self.dbuf_off(self.num_layers) * ELEM;
                poison(&c.st, self.dbuf_k, d)?;
                poison(&c.st, self.dbuf_v, d)?;
            }
            for s in 0..self.slots.len() {
                self.poison_slot(&c, s, self.plan.slot_tokens)?;
            }
            ev(c.st.synchronize(), "cuStreamSynchronize")?;
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
        let c = self.compute.clone();
        let s = match self.step {
            Step::Prefill { .. } => {
                let (s, after) = self.ring.begin_prefill_compute(layer)?;
                self.wait_released(&c, s, after)?;
                s
            }
            Step::Decode { pos } => {
                let s = self.ring.begin_decode_compute(layer)?;
                self.wait(&c, &self.slots[s].ready)?;
                // The decode buffer of this layer may still be read by an offload stream.
                self.wait(&c, &self.layer_stored[layer])?;
                // Append the partial block so the attention sees one contiguous context.
                let (r, base) = (pos % self.cfg.block_size, pos - pos % self.cfg.block_size);
                let d = self.dbuf_off(layer);
                let (dk, dv) = (at::<u16>(self.dbuf_k, d), at::<u16>(self.dbuf_v, d));
                let (sk, sv) = (
                    at::<u16>(self.ring_k[s], base * self.row),
                    at::<u16>(self.ring_v[s], base * self.row),
                );
                self.copy(
                    &c,
                    "dbuf-to-slot-k",
                    layer,
                    Copy::D2D { dst: sk, src: dk },
                    r * self.row,
                )?;
                self.copy(
                    &c,
                    "dbuf-to-slot-v",
                    layer,
                    Copy::D2D { dst: sv, src: dv },
                    r * self.row,
                )?;
                s
            }
            Step::Idle => bail!("offload engine: begin_layer outside a step"),
        };
        self.layer_start = self.tracer.start(&self.dev, &c.st)?;
        Ok(LayerSlot {
            k: self.ring_k[s],
            v: self.ring_v[s],
            capacity: self.plan.slot_tokens,
        })
    }

    fn end_layer(&mut self, layer: usize) -> Result<()> {
        let bs = self.cfg.block_size;
        let s = self.ring.slot_of(layer);
        let c = self.compute.clone();
        let start = self.layer_start.take();
        self.tracer
            .end(&self.dev, &c.st, start, &c.name, "layer", Some(layer), 0)?;
        match self.step {
            Step::Prefill { tokens } => {
                self.ring.end_compute(layer)?;
                self.record(&c, &self.slots[s].compute_done)?;
                // Offload this layer's KV while the next layers compute.
                let o = self.offload_stream(layer);
                self.wait(&o, &self.slots[s].compute_done)?;
                let (full, rem) = (tokens / bs, tokens % bs);
                let len = full * bs * self.row;
                let off = self.host_off(layer, 0);
                let (hk, hv) = (
                    self.host_ptr(self.host_k, off),
                    self.host_ptr(self.host_v, off),
                );
                let (rk, rv) = (self.ring_k[s], self.ring_v[s]);
                self.copy(&o, "d2h-k", layer, Copy::D2H { dst: hk, src: rk }, len)?;
                self.copy(&o, "d2h-v", layer, Copy::D2H { dst: hv, src: rv }, len)?;
                let d = self.dbuf_off(layer);
                let (dk, dv) = (at::<u16>(self.dbuf_k, d), at::<u16>(self.dbuf_v, d));
                let (sk, sv) = (at::<u16>(rk, len), at::<u16>(rv, len));
                self.copy(
                    &o,
                    "slot-to-dbuf-k",
                    layer,
                    Copy::D2D { dst: dk, src: sk },
                    rem * self.row,
                )?;
                self.copy(
                    &o,
                    "slot-to-dbuf-v",
                    layer,
                    Copy::D2D { dst: dv, src: sv },
                    rem * self.row,
                )?;
                if self.cfg.sanitize {
                    self.poison_slot(&o, s, tokens)?;
                }
                self.record(&o, &self.slots[s].offload_done)?;
                self.record(&o, &self.layer_stored[layer])?;
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
                    &c,
                    "slot-to-dbuf-k",
                    layer,
                    Copy::D2D { dst: dk, src: sk },
                    self.row,
                )?;
                self.copy(
                    &c,
                    "slot-to-dbuf-v",
                    layer,
                    Copy::D2D { dst: dv, src: sv },
                    self.row,
                )?;
                if self.cfg.sanitize {
                    self.poison_slot(&c, s, pos + 1)?;
                }
                self.ring.end_compute(layer)?;
                self.record(&c, &self.slots[s].compute_done)?;
                if r + 1 == bs {
                    // The decode buffer filled a block: move it to the host, by event.
                    let o = self.offload_stream(layer);
                    self.wait(&o, &self.slots[s].compute_done)?;
                    let (db, h) = (self.dbuf_off(layer), self.host_off(layer, full));
                    let (hk, hv) = (self.host_ptr(self.host_k, h), self.host_ptr(self.host_v, h));
                    let (dk, dv) = (at::<u16>(self.dbuf_k, db), at::<u16>(self.dbuf_v, db));
                    self.copy(
                        &o,
                        "d2h-flush-k",
                        layer,
                        Copy::D2H { dst: hk, src: dk },
                        bs * self.row,
                    )?;
                    self.copy(
                        &o,
                        "d2h-flush-v",
                        layer,
                        Copy::D2H { dst: hv, src: dv },
                        bs * self.row,
                    )?;
                    self.record(&o, &self.layer_stored[layer])?;
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
