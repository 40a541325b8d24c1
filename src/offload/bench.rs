//! `strata bench offload`: layerwise offload against compute alone and transfer alone, on
//! one model, side by side in one run. The simulated link is set (unless given) so that
//! one layer's decode transfer takes `--transfer-over-compute` times (default 1) one
//! layer's decode compute. With `--sparse-budget B1,B2,..`, sparse decode at each budget
//! runs beside full loading under the same link (decode speed, bytes per step, prefetch
//! hit rate), and with `--needle-depth`, needle retrieval at the context length is scored
//! for full attention and each budget.
//!
//! Decode is timed in `--rounds` rounds over the same prefilled caches: each round times
//! compute alone, sizes the link from it, then full loading and each budget back to back,
//! so a round's ratios compare rows measured seconds apart under the same machine speed
//! (a shared machine drifts by 10-40% over the minutes the prefills take); the report
//! gives each ratio's median over the rounds and its range.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::{trace, CpuOffloadDevice, OffloadConfig, OffloadControl, OffloadEngine};
use crate::device::cpu::stream::{Buffer, CpuDevice, MemSpace, Stream};
use crate::device::KvElem;
use crate::engine::sampler::argmax;
use crate::engine::verified::{CacheSteps, Verifier};
use crate::engine::{Sampler, SamplingParams};
use crate::flags;
use crate::kv::{first_window_block, ContiguousKv, KvCache};
use crate::model::Model;
use crate::sparse::SparseConfig;

/// `strata bench offload`.
#[derive(Debug, Clone, clap::Args)]
pub struct OffloadBenchArgs {
    /// GGUF file or Hugging Face model directory [default: $STRATA_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt (context) length in tokens.
    #[arg(long, default_value_t = 2048, value_parser = flags::tokens())]
    pub context: usize,
    /// Decode steps timed per round and row, after the prefill (at least one: a decode
    /// benchmark times decode steps).
    #[arg(long, default_value_t = 32, value_parser = flags::tokens())]
    pub decode_steps: usize,
    /// Timed rounds: each times compute alone, sizes the link from it (unless
    /// --sim-link-gbps), then full loading and each sparse budget, back to back; ratios are
    /// per round, reported as the median and the range.
    #[arg(long, default_value_t = 3, value_parser = flags::rounds())]
    pub rounds: usize,
    #[arg(long, default_value_t = 4, value_parser = flags::kv_buffers())]
    pub num_kv_buffers: usize,
    #[arg(long, default_value_t = 256, value_parser = flags::block_size())]
    pub block_size: usize,
    /// Simulated link speed [default: one layer's transfer ≈ one layer's decode compute]
    #[arg(long, value_parser = flags::link_gbps)]
    pub sim_link_gbps: Option<f64>,
    /// Simulated link (unless --sim-link-gbps): one layer's decode transfer takes this
    /// many times one layer's decode compute (>= 2: transfer-bound).
    #[arg(long, default_value_t = 1.0, value_parser = flags::positive_ratio)]
    pub transfer_over_compute: f64,
    /// Sparse decode budgets (tokens, comma-separated), each run beside full loading.
    #[arg(long, value_delimiter = ',', value_parser = flags::tokens())]
    pub sparse_budget: Vec<usize>,
    #[arg(long, default_value_t = crate::sparse::DEFAULT_PAGE_SIZE, value_parser = flags::block_size())]
    pub sparse_page_size: usize,
    /// Verified sparse decode beside each budget (`generate --sparse-verify`): drafts per
    /// round. Its rows time and count per token emitted: full attention's tokens.
    #[arg(long, value_name = "DRAFTS")]
    pub sparse_verify: Option<usize>,
    /// Needle depths scored at the context length, full attention and each budget.
    #[arg(long, value_delimiter = ',', value_parser = flags::fraction)]
    pub needle_depth: Vec<f64>,
    /// Write the decode steps' Chrome/Perfetto trace here (full loading; each sparse
    /// budget's beside it as `<stem>.sparse-<budget>.json`, verified rows' as
    /// `<stem>.verified-<budget>.json`).
    #[arg(long)]
    pub trace_out: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub dtype: flags::WeightDtypeArg,
    #[command(flatten)]
    pub kv: flags::KvDtypeArg,
}

/// The command: load the model, run the benchmark, print the table (or JSON).
pub fn run(args: OffloadBenchArgs) -> Result<()> {
    if let Some(path) = &args.trace_out {
        trace::check_trace_out(path)?;
        // The files beside it too, before the run (not after minutes of it).
        for &budget in &args.sparse_budget {
            trace::check_trace_out(&sparse_trace_path(path, budget, false))?;
            if args.sparse_verify.is_some() {
                trace::check_trace_out(&sparse_trace_path(path, budget, true))?;
            }
        }
    }
    let path = crate::model::resolve(args.model.clone())?;
    for &budget in &args.sparse_budget {
        let sc = SparseConfig {
            budget,
            page_size: args.sparse_page_size,
        };
        sc.check(args.block_size)?;
    }
    if let Some(k) = args.sparse_verify {
        if args.sparse_budget.is_empty() {
            return Err(crate::errors::usage(
                "--sparse-verify checks sparse decode's tokens: add --sparse-budget",
            ));
        }
        crate::engine::verified::check_draft_len(k)?;
    }
    let dtype = args.dtype.resolve(crate::device::DeviceKind::Cpu);
    let (model, tok) = Model::load_as(&path, !args.json, dtype)?;
    let max = model.cfg.max_position_embeddings;
    // Compute alone decodes one round more than the rows (its first sizes the prefills' link).
    if args.context == 0 || args.context + (args.rounds + 1) * args.decode_steps >= max {
        anyhow::bail!(
            "--context must be between 1 and the model's context ({max}) minus (--rounds + 1) × --decode-steps"
        );
    }
    // The needle prompts are built (and so checked) before the rounds, not after them.
    let needles = needle_prompts(&tok, &args)?;
    let kv = args.kv.resolve(crate::device::DeviceKind::Cpu)?;
    // Checked: say what the next minutes do (the table comes at the end).
    crate::engine::print_threads_note();
    eprintln!(
        "strata bench offload: context {}, weights {}, KV {kv}, {} rounds × {} decode steps, \
         {} ring slots, block {}{}{}",
        args.context,
        dtype.name(),
        args.rounds,
        args.decode_steps,
        args.num_kv_buffers,
        args.block_size,
        if args.sparse_budget.is_empty() {
            String::new()
        } else {
            format!(", sparse budgets {:?}", args.sparse_budget)
        },
        if args.needle_depth.is_empty() {
            String::new()
        } else {
            format!(", needles at {:?}", args.needle_depth)
        },
    );
    let report = crate::with_kv_elem!(kv, T => {
        let mut report = run_bench::<T>(&model, &args)?;
        if !needles.is_empty() {
            needle_scores::<T>(&model, &tok, &args, needles, &mut report)?;
        }
        report
    });
    if args.json {
        crate::outln!("{}", serde_json::to_string(&report)?)?;
    } else {
        crate::outln!("{report}")?;
    }
    Ok(())
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct OffloadBenchReport {
    pub context: usize,
    pub num_kv_buffers: usize,
    pub block_size: usize,
    /// The link of the prefills (sized from the first compute-only measurement); each
    /// round's is in `link_gbps_per_round`.
    pub link_gbps: f64,
    pub rounds: usize,
    pub link_gbps_per_round: Vec<f64>,
    pub prefill_s_plain: f64,
    pub prefill_s_offload: f64,
    pub prefill_ratio: f64,
    /// Medians over the rounds (steps of compute alone, transfer alone, full loading, and
    /// full loading ÷ the larger of the other two, per round).
    pub decode_step_ms_compute_only: f64,
    /// Each round's compute-only step: the machine's drift during the run.
    pub decode_step_ms_compute_only_per_round: Vec<f64>,
    pub decode_step_ms_transfer_only: f64,
    pub decode_step_ms_offload: f64,
    pub decode_step_ms_offload_per_round: Vec<f64>,
    pub decode_ratio: f64,
    pub overlap_fraction: f64,
    pub h2d_bytes_per_step: f64,
    pub min_bytes_per_step: f64,
    /// Sparse decode, one row per budget, beside the full loading above.
    pub sparse: Vec<SparseRow>,
    /// Verified sparse decode (`--sparse-verify`), one row per budget: per token emitted.
    pub verified: Vec<SparseRow>,
    /// The first budget's sparse ÷ full decode tokens/s (median over the rounds) and bytes
    /// moved per step.
    pub decode_speedup: Option<f64>,
    pub bytes_per_step_ratio: Option<f64>,
    /// Needle passes with full attention (offloaded, full loading), out of `needle_cases`.
    pub needle_full: Option<usize>,
    pub needle_cases: usize,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct SparseRow {
    pub budget: usize,
    pub page_size: usize,
    /// Median over the rounds.
    pub decode_step_ms: f64,
    /// Sparse ÷ full-loading decode tokens/s: the median of the rounds' ratios (each round
    /// times both back to back), and their range.
    pub decode_speedup: f64,
    pub decode_speedup_min: f64,
    pub decode_speedup_max: f64,
    pub decode_step_ms_per_round: Vec<f64>,
    pub h2d_bytes_per_step: f64,
    /// Sparse ÷ full-loading H2D bytes per step.
    pub bytes_per_step_ratio: f64,
    pub prefetch_hit_rate: f64,
    /// Runs of missed pages per step (all layers), contiguous in host memory.
    pub miss_runs_per_step: f64,
    /// Where the step's sparse work goes (ms a step, from the decode trace).
    pub step_parts: trace::SparseStepParts,
    pub needle_passed: Option<usize>,
    /// Verified rows: drafts per round, and the share of drafts full attention kept.
    pub verify: Option<usize>,
    pub acceptance: Option<f64>,
}

/// Resets `kv` and prefills `prompt`: (seconds, the last logits).
fn prefill<T: KvElem>(
    model: &Model,
    kv: &mut dyn KvCache<T>,
    prompt: &[u32],
) -> Result<(f64, Vec<f32>)> {
    kv.reset()?;
    let t0 = Instant::now();
    let logits = model.forward(prompt, 0, kv)?;
    Ok((t0.elapsed().as_secs_f64(), logits))
}

/// Where `--trace-out PATH`'s trace of sparse budget `budget` goes: beside PATH
/// (`<stem>.sparse-<budget>.json`; verified: `<stem>.verified-<budget>.json`).
fn sparse_trace_path(path: &std::path::Path, budget: usize, verified: bool) -> PathBuf {
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let kind = if verified { "verified" } else { "sparse" };
    path.with_file_name(format!("{stem}.{kind}-{budget}.json"))
}

/// Time to move `layers` layers of K and V (`bytes_per_layer` in all) over the link, alone.
fn transfer_only_step(gbps: f64, layers: usize, bytes_per_layer: usize) -> Result<f64> {
    let dev = CpuDevice::new(gbps, false);
    let s = Stream::new(&dev, "h2d")?;
    let n = bytes_per_layer / 8; // f32s per K (or V): the copies move bytes
    let (h, d) = (
        Buffer::alloc(n, MemSpace::Host)?,
        Buffer::alloc(n, MemSpace::Device)?,
    );
    let t = Instant::now();
    for _ in 0..layers {
        s.copy("h2d-k", None, &h, 0, &d, 0, n);
        s.copy("h2d-v", None, &h, 0, &d, 0, n);
    }
    s.synchronize();
    Ok(t.elapsed().as_secs_f64())
}

/// The median of `v` (the mean of the middle two when even); `v` is not empty.
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// (smallest, largest) of `v`: a median's range over rounds.
pub(crate) fn range(v: &[f64]) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

/// A cache being decoded round after round: its last logits and position.
struct Decoding<K> {
    kv: K,
    logits: Vec<f32>,
    pos: usize,
}

impl<K> Decoding<K> {
    /// `steps` greedy decode steps on from where the last round stopped: mean seconds per
    /// step.
    fn round<T: KvElem>(&mut self, model: &Model, steps: usize) -> Result<f64>
    where
        K: KvCache<T>,
    {
        let t1 = Instant::now();
        for _ in 0..steps {
            self.logits = model.forward(&[argmax(&self.logits)], self.pos, &mut self.kv)?;
            self.pos += 1;
        }
        Ok(t1.elapsed().as_secs_f64() / steps.max(1) as f64)
    }
}

/// `steps` tokens of verified sparse decode on from where the last round stopped (rounds
/// cut short at `steps`): mean seconds per token.
fn verified_round<T: KvElem>(
    model: &Model,
    kv: &mut OffloadEngine<CpuOffloadDevice<T>>,
    v: &mut Verifier,
    steps: usize,
) -> Result<f64> {
    let mut m = CacheSteps { model, kv };
    let t = Instant::now();
    v.decode(&mut m, steps, usize::MAX, &|_| false, &mut |_, _| Ok(()))?;
    Ok(t.elapsed().as_secs_f64() / steps.max(1) as f64)
}

/// A sparse budget's row (`verify`: verified) from its engine's trace and step times, per
/// step (token) beside full loading's `fulls` and `h2d_full` bytes over the same steps.
fn sparse_row<T: KvElem>(
    args: &OffloadBenchArgs,
    sc: SparseConfig,
    kv: &mut OffloadEngine<CpuOffloadDevice<T>>,
    times: &[f64],
    fulls: &[f64],
    h2d_full: usize,
    verify: Option<usize>,
) -> Result<SparseRow> {
    let steps = times.len() * args.decode_steps;
    let timed = steps.max(1) as f64;
    kv.set_tracing(false)?;
    let events = kv.take_trace()?;
    if let Some(p) = &args.trace_out {
        let path = sparse_trace_path(p, sc.budget, verify.is_some());
        trace::write_chrome_trace(&path, &events)?;
    }
    let (bytes, _) = trace::link_bytes(&events);
    let stats = kv.sparse_stats().unwrap_or_default();
    let speedups: Vec<f64> = fulls.iter().zip(times).map(|(f, s)| f / s).collect();
    let (speedup_min, speedup_max) = range(&speedups);
    Ok(SparseRow {
        budget: sc.budget,
        page_size: sc.page_size,
        decode_step_ms: median(times) * 1e3,
        decode_speedup: median(&speedups),
        decode_speedup_min: speedup_min,
        decode_speedup_max: speedup_max,
        decode_step_ms_per_round: times.iter().map(|s| s * 1e3).collect(),
        h2d_bytes_per_step: bytes as f64 / timed,
        bytes_per_step_ratio: bytes as f64 / h2d_full.max(1) as f64,
        prefetch_hit_rate: stats.hit_rate(),
        miss_runs_per_step: stats.miss_runs as f64 / timed,
        step_parts: trace::SparseStepParts::of(&events, steps),
        needle_passed: None,
        verify,
        acceptance: None,
    })
}

/// The link that makes one layer's decode transfer (`bytes_per_layer`) take
/// `--transfer-over-compute` times one layer's decode compute, from a compute-only step of
/// `step_compute` seconds (or `--sim-link-gbps`).
fn sized_link(
    args: &OffloadBenchArgs,
    layers: usize,
    bytes_per_layer: usize,
    step_compute: f64,
) -> f64 {
    // A measured link is kept within the range the flag allows (a step timed at 0 s
    // would ask for an infinitely fast one).
    args.sim_link_gbps.unwrap_or_else(|| {
        let gbps = bytes_per_layer as f64
            / (args.transfer_over_compute * step_compute / layers as f64)
            / 1e9;
        if gbps.is_nan() {
            flags::MAX_LINK_GBPS
        } else {
            gbps.clamp(flags::MIN_LINK_GBPS, flags::MAX_LINK_GBPS)
        }
    })
}

/// The benchmark with KV elements `T`.
pub fn run_bench<T: KvElem>(
    model: &Arc<Model>,
    args: &OffloadBenchArgs,
) -> Result<OffloadBenchReport> {
    let c = &model.cfg;
    let mut rng = StdRng::seed_from_u64(1);
    let prompt: Vec<u32> = (0..args.context)
        .map(|_| rng.random_range(100..c.vocab_size as u32))
        .collect();
    let (rounds, steps) = (args.rounds.max(1), args.decode_steps);
    // Compute alone runs one more round than the others (it sizes the prefills' link).
    let total = args.context + (rounds + 1) * steps + 1;
    let bytes_per_layer = 2 * args.context * c.kv_dim() * std::mem::size_of::<T>();

    // 1. Compute alone: everything resident; a first timing sizes the prefills' link.
    let mut plain = ContiguousKv::<T>::plain(c, total);
    let warm = &prompt[..prompt.len().min(64)];
    let (_, logits) = prefill(model, &mut plain, warm)?;
    let mut warming = Decoding {
        kv: plain,
        logits,
        pos: warm.len(),
    };
    warming.round(model, 2)?;
    let mut plain = warming.kv;
    let (prefill_plain, logits) = prefill(model, &mut plain, &prompt)?;
    let mut plain = Decoding {
        kv: plain,
        logits,
        pos: prompt.len(),
    };
    let layers = c.num_layers;
    let gbps = sized_link(args, layers, bytes_per_layer, plain.round(model, steps)?);

    // 2. Full loading and each sparse budget, offloaded under that link, prefilled once.
    let cfg = OffloadConfig {
        num_kv_buffers: args.num_kv_buffers,
        block_size: args.block_size,
        max_model_len: total,
        link_gbps: gbps,
        ..Default::default()
    };
    let mut engine = OffloadEngine::<CpuOffloadDevice<T>>::on_cpu(c, cfg.clone())?;
    let (prefill_offload, logits) = prefill(model, &mut engine, &prompt)?;
    let mut full = Decoding {
        kv: engine,
        logits,
        pos: prompt.len(),
    };
    let mut sparse = Vec::new();
    for &budget in &args.sparse_budget {
        let sc = SparseConfig {
            budget,
            page_size: args.sparse_page_size,
        };
        let sparse_cfg = OffloadConfig {
            sparse: Some(sc),
            ..cfg.clone()
        };
        let mut e = OffloadEngine::<CpuOffloadDevice<T>>::on_cpu(c, sparse_cfg)?;
        let (_, logits) = prefill(model, &mut e, &prompt)?;
        sparse.push((
            sc,
            Decoding {
                kv: e,
                logits,
                pos: prompt.len(),
            },
        ));
    }

    let mut verified = Vec::new();
    for &(sc, _) in sparse.iter().filter(|_| args.sparse_verify.is_some()) {
        let k = args.sparse_verify.expect("filtered");
        let vcfg = OffloadConfig {
            sparse: Some(sc),
            ..cfg.clone()
        };
        let mut kv = OffloadEngine::<CpuOffloadDevice<T>>::on_cpu(c, vcfg)?;
        let (_, logits) = prefill(model, &mut kv, &prompt)?;
        let greedy = Sampler::new(SamplingParams::default());
        let v = Verifier::new(argmax(&logits), prompt.len(), k, greedy)?;
        verified.push((sc, kv, v));
    }

    // 3. The rounds: compute alone, the link sized from it, transfer alone, full loading,
    // each budget (then each verified); decode traced.
    full.kv.take_trace()?;
    full.kv.set_tracing(true)?;
    let kvs = sparse.iter_mut().map(|(_, d)| &mut d.kv);
    for kv in kvs.chain(verified.iter_mut().map(|(_, kv, _)| kv)) {
        kv.take_trace()?;
        kv.set_tracing(true)?;
    }
    let (mut computes, mut links, mut transfers, mut fulls) = (vec![], vec![], vec![], vec![]);
    let mut sparse_steps = vec![Vec::new(); sparse.len()];
    let mut verified_steps = vec![Vec::new(); verified.len()];
    for _ in 0..rounds {
        let step_compute = plain.round(model, steps)?;
        let gbps = sized_link(args, layers, bytes_per_layer, step_compute);
        let step_transfer = transfer_only_step(gbps, layers, bytes_per_layer)?;
        full.kv.set_link_gbps(gbps);
        let step_full = full.round(model, steps)?;
        for ((_, d), times) in sparse.iter_mut().zip(&mut sparse_steps) {
            d.kv.set_link_gbps(gbps);
            times.push(d.round(model, steps)?);
        }
        for ((_, kv, v), times) in verified.iter_mut().zip(&mut verified_steps) {
            kv.set_link_gbps(gbps);
            times.push(verified_round(model, kv, v, steps)?);
        }
        computes.push(step_compute);
        links.push(gbps);
        transfers.push(step_transfer);
        fulls.push(step_full);
    }
    full.kv.set_tracing(false)?;
    let events = full.kv.take_trace()?;
    if let Some(p) = &args.trace_out {
        trace::write_chrome_trace(p, &events)?;
    }
    let (h2d, _) = trace::link_bytes(&events);
    let timed = (rounds * steps).max(1) as f64;
    let mut rows = Vec::new();
    for ((sc, mut d), times) in sparse.into_iter().zip(sparse_steps) {
        rows.push(sparse_row(args, sc, &mut d.kv, &times, &fulls, h2d, None)?);
    }
    let mut verified_rows = Vec::new();
    for ((sc, mut kv, v), times) in verified.into_iter().zip(verified_steps) {
        let mut row = sparse_row(args, sc, &mut kv, &times, &fulls, h2d, args.sparse_verify)?;
        row.acceptance = Some(v.stats.acceptance());
        verified_rows.push(row);
    }
    let ratios: Vec<f64> = (0..rounds)
        .map(|r| fulls[r] / computes[r].max(transfers[r]))
        .collect();
    Ok(OffloadBenchReport {
        decode_speedup: rows.first().map(|r| r.decode_speedup),
        bytes_per_step_ratio: rows.first().map(|r| r.bytes_per_step_ratio),
        sparse: rows,
        verified: verified_rows,
        needle_full: None,
        needle_cases: 0,
        context: args.context,
        num_kv_buffers: args.num_kv_buffers,
        block_size: args.block_size,
        link_gbps: gbps,
        rounds,
        link_gbps_per_round: links,
        prefill_s_plain: prefill_plain,
        prefill_s_offload: prefill_offload,
        prefill_ratio: prefill_offload / prefill_plain,
        decode_step_ms_compute_only: median(&computes) * 1e3,
        decode_step_ms_compute_only_per_round: computes.iter().map(|s| s * 1e3).collect(),
        decode_step_ms_transfer_only: median(&transfers) * 1e3,
        decode_step_ms_offload: median(&fulls) * 1e3,
        decode_step_ms_offload_per_round: fulls.iter().map(|s| s * 1e3).collect(),
        decode_ratio: median(&ratios),
        overlap_fraction: trace::overlap_fraction(&events),
        h2d_bytes_per_step: h2d as f64 / timed,
        // Each step must bring in every layer's host-resident KV (full blocks) once.
        // The full host blocks each step's layers attend: every one in a full layer,
        // those its window reaches in a windowed one, none in a state layer.
        min_bytes_per_step: (0..rounds * steps)
            .map(|i| {
                let (pos, bs) = (args.context + i, args.block_size);
                let blocks: usize = (0..c.num_layers)
                    .filter(|&l| c.keeps_kv(l))
                    .map(|l| (pos / bs).saturating_sub(first_window_block(c.window(l), pos, bs)))
                    .sum();
                (blocks * bs * c.kv_dim() * std::mem::size_of::<T>() * 2) as f64
            })
            .sum::<f64>()
            / timed,
    })
}

impl std::fmt::Display for OffloadBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mark = |ok: bool| if ok { "met" } else { "MISSED" };
        writeln!(
            f,
            "offload bench: context {} tokens, {} ring slots, block size {}, simulated link {:.2} GB/s (prefill), {} rounds (medians below)",
            self.context, self.num_kv_buffers, self.block_size, self.link_gbps, self.rounds
        )?;
        writeln!(
            f,
            "prefill: {:.3} s plain, {:.3} s offload -> ratio {:.3} (goal <= 1.10: {})",
            self.prefill_s_plain,
            self.prefill_s_offload,
            self.prefill_ratio,
            mark(self.prefill_ratio <= 1.10)
        )?;
        writeln!(
            f,
            "decode step: {:.2} ms compute only, {:.2} ms transfer only, {:.2} ms offload -> ratio to max {:.3} (goal <= 1.15: {})",
            self.decode_step_ms_compute_only,
            self.decode_step_ms_transfer_only,
            self.decode_step_ms_offload,
            self.decode_ratio,
            mark(self.decode_ratio <= 1.15)
        )?;
        write!(
            f,
            "decode overlap: {:.1}% of link time hidden behind compute; H2D {:.2} MiB per step vs {:.2} MiB minimum ({:.2}x)",
            self.overlap_fraction * 100.0,
            self.h2d_bytes_per_step / (1 << 20) as f64,
            self.min_bytes_per_step / (1 << 20) as f64,
            self.h2d_bytes_per_step / self.min_bytes_per_step
        )?;
        let list = |v: &[f64], digits: usize| {
            let v: Vec<String> = v.iter().map(|x| format!("{x:.digits$}")).collect();
            v.join(", ")
        };
        write!(
            f,
            "\nmachine drift: compute only {} ms in rounds 1..{} (link re-sized each round: {} GB/s)",
            list(&self.decode_step_ms_compute_only_per_round, 2),
            self.rounds,
            list(&self.link_gbps_per_round, 2),
        )?;
        let needle =
            |n: Option<usize>| n.map_or("-".into(), |n| format!("{n}/{}", self.needle_cases));
        if !self.sparse.is_empty() || self.needle_full.is_some() {
            write!(
                f,
                "\n{:>8} {:>5} {:>10} {:>8} {:>13} {:>11} {:>7} {:>8} {:>12} {:>7} {:>7}",
                "budget",
                "page",
                "step_ms",
                "speedup",
                "range",
                "MiB/step",
                "bytes",
                "hit_rate",
                "miss_runs",
                "needle",
                "kept"
            )?;
            write!(
                f,
                "\n{:>8} {:>5} {:>10.2} {:>8} {:>13} {:>11.2} {:>7} {:>8} {:>12} {:>7} {:>7}",
                "full",
                "-",
                self.decode_step_ms_offload,
                "1.00x",
                "-",
                self.h2d_bytes_per_step / (1 << 20) as f64,
                "1.000",
                "-",
                "-",
                needle(self.needle_full),
                "-"
            )?;
        }
        for r in self.sparse.iter().chain(&self.verified) {
            // Verified rows: `<budget>v<drafts>`, per token emitted; `kept`: drafts kept.
            let (budget, kept) = match (r.verify, r.acceptance) {
                (Some(k), Some(a)) => (format!("{}v{k}", r.budget), format!("{:.1}%", 100.0 * a)),
                _ => (r.budget.to_string(), "-".to_string()),
            };
            write!(
                f,
                "\n{:>8} {:>5} {:>10.2} {:>7.2}x {:>13} {:>11.2} {:>7.3} {:>7.1}% {:>12.1} {:>7} {:>7}",
                budget,
                r.page_size,
                r.decode_step_ms,
                r.decode_speedup,
                format!("{:.2}-{:.2}x", r.decode_speedup_min, r.decode_speedup_max),
                r.h2d_bytes_per_step / (1 << 20) as f64,
                r.bytes_per_step_ratio,
                r.prefetch_hit_rate * 100.0,
                r.miss_runs_per_step,
                needle(r.needle_passed),
                kept
            )?;
        }
        for r in &self.sparse {
            let p = &r.step_parts;
            write!(
                f,
                "\n{:>8}: a step's scoring {:.2} ms, miss waits {:.2}, moves {:.2}, prefetch waits {:.2} (of {:.2})",
                r.budget,
                p.scoring_ms,
                p.miss_waits_ms,
                p.moves_ms,
                p.prefetch_waits_ms,
                r.decode_step_ms
            )?;
        }
        Ok(())
    }
}

/// Needle retrieval at the context length with full loading and each budget, offloaded,
/// one engine per setting; a case passes when the greedy answer contains the value.
/// The needle prompts of `--needle-depth`, one per depth, at `--context` tokens.
fn needle_prompts(
    tok: &crate::model::Tokenizer,
    args: &OffloadBenchArgs,
) -> Result<Vec<crate::needle::NeedlePrompt>> {
    use crate::needle::{Case, NeedleKind};
    args.needle_depth
        .iter()
        .enumerate()
        .map(|(i, &depth)| {
            Case {
                input_len: args.context,
                depth,
                kind: NeedleKind::MagicNumber,
                seed: i as u64,
            }
            .build(tok)
            .with_context(|| format!("--needle-depth at --context {}", args.context))
        })
        .collect()
}

fn needle_scores<T: KvElem>(
    model: &Arc<Model>,
    tok: &crate::model::Tokenizer,
    args: &OffloadBenchArgs,
    prompts: Vec<crate::needle::NeedlePrompt>,
    report: &mut OffloadBenchReport,
) -> Result<()> {
    use crate::needle::answer_found;
    const NEW_TOKENS: usize = 32;
    let c = &model.cfg;
    let opts = crate::engine::GenerateOptions {
        max_tokens: NEW_TOKENS,
        sampling: crate::engine::SamplingParams::default(),
        stop_ids: c.eos_token_ids.clone(),
    };
    let budgets: Vec<Option<usize>> = std::iter::once(None)
        .chain(args.sparse_budget.iter().copied().map(Some))
        .collect();
    for (i, budget) in budgets.into_iter().enumerate() {
        let cfg = OffloadConfig {
            num_kv_buffers: args.num_kv_buffers,
            block_size: args.block_size,
            max_model_len: args.context + NEW_TOKENS + 1,
            sparse: budget.map(|budget| SparseConfig {
                budget,
                page_size: args.sparse_page_size,
            }),
            ..Default::default()
        };
        let mut e = OffloadEngine::<CpuOffloadDevice<T>>::on_cpu(c, cfg)?;
        let cap = e.capacity();
        let mut passed = 0;
        for p in &prompts {
            let out =
                crate::engine::generate_with(model, &mut e, cap, &p.ids, &opts, &mut |_| Ok(()))?;
            passed += usize::from(answer_found(&tok.decode(&out.token_ids, true)?, &p.value));
        }
        match i {
            0 => report.needle_full = Some(passed),
            _ => report.sparse[i - 1].needle_passed = Some(passed),
        }
    }
    report.needle_cases = prompts.len();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_is_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median(&[3.0]), 3.0);
        assert_eq!(median(&[5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[2.0, 9.0, 1.0, 8.0, 7.0]), 7.0);
    }
}
