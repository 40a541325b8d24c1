//! `strata bench serve`: one batch of random requests through the serving engine, in the
//! manner of nano-vllm's bench. Greedy sampling, `ignore_eos`, so lengths are as asked.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::disk::{DiskArgs, DiskTierConfig};
use super::engine::{EngineConfig, EngineStats, RequestParams};
use super::scheduler::SchedulerConfig;
use crate::device::DeviceKind;
use crate::device::KvDtype;
use crate::errors::usage;
use crate::flags;
use crate::model::Model;

/// An inclusive length range `A:B` (or `N` for exactly N).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LenRange {
    pub lo: usize,
    pub hi: usize,
}

impl std::str::FromStr for LenRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let num = |x: &str| {
            x.trim()
                .parse::<usize>()
                .map_err(|_| format!("expected A:B with whole numbers, got {s:?}"))
        };
        let (lo, hi) = match s.split_once(':') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(s)?, num(s)?),
        };
        let max = crate::flags::MAX_TOKENS;
        if lo == 0 || lo > hi || hi > max {
            return Err(format!("expected 1 <= A <= B <= {max} in A:B, got {s:?}"));
        }
        Ok(Self { lo, hi })
    }
}

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// GGUF file or Hugging Face model directory [default: $STRATA_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Device the engine runs on (cuda: the batch-invariant GEMM and paged attention on
    /// GPU 0, host tier in pinned memory; no disk tier, no --link-gbps).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Number of requests.
    #[arg(long, default_value_t = 16, value_parser = flags::seqs())]
    pub num_seqs: usize,
    /// Prompt length range A:B (uniform).
    #[arg(long, default_value = "64:256")]
    pub input_len: LenRange,
    /// Output length range A:B (uniform).
    #[arg(long, default_value = "32:64")]
    pub output_len: LenRange,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16, value_parser = flags::block_size())]
    pub block_size: usize,
    /// GPU KV pages [default: enough for every request at once]
    #[arg(long, value_parser = flags::blocks())]
    pub num_gpu_blocks: Option<usize>,
    /// Host-tier blocks for preemption offload; 0 = recompute instead.
    #[arg(long, default_value_t = 0, value_parser = flags::blocks_or_zero())]
    pub max_cpu_offload_blocks: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 64, value_parser = flags::seqs())]
    pub max_num_seqs: usize,
    /// Token budget of one step.
    #[arg(long, default_value_t = 1024, value_parser = flags::tokens())]
    pub max_num_batched_tokens: usize,
    /// Prompt tokens per forward call (a multiple of --block-size).
    #[arg(long, default_value_t = 64, value_parser = flags::tokens())]
    pub prefill_chunk: usize,
    /// Give every request the same first N prompt tokens (exercises the prefix cache).
    #[arg(long, default_value_t = 0, value_parser = flags::tokens_or_zero())]
    pub shared_prefix: usize,
    /// Seed for the random requests.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Simulated host↔device link in GB/s for offload copies; 0 = unthrottled.
    #[arg(long, default_value_t = 0.0, value_parser = flags::link_gbps)]
    pub link_gbps: f64,
    #[command(flatten)]
    pub disk: DiskArgs,
    /// Also run unconstrained and fail unless every request's tokens are identical.
    #[arg(long)]
    pub compare: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Side by side in one run: the requests one at a time, all at once, and with GPU
    /// blocks at a third of the working set with host offload and with recomputation;
    /// fails unless every run gives the same tokens.
    #[arg(long)]
    pub table: bool,
    /// Side by side in one run: unconstrained, then GPU blocks at a third of the working
    /// set and host slots for a tenth, with the disk tier (--disk-offload-dir, which must
    /// hold no persisted prefix from an earlier run) and without it (recomputation);
    /// fails unless every run gives the same tokens.
    #[arg(long, conflicts_with = "table")]
    pub tier_table: bool,
    #[command(flatten)]
    pub dtype: crate::flags::WeightDtypeArg,
    #[command(flatten)]
    pub kv: crate::flags::KvDtypeArg,
}

/// Random prompts and output lengths, reproducible from `seed`.
pub fn make_requests(a: &ServeArgs, vocab: usize) -> Result<(Vec<Vec<u32>>, Vec<RequestParams>)> {
    ensure!(a.num_seqs > 0, "--num-seqs must be > 0");
    ensure!(
        a.shared_prefix <= a.input_len.lo,
        "--shared-prefix ({}) must not exceed the shortest input ({})",
        a.shared_prefix,
        a.input_len.lo
    );
    let mut rng = StdRng::seed_from_u64(a.seed);
    // Ids from the lower part of the vocabulary: ordinary tokens, not specials.
    let hi = (vocab as u32).clamp(2, 10_000);
    let prefix: Vec<u32> = (0..a.shared_prefix)
        .map(|_| rng.random_range(1..hi))
        .collect();
    let mut prompts = Vec::new();
    let mut params = Vec::new();
    for _ in 0..a.num_seqs {
        let n = rng.random_range(a.input_len.lo..=a.input_len.hi);
        let mut p = prefix.clone();
        p.extend((p.len()..n).map(|_| rng.random_range(1..hi)));
        prompts.push(p);
        params.push(RequestParams {
            max_tokens: rng.random_range(a.output_len.lo..=a.output_len.hi),
            ignore_eos: true,
            ..Default::default()
        });
    }
    Ok((prompts, params))
}

/// Blocks needed to hold every request's full KV at once (saturating: the caller compares
/// it with the pool, so a sum past `usize::MAX` must not wrap into a small one).
pub fn working_set_blocks(prompts: &[Vec<u32>], params: &[RequestParams], bs: usize) -> usize {
    prompts
        .iter()
        .zip(params)
        .map(|(p, r)| p.len().saturating_add(r.max_tokens).div_ceil(bs))
        .fold(0, usize::saturating_add)
}

/// Refuses `bytes` (None = the size overflowed) that cannot fit in the available memory.
fn ensure_fits(bytes: Option<usize>, what: &str, lower: &str) -> Result<()> {
    let Some(bytes) = bytes else {
        bail!("{what} overflow in size: lower {lower}");
    };
    if let Some(avail) = crate::offload::available_memory_bytes() {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        ensure!(
            bytes as u64 <= avail,
            "{what} need {:.2} GiB but only {:.2} GiB of memory is available; lower {lower}",
            gib(bytes as f64),
            gib(avail as f64)
        );
    }
    Ok(())
}

pub struct BenchRun {
    pub outputs: Vec<Vec<u32>>,
    pub stats: EngineStats,
    pub secs: f64,
    /// Mean time from the start to each request's first generated token.
    pub mean_ttft_s: f64,
}

impl BenchRun {
    /// The line above a table: the workload as this (unconstrained) run saw it.
    fn summary(&self, requests: usize, working_set: usize) -> String {
        format!(
            "{requests} requests, {} prompt tokens, {} generated; working set {working_set} blocks",
            self.stats.prompt_tokens, self.stats.generated_tokens
        )
    }

    /// Generated tokens per second over the whole run.
    fn throughput(&self) -> f64 {
        self.stats.generated_tokens as f64 / self.secs.max(1e-9)
    }
}

/// The most requests whose tokens differ from `reference`'s in any one of `runs`.
fn most_differing<'a>(runs: impl Iterator<Item = &'a BenchRun>, reference: &BenchRun) -> usize {
    runs.map(|r| {
        r.outputs
            .iter()
            .zip(&reference.outputs)
            .filter(|(x, y)| x != y)
            .count()
    })
    .max()
    .unwrap_or(0)
}

pub fn run_once(
    model: &Arc<Model>,
    (device, kv_dtype): (DeviceKind, KvDtype),
    sched: SchedulerConfig,
    link_gbps: f64,
    disk: Option<DiskTierConfig>,
    prompts: &[Vec<u32>],
    params: &[RequestParams],
) -> Result<BenchRun> {
    let cfg = EngineConfig {
        sched,
        link_gbps,
        sanitize: false,
        check_order: crate::device::order::on_by_default(),
        disk,
        kv_dtype,
    };
    let mut engine = super::setup::engine_for(device, model, &cfg)?;
    if let Some(plan) = engine.disk_plan() {
        eprintln!("{plan}");
    }
    let t = Instant::now();
    let rxs = prompts
        .iter()
        .zip(params)
        .map(|(p, r)| Ok(engine.submit(p.clone(), r)?.1))
        .collect::<Result<Vec<_>>>()?;
    let mut outputs = vec![Vec::new(); rxs.len()];
    let mut ttft = vec![None; rxs.len()];
    while engine.has_unfinished() {
        engine.step()?;
        for (i, rx) in rxs.iter().enumerate() {
            outputs[i].extend(rx.try_iter());
            if ttft[i].is_none() && !outputs[i].is_empty() {
                ttft[i] = Some(t.elapsed().as_secs_f64());
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    engine.drain_transfers()?; // write-throughs finish (and the index is saved) untimed
    let firsts: Vec<f64> = ttft.into_iter().flatten().collect();
    Ok(BenchRun {
        outputs,
        stats: engine.stats(),
        secs,
        mean_ttft_s: firsts.iter().sum::<f64>() / firsts.len().max(1) as f64,
    })
}

/// The memory plan, printed at start: what each tier holds.
fn print_plan(model: &Model, sched: &SchedulerConfig, working_set: usize, kv: KvDtype) {
    let block = model
        .cfg
        .kv_bytes(sched.block_size, kv.bytes())
        .unwrap_or(0); // checked by ensure_fits first
    let mib = |n: usize| n as f64 * block as f64 / (1u64 << 20) as f64;
    crate::engine::print_threads_note();
    eprintln!(
        "plan: KV block {} tokens = {:.1} KiB | GPU {} blocks ({:.1} MiB) | host {} blocks ({:.1} MiB) | disk {} blocks ({:.1} MiB) | working set {} blocks",
        sched.block_size,
        block as f64 / 1024.0,
        sched.num_gpu_blocks,
        super::setup::device_kv_bytes(&model.cfg, sched, kv.bytes()).unwrap_or(0) as f64
            / (1u64 << 20) as f64,
        sched.max_cpu_offload_blocks,
        mib(sched.max_cpu_offload_blocks),
        sched.max_disk_offload_blocks,
        mib(sched.max_disk_offload_blocks),
        working_set
    );
    if model.cfg.widest_window().is_some() {
        eprintln!(
            "plan: {}",
            super::setup::kv_plan(&model.cfg, sched, kv.bytes())
        );
    }
}

/// The checks of `bench serve` that need no model: the flags against each other (usage
/// errors, exit 2) and the device.
fn check_flags(a: &ServeArgs) -> Result<Option<DiskTierConfig>> {
    let disk = a.disk.config()?;
    if a.tier_table && disk.is_none() {
        return Err(usage(
            "--tier-table needs --disk-offload-dir and --max-disk-offload-blocks",
        ));
    }
    if a.shared_prefix > a.input_len.lo {
        return Err(usage(format!(
            "--shared-prefix ({}) must not exceed the shortest input ({})",
            a.shared_prefix, a.input_len.lo
        )));
    }
    SchedulerConfig {
        block_size: a.block_size,
        num_gpu_blocks: a.num_gpu_blocks.unwrap_or(1),
        max_cpu_offload_blocks: a.max_cpu_offload_blocks,
        max_disk_offload_blocks: a.disk.max_disk_offload_blocks,
        max_num_seqs: a.max_num_seqs,
        max_num_batched_tokens: a.max_num_batched_tokens,
        prefill_chunk: a.prefill_chunk,
    }
    .validate()
    .map_err(usage)?;
    crate::device::check_available(a.device)?;
    a.kv.resolve(a.device)?;
    if a.link_gbps > 0.0 {
        a.device.require(crate::device::Feature::SimulatedLink)?;
    }
    Ok(disk)
}

pub fn run_serve(a: ServeArgs) -> Result<()> {
    // Validate first, then inform: nothing is printed before every check has passed.
    let disk = check_flags(&a)?;
    let kv = a.kv.resolve(a.device)?;
    let (model, _tok) = Model::load_as(
        &crate::model::resolve(a.model.clone())?,
        false,
        a.dtype.resolve(a.device),
    )?;
    // Checked before the requests are built: their total size follows from these flags.
    let longest = a.input_len.hi.saturating_add(a.output_len.hi);
    ensure!(
        longest <= model.cfg.max_position_embeddings,
        "--input-len {} plus --output-len {} reach {longest} tokens, past the model's context ({})",
        a.input_len.hi,
        a.output_len.hi,
        model.cfg.max_position_embeddings
    );
    ensure_fits(
        a.num_seqs
            .checked_mul(a.input_len.hi)
            .and_then(|t| t.checked_mul(std::mem::size_of::<u32>())),
        "the prompts",
        "--num-seqs or --input-len",
    )?;
    let (prompts, params) = make_requests(&a, model.cfg.vocab_size)?;
    let max_len = prompts
        .iter()
        .zip(&params)
        .map(|(p, r)| p.len().saturating_add(r.max_tokens))
        .max()
        .unwrap_or(0);
    ensure!(
        max_len <= model.cfg.max_position_embeddings,
        "requests reach {max_len} tokens, past the model's context ({})",
        model.cfg.max_position_embeddings
    );
    let working_set = working_set_blocks(&prompts, &params, a.block_size.max(1));
    let sched = SchedulerConfig {
        block_size: a.block_size,
        num_gpu_blocks: a.num_gpu_blocks.unwrap_or(working_set),
        max_cpu_offload_blocks: a.max_cpu_offload_blocks,
        max_disk_offload_blocks: a.disk.max_disk_offload_blocks,
        max_num_seqs: a.max_num_seqs,
        max_num_batched_tokens: a.max_num_batched_tokens,
        prefill_chunk: a.prefill_chunk,
    };
    sched.validate()?;
    ensure_fits(
        super::setup::host_kv_bytes(&model.cfg, &sched, a.device, kv),
        "the KV pools",
        "--num-gpu-blocks, --max-cpu-offload-blocks or --block-size",
    )?;
    if let Some(d) = &disk {
        // The slot file's size against the directory's free space, before the plan.
        let block = model
            .cfg
            .kv_bytes(a.block_size, kv.bytes())
            .context("a KV block's size overflows")?;
        d.check(a.disk.max_disk_offload_blocks, block)?;
    }
    print_plan(&model, &sched, working_set, kv);
    if a.table {
        return run_table(&a, &model, sched, working_set, &prompts, &params);
    }
    if a.tier_table {
        let disk =
            disk.context("--tier-table needs --disk-offload-dir and --max-disk-offload-blocks")?;
        return run_tier_table(&a, &model, sched, working_set, disk, &prompts, &params);
    }
    let r = run_once(
        &model,
        (a.device, kv),
        sched.clone(),
        a.link_gbps,
        disk,
        &prompts,
        &params,
    )?;
    let st = r.stats;
    let throughput = st.generated_tokens as f64 / r.secs.max(1e-9);
    let mut mismatches = None;
    if a.compare {
        let free = SchedulerConfig {
            num_gpu_blocks: working_set,
            max_cpu_offload_blocks: 0,
            max_disk_offload_blocks: 0,
            ..sched.clone()
        };
        ensure_fits(
            super::setup::host_kv_bytes(&model.cfg, &free, a.device, kv),
            "the unconstrained run's KV pool",
            "--num-seqs or the lengths",
        )?;
        let base = run_once(&model, (a.device, kv), free, 0.0, None, &prompts, &params)?;
        let bad = r
            .outputs
            .iter()
            .zip(&base.outputs)
            .filter(|(x, y)| x != y)
            .count();
        mismatches = Some(bad);
    }
    if a.json {
        let mut obj = serde_json::json!({
            "throughput_tokens_per_s": throughput,
            "weights_bytes": model.weight_bytes(),
            "preemptions": st.sched.preemptions,
            "blocks_stored": st.sched.blocks_stored,
            "blocks_loaded": st.sched.blocks_loaded,
            "recomputations": st.sched.recomputations,
            "prefix_hit_blocks": st.sched.prefix_hit_blocks,
            "generated_tokens": st.generated_tokens,
            "computed_tokens": st.computed_tokens,
            "prompt_tokens": st.prompt_tokens,
            "elapsed_s": r.secs,
            "num_gpu_blocks": sched.num_gpu_blocks,
            "working_set_blocks": working_set,
            "mean_ttft_s": r.mean_ttft_s,
            "blocks_stored_disk": st.sched.blocks_stored_disk,
            "blocks_demoted": st.sched.blocks_demoted,
            "blocks_loaded_disk": st.sched.blocks_loaded_disk,
            "disk_read_gbps": st.disk.read_gbps(),
            "disk_write_gbps": st.disk.write_gbps(),
            "checksum_failures": st.disk.checksum_failures,
            "disk_io_errors": st.disk.io_errors,
            "disk_load_failures": st.sched.disk_load_failures,
            "prefix_blocks_from_disk": st.sched.prefix_blocks_from_disk,
            "prefix_blocks_persisted": st.sched.prefix_blocks_persisted,
            "restored_prefix_blocks": st.restored_prefix_blocks,
        });
        if let Some(m) = mismatches {
            obj["compare_mismatches"] = m.into();
        }
        crate::outln!("{obj}")?;
    } else {
        crate::outln!(
            "requests: {} | prompt tokens: {} | generated: {} | time: {:.2} s | throughput: {:.1} tok/s",
            a.num_seqs, st.prompt_tokens, st.generated_tokens, r.secs, throughput
        )?;
        crate::outln!(
            "gpu blocks: {} of {} (working set) | preemptions: {} | blocks stored: {} | blocks loaded: {} | recomputations: {} | prefix-hit blocks: {} | tokens computed: {}",
            sched.num_gpu_blocks,
            working_set,
            st.sched.preemptions,
            st.sched.blocks_stored,
            st.sched.blocks_loaded,
            st.sched.recomputations,
            st.sched.prefix_hit_blocks,
            st.computed_tokens
        )?;
        if st.disk.slots_written + st.disk.slots_read > 0 || st.restored_prefix_blocks > 0 {
            crate::outln!(
                "disk: blocks stored {} | loaded {} | prefix blocks persisted {} / from disk {} (restored {}) | write {:.2} GB/s, read {:.2} GB/s | checksum failures {} | IO errors {}",
                st.sched.blocks_stored_disk,
                st.sched.blocks_loaded_disk,
                st.sched.prefix_blocks_persisted,
                st.sched.prefix_blocks_from_disk,
                st.restored_prefix_blocks,
                st.disk.write_gbps(),
                st.disk.read_gbps(),
                st.disk.checksum_failures,
                st.disk.io_errors
            )?;
        }
        crate::outln!("mean time to first token: {:.3} s", r.mean_ttft_s)?;
        if let Some(m) = mismatches {
            crate::outln!(
                "compare: {} of {} requests differ from the unconstrained run",
                m,
                a.num_seqs
            )?;
        }
    }
    if let Some(m) = mismatches.filter(|&m| m > 0) {
        bail!(
            "{m} of {} requests differ from the unconstrained run",
            a.num_seqs
        );
    }
    Ok(())
}

/// `--table`: the four configurations of docs/benchmarks.md, measured one after the
/// other in this process, with throughputs relative to the unconstrained run.
fn run_table(
    a: &ServeArgs,
    model: &Arc<Model>,
    sched: SchedulerConfig,
    working_set: usize,
    prompts: &[Vec<u32>],
    params: &[RequestParams],
) -> Result<()> {
    let kv = a.kv.resolve(a.device)?;
    let free = SchedulerConfig {
        num_gpu_blocks: working_set,
        max_cpu_offload_blocks: 0,
        ..sched.clone()
    };
    let third = gpu_third(working_set, prompts, params, sched.block_size);
    let rows = [
        (
            "one at a time (--max-num-seqs 1)",
            SchedulerConfig {
                max_num_seqs: 1,
                ..free.clone()
            },
        ),
        ("all at once, unconstrained", free.clone()),
        (
            "GPU blocks at a third, host offload",
            SchedulerConfig {
                num_gpu_blocks: third,
                max_cpu_offload_blocks: working_set,
                ..free.clone()
            },
        ),
        (
            "GPU blocks at a third, recompute",
            SchedulerConfig {
                num_gpu_blocks: third,
                ..free.clone()
            },
        ),
    ];
    let mut runs = Vec::new();
    for (name, cfg) in rows {
        let r = run_once(
            model,
            (a.device, kv),
            cfg.clone(),
            a.link_gbps,
            None,
            prompts,
            params,
        )?;
        runs.push((name, cfg, r));
    }
    let tput = BenchRun::throughput;
    let base = tput(&runs[1].2);
    let differ = most_differing(runs.iter().map(|r| &r.2), &runs[1].2);
    if a.json {
        let rows: Vec<_> = runs
            .iter()
            .map(|(name, cfg, r)| {
                serde_json::json!({
                    "configuration": name,
                    "num_gpu_blocks": cfg.num_gpu_blocks,
                    "throughput_tokens_per_s": tput(r),
                    "relative_to_unconstrained": tput(r) / base,
                    "preemptions": r.stats.sched.preemptions,
                    "blocks_stored": r.stats.sched.blocks_stored,
                    "blocks_loaded": r.stats.sched.blocks_loaded,
                    "recomputations": r.stats.sched.recomputations,
                    "computed_tokens": r.stats.computed_tokens,
                    "steps": r.stats.steps,
                    "elapsed_s": r.secs,
                })
            })
            .collect();
        crate::outln!(
            "{}",
            serde_json::json!({"working_set_blocks": working_set, "runs": rows, "mismatches": differ})
        )?;
    } else {
        crate::outln!("{}", runs[1].2.summary(prompts.len(), working_set))?;
        crate::outln!("| configuration | GPU blocks | tok/s | × unconstrained | preemptions | stored / loaded | recomputations | tokens computed |")?;
        crate::outln!("|---|---|---|---|---|---|---|---|")?;
        for (name, cfg, r) in &runs {
            let st = &r.stats;
            crate::outln!(
                "| {name} | {} | {:.1} | {:.2} | {} | {} / {} | {} | {} |",
                cfg.num_gpu_blocks,
                tput(r),
                tput(r) / base,
                st.sched.preemptions,
                st.sched.blocks_stored,
                st.sched.blocks_loaded,
                st.sched.recomputations,
                st.computed_tokens
            )?;
        }
        crate::outln!(
            "all at once / one at a time: {:.2}x | offload / recompute: {:.2}x | runs differing from the unconstrained tokens: {differ}",
            base / tput(&runs[0].2),
            tput(&runs[2].2) / tput(&runs[3].2)
        )?;
    }
    ensure!(
        differ == 0,
        "{differ} requests differ from the unconstrained run"
    );
    Ok(())
}

/// GPU blocks for the constrained rows of the tables: a third of the working set, but at
/// least the longest request (which must fit alone).
fn gpu_third(
    working_set: usize,
    prompts: &[Vec<u32>],
    params: &[RequestParams],
    bs: usize,
) -> usize {
    (working_set / 3).max(
        prompts
            .iter()
            .zip(params)
            .map(|(p, r)| (p.len() + r.max_tokens).div_ceil(bs))
            .max()
            .unwrap_or(1),
    )
}

/// `--tier-table`: the disk tier against recomputation on the same constrained pools, and
/// the unconstrained run (the reference tokens), one after the other in this process.
fn run_tier_table(
    a: &ServeArgs,
    model: &Arc<Model>,
    sched: SchedulerConfig,
    working_set: usize,
    disk: DiskTierConfig,
    prompts: &[Vec<u32>],
    params: &[RequestParams],
) -> Result<()> {
    let kv = a.kv.resolve(a.device)?;
    let free = SchedulerConfig {
        num_gpu_blocks: working_set,
        max_cpu_offload_blocks: 0,
        max_disk_offload_blocks: 0,
        ..sched.clone()
    };
    let tight = SchedulerConfig {
        num_gpu_blocks: gpu_third(working_set, prompts, params, sched.block_size),
        max_cpu_offload_blocks: (working_set / 10).max(1),
        ..free.clone()
    };
    let with_disk = SchedulerConfig {
        max_disk_offload_blocks: sched.max_disk_offload_blocks,
        ..tight.clone()
    };
    ensure_fits(
        super::setup::host_kv_bytes(&model.cfg, &free, a.device, kv),
        "the unconstrained run's KV pool",
        "--num-seqs or the lengths",
    )?;
    let rows = [
        ("unconstrained", free, None),
        ("GPU 1/3, host 1/10, disk tier", with_disk, Some(disk)),
        ("GPU 1/3, host 1/10, recompute", tight, None),
    ];
    let mut runs = Vec::new();
    for (name, cfg, disk) in rows {
        let r = run_once(
            model,
            (a.device, kv),
            cfg.clone(),
            a.link_gbps,
            disk,
            prompts,
            params,
        )?;
        ensure!(
            r.stats.restored_prefix_blocks == 0,
            "give --tier-table an empty --disk-offload-dir: {} persisted prefix blocks of an earlier run would favour the disk tier",
            r.stats.restored_prefix_blocks
        );
        runs.push((name, cfg, r));
    }
    let tput = BenchRun::throughput;
    let differ = most_differing(runs.iter().map(|r| &r.2), &runs[0].2);
    let ratio = tput(&runs[1].2) / tput(&runs[2].2);
    if a.json {
        let rows: Vec<_> = runs
            .iter()
            .map(|(name, cfg, r)| {
                let st = &r.stats;
                serde_json::json!({
                    "configuration": name,
                    "num_gpu_blocks": cfg.num_gpu_blocks,
                    "max_cpu_offload_blocks": cfg.max_cpu_offload_blocks,
                    "max_disk_offload_blocks": cfg.max_disk_offload_blocks,
                    "throughput_tokens_per_s": tput(r),
                    "elapsed_s": r.secs,
                    "mean_ttft_s": r.mean_ttft_s,
                    "computed_tokens": st.computed_tokens,
                    "preemptions": st.sched.preemptions,
                    "recomputations": st.sched.recomputations,
                    "blocks_stored": st.sched.blocks_stored,
                    "blocks_stored_disk": st.sched.blocks_stored_disk,
                    "blocks_demoted": st.sched.blocks_demoted,
                    "blocks_loaded_disk": st.sched.blocks_loaded_disk,
                    "prefix_blocks_persisted": st.sched.prefix_blocks_persisted,
                    "disk_write_gbps": st.disk.write_gbps(),
                    "disk_read_gbps": st.disk.read_gbps(),
                })
            })
            .collect();
        crate::outln!(
            "{}",
            serde_json::json!({"working_set_blocks": working_set, "runs": rows,
                "disk_over_recompute": ratio, "mismatches": differ})
        )?;
    } else {
        crate::outln!("{}", runs[0].2.summary(prompts.len(), working_set))?;
        crate::outln!("| configuration | GPU / host / disk blocks | tok/s | elapsed s | tokens computed | preemptions | recomputations | to host | to disk (demoted) / from disk | write-through blocks | disk write / read GB/s |")?;
        crate::outln!("|---|---|---|---|---|---|---|---|---|---|---|")?;
        for (name, cfg, r) in &runs {
            let st = &r.stats;
            crate::outln!(
                "| {name} | {} / {} / {} | {:.1} | {:.1} | {} | {} | {} | {} | {} ({}) / {} | {} | {:.2} / {:.2} |",
                cfg.num_gpu_blocks,
                cfg.max_cpu_offload_blocks,
                cfg.max_disk_offload_blocks,
                tput(r),
                r.secs,
                st.computed_tokens,
                st.sched.preemptions,
                st.sched.recomputations,
                st.sched.blocks_stored - (st.sched.blocks_stored_disk - st.sched.blocks_demoted),
                st.sched.blocks_stored_disk,
                st.sched.blocks_demoted,
                st.sched.blocks_loaded_disk,
                st.sched.prefix_blocks_persisted,
                st.disk.write_gbps(),
                st.disk.read_gbps(),
            )?;
        }
        crate::outln!(
            "disk tier / recompute: {ratio:.2}x | runs differing from the unconstrained tokens: {differ}"
        )?;
    }
    ensure!(
        differ == 0,
        "{differ} requests differ from the unconstrained run"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn len_ranges_parse_and_reject_bad_input() {
        assert_eq!("5:9".parse::<LenRange>(), Ok(LenRange { lo: 5, hi: 9 }));
        assert_eq!("7".parse::<LenRange>(), Ok(LenRange { lo: 7, hi: 7 }));
        for bad in ["5:2", "0:3", "a:b", ":", "3:", "-1:4"] {
            assert!(bad.parse::<LenRange>().is_err(), "{bad} accepted");
        }
    }
}
