//! Layerwise KV offload: the whole KV cache lives in host memory; a ring of
//! `num_kv_buffers` per-layer device slots is filled by asynchronous H2D prefetch (decode)
//! and drained by asynchronous D2H offload (prefill), all ordered by events.
//!
//! Memory (elements of `--kv-dtype` on the CPU device, bf16 on CUDA; `row` = kv_heads ·
//! head_dim):
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
pub mod checked;
pub mod cpu_device;
pub mod cuda_device;
pub mod device;
pub mod engine;
pub mod experts;
pub mod ring;
pub mod trace;

use anyhow::{bail, Result};

use crate::device::KvElem;
use crate::model::ModelConfig;
use crate::sparse::SparseConfig;
pub use cpu_device::CpuOffloadDevice;
pub use engine::{OffloadControl, OffloadEngine, OffloadKv};

/// Largest block: the decode buffer holds one block per layer on the device.
pub const MAX_BLOCK_SIZE: usize = 16384;

/// The engine on the CPU device with f32 KV, the reference (`OffloadEngine::on_cpu` makes
/// it for any element: what `strata generate --enable-offload` runs).
pub type CpuOffloadEngine = OffloadEngine<CpuOffloadDevice<f32>>;

impl<T: KvElem> OffloadEngine<CpuOffloadDevice<T>> {
    /// On a new CPU device set up from `cfg` (link throttle, sanitizer).
    pub fn on_cpu(model: &ModelConfig, cfg: OffloadConfig) -> Result<Self> {
        let d = CpuOffloadDevice::new(cfg.link_gbps, cfg.sanitize, engine::OFFLOAD_STREAMS)?;
        OffloadEngine::new(d, model, cfg)
    }

    /// The CPU device's simulated link speed from now on (GB/s, 0 = unthrottled), once
    /// the copies queued so far are done (`strata bench offload` re-sizes it each round).
    pub fn set_link_gbps(&mut self, gbps: f64) {
        self.device_mut().set_link_gbps(gbps);
    }
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
    /// Poison released slots with NaN and delay copies at random (also turns the
    /// stream-ordering checker on).
    pub sanitize: bool,
    /// Prove every cross-stream access ordered (`crate::device::order`).
    pub check_order: bool,
    /// Sparse decode: attend (and load) only the best pages up to a budget.
    pub sparse: Option<SparseConfig>,
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
            check_order: crate::device::order::on_by_default(),
            sparse: None,
        }
    }
}

/// Host KV blocks layer `l` keeps for a context of `num_cpu_blocks` blocks: all of them for
/// a full-attention layer; for a sliding-window layer a ring (the sequence's block `b` at
/// `b % n`) of the blocks its window can reach — `⌈(window − 1) / block_size⌉` full blocks
/// before the one filling in the decode buffer — plus one, so that a rewind inside the
/// last block (sparse decode's rejected drafts) still finds its window.
pub fn host_blocks(
    model: &ModelConfig,
    l: usize,
    num_cpu_blocks: usize,
    block_size: usize,
) -> usize {
    if !model.keeps_kv(l) {
        return 0; // a state layer: its recurrent state stays with the compute
    }
    match model.window(l) {
        None => num_cpu_blocks,
        Some(w) => ((w - 1).div_ceil(block_size) + 1).min(num_cpu_blocks),
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
    /// Sliding-window layers and the host blocks each keeps (0, 0 without windows).
    pub windowed_layers: usize,
    pub window_blocks: usize,
    /// State layers, and the bytes of one sequence's recurrent states in all of them
    /// (kept with the compute, never offloaded; 0, 0 without state layers).
    pub state_layers: usize,
    pub state_bytes: usize,
    /// Sparse decode's metadata on the device: page bounds (min and max of K per layer,
    /// page and channel) and one layer's per-head scores (f32 `[pages, num_heads]`, the
    /// CUDA device's download buffer).
    pub page_bounds_bytes: usize,
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        write!(
            f,
            "offload memory plan: device ring {:.1} MiB ({} tokens per slot), decode buffer {:.1} MiB, host KV {:.1} MiB ({} blocks per layer",
            mib(self.ring_bytes),
            self.slot_tokens,
            mib(self.decode_buffer_bytes),
            mib(self.host_kv_bytes),
            self.num_cpu_blocks
        )?;
        if self.windowed_layers > 0 {
            write!(
                f,
                "; {} sliding-window layers hold {} blocks each, their window",
                self.windowed_layers, self.window_blocks
            )?;
        }
        if self.state_layers > 0 {
            write!(
                f,
                "; {} state layers hold no KV but a {:.1} MiB recurrent state, kept with the compute",
                self.state_layers,
                mib(self.state_bytes)
            )?;
        }
        write!(f, ")")?;
        if self.page_bounds_bytes > 0 {
            write!(
                f,
                ", sparse page metadata {:.1} MiB",
                mib(self.page_bounds_bytes)
            )?;
        }
        Ok(())
    }
}

impl OffloadConfig {
    /// Checks the settings against the model and sizes every buffer, for KV elements of
    /// `elem_bytes` (`KvDtype::bytes`: 4 for f32, 2 for bf16 and f16).
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
        if !crate::flags::link_gbps_in_range(self.link_gbps) {
            bail!(
                "--sim-link-gbps must be 0 (unthrottled) or in {}..={} GB/s, got {}",
                crate::flags::MIN_LINK_GBPS,
                crate::flags::MAX_LINK_GBPS,
                self.link_gbps
            );
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
        let decode_buffer_bytes = model
            .kv_bytes(self.block_size, elem_bytes)
            .ok_or_else(too_large)?;
        let total_host_blocks: usize = (0..model.num_layers)
            .map(|l| host_blocks(model, l, num_cpu_blocks, self.block_size))
            .sum();
        let block_bytes = model
            .kv_layer_bytes(self.block_size, elem_bytes)
            .ok_or_else(too_large)?;
        let host_kv_bytes = mul(block_bytes, total_host_blocks)?;
        let states = crate::kv::RecurrentStates::for_model(model);
        if self.sparse.is_some() && states.any() {
            bail!("--sparse-budget: sparse decode verifies drafts by rewinding, which a state layer's recurrence cannot (this model has state layers)");
        }
        let windowed: Vec<usize> = (0..model.num_layers)
            .filter(|&l| model.window(l).is_some())
            .collect();
        let slot_bytes = model
            .kv_layer_bytes(slot_tokens, elem_bytes)
            .ok_or_else(too_large)?;
        let ring_bytes = mul(self.num_kv_buffers, slot_bytes)?;
        let page_bounds_bytes = match &self.sparse {
            None => 0,
            Some(sc) => {
                sc.check(self.block_size)?;
                // [num_layers, pages, min | max | mask rows, row], and f32 [pages, num_heads]
                let pages = mul(num_cpu_blocks, self.block_size)? / sc.page_size;
                let per_page = mul(sc.meta_rows(), row_bytes)?;
                let bounds = mul(mul(model.num_layers, pages)?, per_page)?;
                let scores = mul(mul(pages, model.num_heads)?, 4)?;
                bounds.checked_add(scores).ok_or_else(too_large)?
            }
        };
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
            windowed_layers: windowed.len(),
            window_blocks: windowed
                .iter()
                .map(|&l| host_blocks(model, l, num_cpu_blocks, self.block_size))
                .max()
                .unwrap_or(0),
            state_layers: (0..model.num_layers)
                .filter(|&l| !model.keeps_kv(l))
                .count(),
            state_bytes: states.seq_bytes(),
            page_bounds_bytes,
        })
    }
}

/// `MemAvailable` from /proc/meminfo, where there is one.
pub fn available_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
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
        let (f, b) = (
            cfg.plan_for(&model, 4).unwrap(),
            cfg.plan_for(&model, 2).unwrap(),
        );
        assert_eq!(f.slot_tokens, b.slot_tokens);
        assert_eq!(f.ring_bytes, 2 * b.ring_bytes);
        assert_eq!(f.decode_buffer_bytes, 2 * b.decode_buffer_bytes);
        assert_eq!(f.host_kv_bytes, 2 * b.host_kv_bytes);
        // 4 slots × K and V × 1024 tokens × kv_dim 128 × 2 bytes.
        assert_eq!(b.ring_bytes, 4 * 2 * 1024 * 128 * 2);
    }
}
