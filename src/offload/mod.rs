//! Layerwise KV offload: the whole KV cache lives in host memory; a ring of
//! `num_kv_buffers` per-layer device slots is filled by asynchronous H2D prefetch (decode)
//! and drained by asynchronous D2H offload (prefill), all ordered by events.
//!
//! Memory (f32 on the CPU device; `row` = kv_heads · head_dim):
//! - host KV, K and V each `[num_layers, num_cpu_blocks, block_size, row]`. One request's
//!   blocks are allocated from 0 upwards, so a layer's full blocks are one contiguous range
//!   and each prefill offload or decode prefetch is **one copy per layer for K and one for V**
//!   (SmolLM2 at 4K tokens: 3 MiB per copy; Qwen3-4B at 32K: 64 MiB in bf16).
//! - device ring, K and V each `num_kv_buffers × [slot_tokens, row]`: layer `l` uses slot
//!   `l % num_kv_buffers` and holds the layer's whole context while it computes.
//! - decode buffer, K and V each `[num_layers, block_size, row]`: the partly filled last
//!   block, written by decode steps and offloaded to the host when it fills.
//!
//! Streams: one compute stream, one H2D prefetch stream, a pool of D2H offload streams.
//! Events: per slot `slot_ready` (H2D done), `compute_done`, `offload_done`; per layer
//! `layer_stored` (its host blocks and decode buffer are up to date).

pub mod bench;
pub mod ring;
pub mod trace;

use std::sync::Arc;

use anyhow::{bail, Result};

use crate::device::cpu::stream::{Buffer, CpuDevice, Event, MemSpace, Stream};
use crate::kv::{KvView, LayerKv, LayerWork, Work};
use crate::model::ModelConfig;
use ring::{ReleasedAfter, Ring};

/// Largest block: the decode buffer holds one block per layer on the device.
pub const MAX_BLOCK_SIZE: usize = 16384;

/// D2H streams in the offload pool: consecutive layers' offloads run side by side.
const OFFLOAD_STREAMS: usize = 2;

/// A test-only fault: skip one event wait, to prove the sanitizer catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropWait {
    /// Decode compute does not wait for its slot's prefetch.
    DecodeSlotReady,
    /// Prefill compute overwrites a slot without waiting for its previous offload.
    PrefillSlotReuse,
}

#[derive(Debug, Clone)]
pub struct OffloadConfig {
    /// Device ring slots (>= 2); prefetch depth is `num_kv_buffers - 1`.
    pub num_kv_buffers: usize,
    /// Tokens per host KV block.
    pub block_size: usize,
    /// Longest sequence (prompt + output) the ring slots hold.
    pub max_model_len: usize,
    /// Host KV blocks per layer; `None` = enough for `max_model_len`.
    pub num_cpu_blocks: Option<usize>,
    /// Simulated host↔device link, GB/s (0 = unthrottled).
    pub link_gbps: f64,
    /// Poison released slots with NaN and delay copies at random.
    pub sanitize: bool,
    pub drop_wait: Option<DropWait>,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        Self {
            num_kv_buffers: 4,
            block_size: 256,
            max_model_len: 4096,
            num_cpu_blocks: None,
            link_gbps: 0.0,
            sanitize: false,
            drop_wait: None,
        }
    }
}

/// Bytes the engine will allocate, printed before it does.
#[derive(Debug, Clone, Copy)]
pub struct MemoryPlan {
    pub slot_tokens: usize,
    pub num_cpu_blocks: usize,
    pub ring_bytes: usize,
    pub decode_buffer_bytes: usize,
    pub host_kv_bytes: usize,
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        write!(
            f,
            "offload memory plan: device ring {:.1} MiB ({} tokens per slot), decode buffer {:.1} MiB, host KV {:.1} MiB ({} blocks per layer)",
            mib(self.ring_bytes),
            self.slot_tokens,
            mib(self.decode_buffer_bytes),
            mib(self.host_kv_bytes),
            self.num_cpu_blocks
        )
    }
}

impl OffloadConfig {
    /// Checks the settings against the model and sizes every buffer (f32, the CPU device).
    pub fn plan(&self, model: &ModelConfig) -> Result<MemoryPlan> {
        self.plan_for(model, 4)
    }

    /// As `plan`, for KV elements of `elem_bytes` (2: bf16 on the CUDA device).
    pub fn plan_for(&self, model: &ModelConfig, elem_bytes: usize) -> Result<MemoryPlan> {
        use crate::flags::MAX_KV_BUFFERS;
        if !(2..=MAX_KV_BUFFERS).contains(&self.num_kv_buffers) {
            bail!("--num-kv-buffers must be in 2..={MAX_KV_BUFFERS} (one slot computes while the next loads), got {}", self.num_kv_buffers);
        }
        if self.block_size == 0 {
            bail!("--block-size must be at least 1");
        }
        if self.max_model_len == 0 {
            bail!("--max-model-len must be at least 1");
        }
        if self.block_size > MAX_BLOCK_SIZE {
            bail!(
                "--block-size {} is too large (at most {MAX_BLOCK_SIZE} tokens)",
                self.block_size
            );
        }
        if !(self.link_gbps >= 0.0 && self.link_gbps.is_finite()) {
            bail!("--sim-link-gbps must be a finite number >= 0");
        }
        let blocks_needed = self.max_model_len.div_ceil(self.block_size);
        let num_cpu_blocks = self.num_cpu_blocks.unwrap_or(blocks_needed);
        if num_cpu_blocks == 0 {
            bail!("--num-cpu-blocks must be at least 1");
        }
        // Every size below is formed from flags: checked, so a product that would wrap is
        // reported as too large instead of passing the memory check as a small number.
        let too_large = || {
            anyhow::anyhow!("the offload buffers' sizes overflow: lower --max-model-len, --num-cpu-blocks or --block-size")
        };
        let mul = |a: usize, b: usize| a.checked_mul(b).ok_or_else(too_large);
        let slot_tokens = mul(blocks_needed, self.block_size)?;
        let row_bytes = mul(model.kv_dim(), elem_bytes)?;
        let kv = 2; // K and V
        let block_bytes = mul(mul(kv, self.block_size)?, row_bytes)?;
        let decode_buffer_bytes = mul(model.num_layers, block_bytes)?;
        let host_kv_bytes = mul(decode_buffer_bytes, num_cpu_blocks)?;
        let ring_bytes = mul(mul(kv * self.num_kv_buffers, slot_tokens)?, row_bytes)?;
        // Linux overcommits: a too-large allocation "succeeds" and the OOM killer strikes
        // when it is touched. Refuse up front a host KV that cannot fit.
        if let Some(avail) = available_memory_bytes() {
            if host_kv_bytes as u64 > avail {
                let gib = |b: f64| b / (1u64 << 30) as f64;
                bail!(
                    "host KV needs {:.2} GiB but only {:.2} GiB of memory is available; lower --num-cpu-blocks or --max-model-len",
                    gib(host_kv_bytes as f64),
                    gib(avail as f64)
                );
            }
        }
        Ok(MemoryPlan {
            slot_tokens,
            num_cpu_blocks,
            ring_bytes,
            decode_buffer_bytes,
            host_kv_bytes,
        })
    }
}

/// Per-slot events.
struct SlotEvents {
    ready: Event,        // H2D prefetch done
    compute_done: Event, // last compute reading/writing the slot done
    offload_done: Event, // D2H offload reading the slot done
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Idle,
    Prefill { tokens: usize },
    Decode { pos: usize },
}

pub struct OffloadEngine {
    cfg: OffloadConfig,
    plan: MemoryPlan,
    dev: Arc<CpuDevice>,
    num_layers: usize,
    row: usize,
    depth: usize,
    host_k: Buffer, // [num_layers, num_cpu_blocks, block_size, row]
    host_v: Buffer,
    ring_k: Vec<Buffer>, // num_kv_buffers × [slot_tokens, row]
    ring_v: Vec<Buffer>,
    dbuf_k: Buffer, // [num_layers, block_size, row]
    dbuf_v: Buffer,
    compute: Stream,
    prefetch: Stream,
    offload: Vec<Stream>,
    slots: Vec<SlotEvents>,
    layer_stored: Vec<Event>,
    ring: Ring,
    /// Layers of the next decode step already prefetched (during this step's tail).
    ahead: usize,
    /// Launch gate of the step being enqueued: the compute stream holds until the host has
    /// queued the whole step (see `begin_step`).
    gate: Option<(Event, u64)>,
    /// Tokens whose KV is stored (host blocks + decode buffer).
    seq_len: usize,
    step: Step,
}

impl OffloadEngine {
    pub fn new(model: &ModelConfig, cfg: OffloadConfig) -> Result<Self> {
        let plan = cfg.plan(model)?;
        let dev = CpuDevice::new(cfg.link_gbps, cfg.sanitize);
        let row = model.kv_dim();
        let (l, bs) = (model.num_layers, cfg.block_size);
        let host_len = l * plan.num_cpu_blocks * bs * row;
        let host_k = Buffer::alloc(host_len, MemSpace::Host)?;
        let host_v = Buffer::alloc(host_len, MemSpace::Host)?;
        let slot = |_| Buffer::alloc(plan.slot_tokens * row, MemSpace::Device);
        let ring_k = (0..cfg.num_kv_buffers)
            .map(slot)
            .collect::<Result<Vec<_>>>()?;
        let ring_v = (0..cfg.num_kv_buffers)
            .map(slot)
            .collect::<Result<Vec<_>>>()?;
        let dbuf_k = Buffer::alloc(l * bs * row, MemSpace::Device)?;
        let dbuf_v = Buffer::alloc(l * bs * row, MemSpace::Device)?;
        let mut engine = Self {
            depth: (cfg.num_kv_buffers - 1).min(l),
            compute: Stream::new(&dev, "compute"),
            prefetch: Stream::new(&dev, "h2d-prefetch"),
            offload: (0..OFFLOAD_STREAMS)
                .map(|i| Stream::new(&dev, &format!("d2h-offload-{i}")))
                .collect(),
            slots: Vec::new(),
            layer_stored: Vec::new(),
            ring: Ring::new(cfg.num_kv_buffers, l),
            ahead: 0,
            gate: None,
            seq_len: 0,
            step: Step::Idle,
            num_layers: l,
            row,
            host_k,
            host_v,
            ring_k,
            ring_v,
            dbuf_k,
            dbuf_v,
            cfg,
            plan,
            dev,
        };
        engine.reset()?;
        Ok(engine)
    }

    pub fn plan(&self) -> MemoryPlan {
        self.plan
    }

    /// Tokens one request may hold: the smaller of the ring slot and the host KV.
    pub fn capacity(&self) -> usize {
        self.cfg
            .max_model_len
            .min(self.plan.num_cpu_blocks * self.cfg.block_size)
    }

    pub fn device(&self) -> &Arc<CpuDevice> {
        &self.dev
    }

    fn host_off(&self, layer: usize, block: usize) -> usize {
        (layer * self.plan.num_cpu_blocks + block) * self.cfg.block_size * self.row
    }

    fn dbuf_off(&self, layer: usize) -> usize {
        layer * self.cfg.block_size * self.row
    }

    fn offload_stream(&self, layer: usize) -> &Stream {
        &self.offload[layer % self.offload.len()]
    }

    /// Makes `stream` wait for whatever the previous user of `slot` left in flight.
    fn wait_released(&self, stream: &Stream, slot: usize, after: ReleasedAfter) {
        match after {
            ReleasedAfter::Nothing => {}
            ReleasedAfter::Compute => {
                stream.wait(&self.slots[slot].compute_done, "slot-compute-done")
            }
            ReleasedAfter::Offload => {
                stream.wait(&self.slots[slot].offload_done, "slot-offload-done")
            }
        }
    }

    /// Decode: queue the H2D of `layer`'s full host blocks (`0..full_blocks`) into its slot
    /// for this step, or for the next step when `next_step`.
    fn prefetch_layer(&mut self, layer: usize, full_blocks: usize, next_step: bool) -> Result<()> {
        let (s, after) = self.ring.begin_load(layer, next_step)?;
        let p = &self.prefetch;
        self.wait_released(p, s, after);
        p.wait(&self.layer_stored[layer], "layer-stored");
        let len = full_blocks * self.cfg.block_size * self.row;
        if len > 0 {
            let off = self.host_off(layer, 0);
            p.copy(
                "h2d-k",
                Some(layer),
                &self.host_k,
                off,
                &self.ring_k[s],
                0,
                len,
            );
            p.copy(
                "h2d-v",
                Some(layer),
                &self.host_v,
                off,
                &self.ring_v[s],
                0,
                len,
            );
        }
        p.record(&self.slots[s].ready);
        Ok(())
    }

    /// After `layer` is queued: prefetch `depth` layers ahead, running on into the next
    /// decode step (at position `next_pos`) so the link stays busy across step boundaries.
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

    /// NaN over `tokens` rows of slot `s`, queued on `stream` (sanitizer).
    fn poison_slot(&self, stream: &Stream, s: usize, layer: usize, tokens: usize) {
        let len = tokens * self.row;
        stream.fill("poison-k", Some(layer), &self.ring_k[s], 0, len, f32::NAN);
        stream.fill("poison-v", Some(layer), &self.ring_v[s], 0, len, f32::NAN);
    }

    /// Releases the step queued since `begin_step`.
    fn open_gate(&mut self) {
        if let Some((gate, n)) = self.gate.take() {
            gate.complete_on_host(n);
        }
    }

    fn synchronize_all(&mut self) {
        self.open_gate();
        self.compute.synchronize();
        self.prefetch.synchronize();
        for o in &self.offload {
            o.synchronize();
        }
    }
}

impl KvView for OffloadEngine {
    /// Waits for every stream, forgets the previous request and (sanitizer) poisons all
    /// KV memory so that anything it leaked would show.
    fn reset(&mut self) -> Result<()> {
        self.synchronize_all();
        self.ring.reset();
        self.ahead = 0;
        self.seq_len = 0;
        self.step = Step::Idle;
        self.slots = (0..self.cfg.num_kv_buffers)
            .map(|_| SlotEvents {
                ready: Event::new(),
                compute_done: Event::new(),
                offload_done: Event::new(),
            })
            .collect();
        self.layer_stored = (0..self.num_layers).map(|_| Event::new()).collect();
        if self.cfg.sanitize {
            for b in [&self.host_k, &self.host_v, &self.dbuf_k, &self.dbuf_v]
                .into_iter()
                .chain(&self.ring_k)
                .chain(&self.ring_v)
            {
                // SAFETY: every stream is idle (synchronized above).
                unsafe { b.slice_mut().fill(f32::NAN) };
            }
        }
        Ok(())
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
        // Launch the step as a whole, like a CUDA graph: the compute stream waits until the
        // host has queued every layer. On a CPU device with few cores the compute threads
        // would otherwise starve the host thread, and prefetches queued "ahead" would reach
        // the copy stream only as each layer ends, which serializes transfer and compute.
        let gate = Event::new();
        let n = gate.record_on_host();
        self.compute.wait(&gate, "host-enqueue");
        self.gate = Some((gate, n));
        if let Step::Decode { pos } = self.step {
            // Layers not already prefetched during the previous step's tail.
            let full = pos / self.cfg.block_size;
            for layer in self.ahead..self.depth {
                self.prefetch_layer(layer, full, false)?;
            }
        }
        self.ahead = 0;
        Ok(())
    }

    fn run(&mut self, name: &'static str, work: Work) -> Result<()> {
        self.compute.launch(
            crate::device::cpu::stream::OpInfo {
                name,
                layer: None,
                bytes: 0,
            },
            work,
        );
        Ok(())
    }

    fn begin_layer(&mut self, layer: usize) -> Result<()> {
        let c = &self.compute;
        match self.step {
            Step::Prefill { .. } => {
                let (s, after) = self.ring.begin_prefill_compute(layer)?;
                if self.cfg.drop_wait != Some(DropWait::PrefillSlotReuse) {
                    self.wait_released(c, s, after);
                }
            }
            Step::Decode { .. } => {
                let s = self.ring.begin_decode_compute(layer)?;
                if self.cfg.drop_wait != Some(DropWait::DecodeSlotReady) {
                    c.wait(&self.slots[s].ready, "slot-ready");
                }
                // The decode buffer of this layer may still be written by an offload stream.
                c.wait(&self.layer_stored[layer], "layer-stored");
            }
            Step::Idle => bail!("offload engine: begin_layer outside a step"),
        }
        Ok(())
    }

    fn run_layer(
        &mut self,
        layer: usize,
        pos0: usize,
        tokens: usize,
        work: LayerWork,
    ) -> Result<()> {
        let s = self.ring.slot_of(layer);
        let (k, v) = (self.ring_k[s].clone(), self.ring_v[s].clone());
        let info = crate::device::cpu::stream::OpInfo {
            name: "layer",
            layer: Some(layer),
            bytes: 0,
        };
        let bs = self.cfg.block_size;
        match self.step {
            Step::Prefill { tokens: t } if pos0 == 0 && tokens == t => {
                // SAFETY: the compute stream owns the slot from begin_layer to end_layer.
                self.compute.launch(info, move || work(unsafe { LayerKv { k: k.slice_mut(), v: v.slice_mut() } }));
            }
            Step::Decode { pos } if pos0 == pos && tokens == 1 => {
                // The slot holds the host's full blocks; append the partial block from the
                // decode buffer so the attention sees one contiguous context.
                let (r, base, d) = (pos % bs, pos - pos % bs, self.dbuf_off(layer));
                let c = &self.compute;
                if r > 0 {
                    c.copy("dbuf-to-slot-k", Some(layer), &self.dbuf_k, d, &k, base * self.row, r * self.row);
                    c.copy("dbuf-to-slot-v", Some(layer), &self.dbuf_v, d, &v, base * self.row, r * self.row);
                }
                let (k2, v2) = (k.clone(), v.clone());
                // SAFETY: as above.
                c.launch(info, move || work(unsafe { LayerKv { k: k2.slice_mut(), v: v2.slice_mut() } }));
                // The new token's K/V joins the decode buffer.
                let at = d + r * self.row;
                c.copy("slot-to-dbuf-k", Some(layer), &k, pos * self.row, &self.dbuf_k, at, self.row);
                c.copy("slot-to-dbuf-v", Some(layer), &v, pos * self.row, &self.dbuf_v, at, self.row);
            }
            step => bail!("offload engine: layer {layer} run at position {pos0} with {tokens} tokens during {step:?}"),
        }
        Ok(())
    }

    fn end_layer(&mut self, layer: usize) -> Result<()> {
        let bs = self.cfg.block_size;
        let s = self.ring.slot_of(layer);
        match self.step {
            Step::Prefill { tokens } => {
                self.ring.end_compute(layer)?;
                self.compute.record(&self.slots[s].compute_done);
                // Offload this layer's KV while the next layers compute.
                let o = self.offload_stream(layer);
                o.wait(&self.slots[s].compute_done, "slot-compute-done");
                let (full, rem) = (tokens / bs, tokens % bs);
                let len = full * bs * self.row;
                if len > 0 {
                    let off = self.host_off(layer, 0);
                    o.copy(
                        "d2h-k",
                        Some(layer),
                        &self.ring_k[s],
                        0,
                        &self.host_k,
                        off,
                        len,
                    );
                    o.copy(
                        "d2h-v",
                        Some(layer),
                        &self.ring_v[s],
                        0,
                        &self.host_v,
                        off,
                        len,
                    );
                }
                if rem > 0 {
                    let d = self.dbuf_off(layer);
                    o.copy(
                        "slot-to-dbuf-k",
                        Some(layer),
                        &self.ring_k[s],
                        len,
                        &self.dbuf_k,
                        d,
                        rem * self.row,
                    );
                    o.copy(
                        "slot-to-dbuf-v",
                        Some(layer),
                        &self.ring_v[s],
                        len,
                        &self.dbuf_v,
                        d,
                        rem * self.row,
                    );
                }
                if self.cfg.sanitize {
                    self.poison_slot(o, s, layer, tokens);
                }
                o.record(&self.slots[s].offload_done);
                o.record(&self.layer_stored[layer]);
                self.prefetch_after(layer, tokens)?;
            }
            Step::Decode { pos } => {
                if self.cfg.sanitize {
                    self.poison_slot(&self.compute, s, layer, pos + 1);
                }
                self.ring.end_compute(layer)?;
                self.compute.record(&self.slots[s].compute_done);
                let (full, r) = (pos / bs, pos % bs);
                if r + 1 == bs {
                    // The decode buffer filled a block: move it to the host, by event.
                    let o = self.offload_stream(layer);
                    o.wait(&self.slots[s].compute_done, "slot-compute-done");
                    let (d, h) = (self.dbuf_off(layer), self.host_off(layer, full));
                    o.copy(
                        "d2h-flush-k",
                        Some(layer),
                        &self.dbuf_k,
                        d,
                        &self.host_k,
                        h,
                        bs * self.row,
                    );
                    o.copy(
                        "d2h-flush-v",
                        Some(layer),
                        &self.dbuf_v,
                        d,
                        &self.host_v,
                        h,
                        bs * self.row,
                    );
                    o.record(&self.layer_stored[layer]);
                }
                self.prefetch_after(layer, pos + 1)?;
            }
            Step::Idle => bail!("offload engine: end_layer outside a step"),
        }
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        self.open_gate();
        self.compute.synchronize();
        Ok(())
    }
}

/// `MemAvailable` from /proc/meminfo, where there is one.
pub fn available_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

impl Drop for OffloadEngine {
    fn drop(&mut self) {
        self.synchronize_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CUDA device keeps KV in bf16: every buffer is half the CPU device's.
    #[test]
    fn bf16_plan_is_half_of_f32() {
        let model = crate::model::random::Shape::tiny().config();
        let cfg = OffloadConfig {
            max_model_len: 1000,
            ..OffloadConfig::default()
        };
        let (f, b) = (cfg.plan(&model).unwrap(), cfg.plan_for(&model, 2).unwrap());
        assert_eq!(f.slot_tokens, b.slot_tokens);
        assert_eq!(f.ring_bytes, 2 * b.ring_bytes);
        assert_eq!(f.decode_buffer_bytes, 2 * b.decode_buffer_bytes);
        assert_eq!(f.host_kv_bytes, 2 * b.host_kv_bytes);
        // 4 slots × K and V × 1024 tokens × kv_dim 128 × 2 bytes.
        assert_eq!(b.ring_bytes, 4 * 2 * 1024 * 128 * 2);
    }
}
