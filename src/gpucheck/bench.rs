//! Steps 4 and 5 of `scripts/gpu-check.sh`: the pinned-memory bandwidth sweep, and the
//! offload benchmark on a Qwen3-4B-shaped model with random weights.
//!
//! The benchmark runs `layers` (default 8) of Qwen3-4B's 36 identical layers, all sharing
//! one set of random weights: every figure it checks is a ratio per layer (decode step vs
//! its KV transfer time, prefill with vs without offload, copy rate vs peak), so fewer
//! layers change none of them and keep the 32K prefills inside the time budget; absolute
//! times and memory are also given scaled to 36 layers.

use crate::device::cpu::stream::TraceEvent;
use crate::device::cuda::context::CudaDevice;
use crate::device::cuda::exec::{CudaExec, Exec};
use crate::device::cuda::ops::{dtoh, htod, mem_used};
use crate::engine::sampler::argmax;
use crate::kv::cuda::ResidentKv;
use crate::kv::KvCache;
use crate::model::cuda::weights::CudaWeights;
use crate::model::cuda::CudaModel;
use crate::model::random::Shape;
use crate::offload::cuda_device::offload_engine;
use crate::offload::{OffloadConfig, OffloadControl};
use crate::sparse::{SparseConfig, DEFAULT_PAGE_SIZE};
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{sys, CudaEvent, CudaStream};
use half::bf16;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;
/// Tokens of the warm-up run (512-token prompt and a few decode steps).
const WARM_CAP: usize = 600;

/// 64 KB, 256 KB, …, 256 MB.
pub fn sweep_sizes() -> Vec<usize> {
    (0..7).map(|i| (64 * KB) << (2 * i)).collect()
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BwRow {
    pub bytes: usize,
    pub h2d_gbps: f64,
    pub d2h_gbps: f64,
}

fn timed(dev: &CudaDevice) -> Result<CudaEvent> {
    dev.context()
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| anyhow!("cuEventCreate failed: {e:?}"))
}

/// Seconds taken by `f`'s work queued on `st`, between two timed events.
fn time_on(dev: &CudaDevice, st: &Arc<CudaStream>, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let (a, b) = (timed(dev)?, timed(dev)?);
    a.record(st).map_err(|e| anyhow!("{e:?}"))?;
    f()?;
    b.record(st).map_err(|e| anyhow!("{e:?}"))?;
    Ok(a.elapsed_ms(&b).map_err(|e| anyhow!("{e:?}"))? as f64 / 1e3)
}

/// Pinned (non write-combined) host ↔ device copy rate by size, one copy at a time on one
/// stream, as the offload engine issues them. Repeats: ~1 GiB per size, 3 to 64 copies.
pub fn bandwidth_sweep(dev: &CudaDevice, sizes: &[usize]) -> Result<Vec<BwRow>> {
    let max = *sizes.iter().max().ok_or_else(|| anyhow!("no sizes"))?;
    let st = dev.new_stream()?;
    let mut host = dev.alloc_pinned::<u8>(max)?;
    let hp = host.as_mut_ptr().map_err(|e| anyhow!("{e:?}"))?;
    let dbuf = dev.alloc_zeros::<u8>(&st, max)?;
    let dp = crate::device::cuda::ops::dptr(&dbuf, &st);
    let mut rows = Vec::new();
    for &n in sizes {
        let reps = (1024 * MB / n).clamp(3, 64);
        // SAFETY: both buffers hold `max` ≥ n bytes and outlive the synchronous timing.
        let h2d = |r: usize| {
            time_on(dev, &st, || {
                for _ in 0..r {
                    unsafe { htod(&st, dp, hp, n)? };
                }
                Ok(())
            })
        };
        let d2h = |r: usize| {
            time_on(dev, &st, || {
                for _ in 0..r {
                    unsafe { dtoh(&st, hp, dp, n)? };
                }
                Ok(())
            })
        };
        h2d(1)?; // warm-up
        d2h(1)?;
        let gbps = |secs: f64| (n * reps) as f64 / secs.max(1e-12) / 1e9;
        rows.push(BwRow {
            bytes: n,
            h2d_gbps: gbps(h2d(reps)?),
            d2h_gbps: gbps(d2h(reps)?),
        });
    }
    Ok(rows)
}

fn size_str(b: usize) -> String {
    if b >= MB {
        format!("{} MB", b / MB)
    } else {
        format!("{} KB", b / KB)
    }
}

pub fn format_bandwidth(rows: &[BwRow]) -> String {
    let mut s = format!(
        "{:>10} {:>12} {:>12}\n",
        "copy size", "H2D GB/s", "D2H GB/s"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:>10} {:>12.1} {:>12.1}",
            size_str(r.bytes),
            r.h2d_gbps,
            r.d2h_gbps
        );
    }
    s
}

pub fn peak_h2d(rows: &[BwRow]) -> f64 {
    rows.iter().map(|r| r.h2d_gbps).fold(0.0, f64::max)
}

#[derive(Debug, Clone)]
pub struct BenchArgs {
    pub layers: usize,
    pub contexts: Vec<usize>,
    pub decode_steps: usize,
    pub num_kv_buffers: usize,
    pub block_size: usize,
}

impl Default for BenchArgs {
    fn default() -> Self {
        Self {
            layers: 8,
            contexts: vec![4096, 8192, 32768],
            decode_steps: 16,
            num_kv_buffers: 4,
            block_size: 256,
        }
    }
}

/// One context length, both ways.
#[derive(Debug, Clone, Default)]
pub struct BenchRow {
    pub context: usize,
    pub prefill_s_resident: f64,
    pub prefill_s_offload: f64,
    pub step_ms_resident: f64,
    pub step_ms_offload: f64,
    /// Host → device KV bytes of one decode step (every layer's full blocks, K and V).
    pub kv_bytes_per_step: usize,
    /// Those bytes at the peak measured pinned H2D rate.
    pub ideal_step_ms: f64,
    pub largest_copy_bytes: usize,
    pub largest_copy_gbps: f64,
    pub kv_mem_resident: usize,
    pub kv_mem_offload: usize,
    /// Sparse decode at a budget of 1/8 of the context (`SPARSE_FRACTION`), pages of 16:
    /// its decode step and its prefetch hit rate.
    pub step_ms_sparse: f64,
    pub sparse_hit_rate: f64,
}

/// Sparse decode's budget in the benchmark: this fraction of the context (issue #15's
/// 3× goal is stated at 1/8).
pub const SPARSE_FRACTION: usize = 8;

#[derive(Debug, Clone, Default)]
pub struct BenchReport {
    pub layers: usize,
    pub peak_h2d_gbps: f64,
    pub weights_bytes: usize,
    pub rows: Vec<BenchRow>,
}

/// (what, value, goal, met).
pub type Goal = (String, f64, String, bool);

impl BenchReport {
    pub fn goals(&self) -> Vec<Goal> {
        let mut g = Vec::new();
        for r in &self.rows {
            let k = r.context / 1024;
            let dr = r.step_ms_offload / r.ideal_step_ms.max(1e-12);
            g.push((
                format!("{k}K decode step / (KV bytes ÷ peak H2D)"),
                dr,
                "≤ 1.15".into(),
                dr <= 1.15,
            ));
            let share = r.largest_copy_gbps / self.peak_h2d_gbps.max(1e-12);
            g.push((
                format!(
                    "{k}K largest copies ({}) share of peak",
                    size_str(r.largest_copy_bytes)
                ),
                share,
                "≥ 0.85".into(),
                share >= 0.85,
            ));
            let sp = r.step_ms_offload / r.step_ms_sparse.max(1e-12);
            g.push((
                format!("{k}K sparse 1/{SPARSE_FRACTION} decode speedup vs full loading"),
                sp,
                "≥ 3".into(),
                sp >= 3.0,
            ));
        }
        if let Some(r) = self.rows.iter().max_by_key(|r| r.context) {
            let pr = r.prefill_s_offload / r.prefill_s_resident.max(1e-12);
            g.push((
                format!("{}K prefill offload / resident", r.context / 1024),
                pr,
                "≤ 1.05".into(),
                pr <= 1.05,
            ));
        }
        g
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scale = 36.0 / self.layers.max(1) as f64;
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        writeln!(
            f,
            "Qwen3-4B-shaped, random weights, {} of 36 layers (times and KV memory ×{scale:.2} for 36); peak pinned H2D {:.1} GB/s",
            self.layers, self.peak_h2d_gbps
        )?;
        writeln!(
            f,
            "{:>6} {:>11} {:>11} {:>10} {:>10} {:>10} {:>10} {:>11} {:>11} {:>11}",
            "ctx",
            "prefill s",
            "prefill s",
            "step ms",
            "step ms",
            "step ms",
            "ideal ms",
            "KV/step",
            "KV GiB",
            "KV GiB"
        )?;
        writeln!(
            f,
            "{:>6} {:>11} {:>11} {:>10} {:>10} {:>10} {:>10} {:>11} {:>11} {:>11}",
            "",
            "resident",
            "offload",
            "resident",
            "offload",
            format!("sparse1/{SPARSE_FRACTION}"),
            "(H2D)",
            "MiB",
            "resident",
            "offload"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:>6} {:>11.3} {:>11.3} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>11.1} {:>11.2} {:>11.2}",
                format!("{}K", r.context / 1024),
                r.prefill_s_resident,
                r.prefill_s_offload,
                r.step_ms_resident,
                r.step_ms_offload,
                r.step_ms_sparse,
                r.ideal_step_ms,
                r.kv_bytes_per_step as f64 / MB as f64,
                gib(r.kv_mem_resident),
                gib(r.kv_mem_offload),
            )?;
        }
        for r in &self.rows {
            writeln!(
                f,
                "{}K sparse 1/{SPARSE_FRACTION}: prefetch hit rate {:.1}%",
                r.context / 1024,
                r.sparse_hit_rate * 100.0
            )?;
            writeln!(
                f,
                "{}K, 36 layers (scaled): prefill {:.2} s → {:.2} s with offload, decode step {:.1} → {:.1} ms, KV on the GPU {:.2} GiB → {:.2} GiB (ring does not scale with layers)",
                r.context / 1024,
                r.prefill_s_resident * scale,
                r.prefill_s_offload * scale,
                r.step_ms_resident * scale,
                r.step_ms_offload * scale,
                gib(r.kv_mem_resident) * scale,
                gib(r.kv_mem_offload),
            )?;
        }
        for (what, v, goal, met) in self.goals() {
            writeln!(
                f,
                "goal {:<52} {v:>7.3} {goal:<7} {}",
                what,
                if met { "met" } else { "MISSED" }
            )?;
        }
        Ok(())
    }
}

/// Largest H2D prefetch copies in a trace: (bytes, mean GB/s over those copies).
pub fn largest_copies(events: &[TraceEvent]) -> (usize, f64) {
    let h2d: Vec<&TraceEvent> = events
        .iter()
        .filter(|e| e.name.starts_with("h2d"))
        .collect();
    let big = h2d.iter().map(|e| e.bytes).max().unwrap_or(0);
    let (bytes, secs) = h2d
        .iter()
        .filter(|e| e.bytes == big)
        .fold((0usize, 0.0f64), |(b, s), e| {
            (b + e.bytes, s + (e.end_us - e.start_us) / 1e6)
        });
    (big, bytes as f64 / secs.max(1e-12) / 1e9)
}

struct Timing {
    prefill_s: f64,
    step_ms: f64,
    kv_mem: usize,
}

/// Prefill `prompt`, 2 warm-up decode steps, then `steps` timed ones.
fn run_once(
    model: &mut CudaModel,
    kv: &mut dyn KvCache<bf16>,
    prompt: &[u32],
    steps: usize,
    kv_mem: usize,
) -> Result<Timing> {
    kv.reset()?;
    let t0 = Instant::now();
    let logits = model.forward(prompt, 0, kv)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut next = argmax(&logits);
    let mut t1 = Instant::now();
    for (i, pos) in (prompt.len()..prompt.len() + steps + 2).enumerate() {
        if i == 2 {
            t1 = Instant::now();
        }
        next = argmax(&model.forward(&[next], pos, kv)?);
    }
    Ok(Timing {
        prefill_s,
        step_ms: t1.elapsed().as_secs_f64() * 1e3 / steps.max(1) as f64,
        kv_mem,
    })
}

/// Step 5. `peak_h2d_gbps` from the sweep (step 4), measured in the same process.
pub fn offload_bench(args: &BenchArgs, peak_h2d_gbps: f64) -> Result<BenchReport> {
    if args.contexts.is_empty() || args.layers == 0 || args.decode_steps == 0 {
        bail!("the benchmark needs contexts, layers and decode steps");
    }
    let dev = Arc::new(CudaDevice::new(0)?);
    let compute = dev.new_stream()?;
    let mut shape = Shape::qwen3_4b();
    shape.layers = args.layers;
    let traced = 4;
    let extra = args.decode_steps + 2 + traced + 1;
    let max_ctx = *args.contexts.iter().max().expect("checked above");
    shape.max_pos = (max_ctx + extra).max(WARM_CAP);
    let cfg = shape.config();
    let exec: Arc<dyn Exec> = Arc::new(CudaExec::new(dev.clone(), compute.clone())?);
    let w = CudaWeights::random_shared(&*exec, &cfg, 1)?;
    let weights_bytes = w.bytes;
    let mut model = CudaModel::new(exec.clone(), cfg.clone(), w, shape.max_pos)?;
    model.nvtx = false;
    let mut report = BenchReport {
        layers: args.layers,
        peak_h2d_gbps,
        weights_bytes,
        rows: Vec::new(),
    };
    let row_bytes = cfg.kv_dim() * 2;
    // Warm-up (cuBLAS initialisation, first launches) and the largest activations, so
    // neither lands in the first timed prefill.
    {
        let mut kv = ResidentKv::new(&*exec, cfg.num_layers, cfg.kv_dim(), WARM_CAP)?;
        let warm: Vec<u32> = (0..512).collect();
        run_once(&mut model, &mut kv, &warm, 2, 0)?;
        model.reserve(max_ctx)?;
        compute.synchronize()?;
    }
    for &ctx in &args.contexts {
        let prompt: Vec<u32> = (0..ctx)
            .map(|i| (i * 7919 % cfg.vocab_size) as u32)
            .collect();
        let max_len = ctx + extra;
        // Resident.
        compute.synchronize()?;
        let m0 = mem_used()?;
        let mut kv = ResidentKv::new(&*exec, cfg.num_layers, cfg.kv_dim(), max_len)?;
        compute.synchronize()?;
        let kv_mem = mem_used()?.saturating_sub(m0).max(kv.bytes());
        let res = run_once(&mut model, &mut kv, &prompt, args.decode_steps, kv_mem)?;
        drop(kv);
        // Offload.
        compute.synchronize()?;
        let m0 = mem_used()?;
        let ocfg = OffloadConfig {
            num_kv_buffers: args.num_kv_buffers,
            block_size: args.block_size,
            max_model_len: max_len,
            ..OffloadConfig::default()
        };
        let mut kv = offload_engine(dev.clone(), compute.clone(), &cfg, ocfg)?;
        compute.synchronize()?;
        let plan = kv.plan();
        let kv_mem = mem_used()?
            .saturating_sub(m0)
            .max(plan.ring_bytes + plan.decode_buffer_bytes);
        let off = run_once(&mut model, &mut kv, &prompt, args.decode_steps, kv_mem)?;
        // A few traced steps for the copy rates (timed events cost a little, so apart).
        kv.set_tracing(true)?;
        let p0 = ctx + args.decode_steps + 2;
        let mut next = 1u32;
        for pos in p0..p0 + traced {
            next = argmax(&model.forward(&[next], pos, &mut kv)?);
        }
        let events = kv.take_trace()?;
        kv.set_tracing(false)?;
        let (largest_copy_bytes, largest_copy_gbps) = largest_copies(&events);
        drop(kv);
        // Sparse decode at 1/8 of the context.
        let scfg = OffloadConfig {
            num_kv_buffers: args.num_kv_buffers,
            block_size: args.block_size,
            max_model_len: max_len,
            sparse: Some(SparseConfig {
                budget: (ctx / SPARSE_FRACTION)
                    .next_multiple_of(DEFAULT_PAGE_SIZE)
                    .max(DEFAULT_PAGE_SIZE + args.block_size),
                page_size: DEFAULT_PAGE_SIZE,
            }),
            ..OffloadConfig::default()
        };
        let mut kv = offload_engine(dev.clone(), compute.clone(), &cfg, scfg)?;
        let sparse = run_once(&mut model, &mut kv, &prompt, args.decode_steps, 0)?;
        let sparse_hit_rate = kv.sparse_stats().map_or(1.0, |s| s.hit_rate());
        drop(kv);
        let kv_bytes_per_step =
            cfg.num_layers * 2 * (ctx / args.block_size) * args.block_size * row_bytes;
        report.rows.push(BenchRow {
            context: ctx,
            prefill_s_resident: res.prefill_s,
            prefill_s_offload: off.prefill_s,
            step_ms_resident: res.step_ms,
            step_ms_offload: off.step_ms,
            kv_bytes_per_step,
            ideal_step_ms: kv_bytes_per_step as f64 / (peak_h2d_gbps * 1e9).max(1.0) * 1e3,
            largest_copy_bytes,
            largest_copy_gbps,
            kv_mem_resident: res.kv_mem,
            kv_mem_offload: off.kv_mem,
            step_ms_sparse: sparse.step_ms,
            sparse_hit_rate,
        });
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_is_64k_to_256m() {
        let s = sweep_sizes();
        assert_eq!(s.first(), Some(&(64 * KB)));
        assert_eq!(s.last(), Some(&(256 * MB)));
        assert_eq!(s.len(), 7);
    }

    #[test]
    fn bandwidth_table_and_peak() {
        let rows = [
            BwRow {
                bytes: 64 * KB,
                h2d_gbps: 10.0,
                d2h_gbps: 9.0,
            },
            BwRow {
                bytes: 256 * MB,
                h2d_gbps: 52.5,
                d2h_gbps: 50.0,
            },
        ];
        let t = format_bandwidth(&rows);
        assert!(
            t.contains("64 KB") && t.contains("256 MB") && t.contains("52.5"),
            "{t}"
        );
        assert_eq!(peak_h2d(&rows), 52.5);
    }

    fn ev(name: &str, bytes: usize, s: f64, e: f64) -> TraceEvent {
        TraceEvent {
            stream: "h2d-prefetch".into(),
            name: name.into(),
            layer: Some(0),
            bytes,
            start_us: s,
            end_us: e,
        }
    }

    #[test]
    fn largest_copies_rate() {
        let evs = [
            ev("h2d-k", 1000, 0.0, 1.0),
            ev("h2d-v", 1000, 1.0, 3.0),
            ev("h2d-k", 10, 0.0, 100.0),
            ev("layer", 0, 0.0, 5.0),
        ];
        let (b, g) = largest_copies(&evs);
        assert_eq!(b, 1000);
        assert!((g - 2000.0 / 3e-6 / 1e9).abs() < 1e-9, "{g}");
    }

    #[test]
    fn report_goals_and_table() {
        let r = BenchReport {
            layers: 8,
            peak_h2d_gbps: 50.0,
            weights_bytes: 0,
            rows: vec![BenchRow {
                context: 32768,
                prefill_s_resident: 2.0,
                prefill_s_offload: 2.05,
                step_ms_resident: 1.0,
                step_ms_offload: 22.0,
                kv_bytes_per_step: 1 << 30,
                ideal_step_ms: 20.0,
                largest_copy_bytes: 64 * MB,
                largest_copy_gbps: 45.0,
                kv_mem_resident: 1 << 30,
                kv_mem_offload: 1 << 28,
                step_ms_sparse: 5.0,
                sparse_hit_rate: 0.9,
            }],
        };
        let g = r.goals();
        assert_eq!(g.len(), 4);
        assert!(g.iter().all(|x| x.3), "{g:?}");
        let t = r.to_string();
        assert!(
            t.contains("32K") && t.contains("met") && !t.contains("MISSED"),
            "{t}"
        );
        let mut slow = r.clone();
        slow.rows[0].step_ms_offload = 30.0;
        assert!(slow.to_string().contains("MISSED"));
        let mut slow_sparse = r.clone();
        slow_sparse.rows[0].step_ms_sparse = 8.0;
        assert!(slow_sparse.to_string().contains("MISSED"));
    }
}
