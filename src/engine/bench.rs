//! `strata bench decode`: plain decode (and the prefill before it) at given context
//! lengths, with what a decode token reads from memory — the weights it multiplies with
//! and the KV it attends over — against the machine's read bandwidth measured in the same
//! run. A small model on a CPU is bound by memory bandwidth, so the achieved fraction of
//! it is how close decode is to its ceiling (docs/cpu.md, "Decode budget").
//!
//! Each context is prefilled once (random token ids, seeded), then decoded in `--rounds`
//! rounds of `--decode-steps` greedy steps, each round from the end of the prefill again
//! (the same positions every round), so rounds differ only by the machine's drift; the
//! report gives the median and the range. The bandwidth is probed again right before every
//! round and each round's fraction taken against its own probe: on a machine whose speed
//! drifts (a shared VM's moved between 30 and 47 GB/s within an hour), a probe taken once
//! at the start made the fraction follow the drift instead of the decode.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rayon::prelude::*;

use crate::device::KvElem;
use crate::engine::sampler::argmax;
use crate::flags;
use crate::kv::ContiguousKv;
use crate::model::op_times::{Op, OpTimes, Recording};
use crate::model::weights::{LayerWeights, Weight};
use crate::model::{Model, ModelConfig};
use crate::offload::bench::{median, range};

/// `strata bench decode`.
#[derive(Debug, Clone, clap::Args)]
pub struct DecodeBenchArgs {
    /// GGUF file or Hugging Face model directory [default: $STRATA_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Context lengths (tokens, comma-separated): each is prefilled, then decoded from.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096", value_parser = flags::tokens())]
    pub context: Vec<usize>,
    /// Greedy decode steps timed per round.
    #[arg(long, default_value_t = 32, value_parser = flags::tokens())]
    pub decode_steps: usize,
    /// Timed rounds per context, each from the end of the prefill again.
    #[arg(long, default_value_t = 5, value_parser = flags::rounds())]
    pub rounds: usize,
    #[command(flatten)]
    pub dtype: flags::WeightDtypeArg,
    #[command(flatten)]
    pub kv: flags::KvDtypeArg,
    /// Also time each op of the decode steps (the layers' Q/K/V, attention, output, gate/up
    /// and down, the LM head; the rest as "other"): time a token and the read bandwidth
    /// each achieves, to see which falls short of the machine's.
    #[arg(long)]
    pub ops: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DecodeBenchReport {
    pub model: String,
    pub dtype: String,
    pub kv_dtype: String,
    pub threads: usize,
    /// The machine's read bandwidth, measured at the start (`Probe::gbps`) with every
    /// compute thread. The fractions below are of the probe taken before each round.
    pub read_gbps: f64,
    /// The same with one thread (how much of it one core can draw alone).
    pub read_gbps_one_thread: f64,
    pub rows: Vec<DecodeRow>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DecodeRow {
    pub context: usize,
    pub prefill_tokens_per_s: f64,
    /// Median over the rounds, and each round's.
    pub decode_tokens_per_s: f64,
    pub decode_tokens_per_s_per_round: Vec<f64>,
    /// What one decode token reads: weights (`ModelWeights::decode_read_bytes`) and the
    /// K and V of every layer at the row's context (the mean over the timed positions).
    pub weight_bytes_per_token: u64,
    pub kv_bytes_per_token: u64,
    /// (weights + KV) × decode tokens/s.
    pub achieved_gbps: f64,
    /// The read bandwidth probed right before each round (`Probe::gbps`), GB/s.
    pub read_gbps_per_round: Vec<f64>,
    /// Each round's achieved GB/s ÷ its own probe.
    pub bandwidth_fraction_per_round: Vec<f64>,
    /// The median of `bandwidth_fraction_per_round`.
    pub bandwidth_fraction: f64,
    /// With `--ops`: each op's share of the timed decode steps (all rounds together), then
    /// "other" (what no op covers: norms, RoPE, the argmax between steps).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ops: Option<Vec<OpRow>>,
}

/// One op of a decode token (`--ops`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpRow {
    pub op: String,
    /// Wall time a token, milliseconds.
    pub ms_per_token: f64,
    /// Of the whole step's.
    pub share: f64,
    /// What the op reads a token (its weights; attention: the K and V, as
    /// `kv_bytes_per_token`); 0 for "other".
    pub bytes_per_token: u64,
    /// bytes ÷ time; 0 for "other".
    pub gbps: f64,
}

/// Bytes the bandwidth probe reads: far more than any last-level cache.
const PROBE_BYTES: usize = 512 << 20;
/// Passes of the probe; the best counts (the others met a busier machine).
const PROBE_PASSES: usize = 5;

/// The command: check the flags against the model's configuration, load it, measure, print
/// the table (or JSON).
pub fn run(args: DecodeBenchArgs) -> Result<()> {
    let path = crate::model::resolve(args.model.clone())?;
    let kv_dtype = args.kv.resolve(crate::device::DeviceKind::Cpu)?;
    let dtype = args.dtype.resolve(crate::device::DeviceKind::Cpu);
    check_contexts(&args, &Model::peek_config(&path)?)?;
    // Checked: say what the next minutes do (the table comes at the end; each round
    // first reads the bandwidth probe, PROBE_PASSES × PROBE_BYTES).
    super::print_threads_note();
    eprintln!(
        "strata bench decode: contexts {:?}, weights {}, KV {kv_dtype}, {} rounds × {} decode steps, \
         the read bandwidth probed before each round",
        args.context,
        dtype.name(),
        args.rounds,
        args.decode_steps,
    );
    let (model, _) = Model::load_as(&path, !args.json, dtype)?;
    let probe = Probe::new(PROBE_BYTES)?;
    let read_gbps_one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()?
        .install(|| probe.gbps(PROBE_PASSES));
    let read_gbps = probe.gbps(PROBE_PASSES);
    let mut rows = Vec::new();
    for &context in &args.context {
        let row = crate::with_kv_elem!(kv_dtype, T => {
            bench_context::<T>(&model, &args, context, &probe)?
        });
        rows.push(row);
    }
    let report = DecodeBenchReport {
        model: path.display().to_string(),
        dtype: dtype.name().to_string(),
        kv_dtype: kv_dtype.to_string(),
        threads: rayon::current_num_threads(),
        read_gbps,
        read_gbps_one_thread,
        rows,
    };
    if args.json {
        crate::outln!("{}", serde_json::to_string(&report)?)?;
    } else {
        crate::outln!("{report}")?;
    }
    Ok(())
}

/// Every context plus the decoded steps fits the model's context.
fn check_contexts(args: &DecodeBenchArgs, cfg: &ModelConfig) -> Result<()> {
    let max = cfg.max_position_embeddings;
    for &c in &args.context {
        if c.saturating_add(args.decode_steps) > max {
            bail!(
                "--context {c} + --decode-steps {} is more than the model's context ({max})",
                args.decode_steps
            );
        }
    }
    Ok(())
}

fn bench_context<T: KvElem>(
    model: &Model,
    args: &DecodeBenchArgs,
    context: usize,
    probe: &Probe,
) -> Result<DecodeRow> {
    let c = &model.cfg;
    let mut rng = StdRng::seed_from_u64(context as u64);
    let low = 100.min(c.vocab_size as u32 - 1);
    let prompt: Vec<u32> = (0..context)
        .map(|_| rng.random_range(low..c.vocab_size as u32))
        .collect();
    let steps = args.decode_steps;
    let mut kv = ContiguousKv::<T>::for_model(c, context + steps);
    let t0 = Instant::now();
    let first = model.forward(&prompt, 0, &mut kv)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    // Each round decodes from the prefilled context: KV rows are overwritten in place, a
    // recurrent state is put back.
    let prefilled = kv.states().save(0)?;
    let top_k = model.cfg.moe.map_or(0, |m| m.top_k);
    let weight_bytes = model.weights.decode_read_bytes(top_k) as u64;
    // Step at position p attends over p + 1 rows of K and V in a full layer, at most its
    // window in a windowed one (elements T), none in a state layer, which reads (and
    // rewrites) its f32 state instead.
    let mean_rows = context as f64 + (steps as f64 + 1.0) / 2.0;
    let rows: f64 = (0..c.num_layers)
        .filter(|&l| c.keeps_kv(l))
        .map(|l| c.window(l).map_or(mean_rows, |w| mean_rows.min(w as f64)))
        .sum();
    let row_bytes = 2 * c.kv_dim() * std::mem::size_of::<T>();
    let kv_bytes = (rows * row_bytes as f64) as u64 + kv.states().seq_bytes() as u64;
    let gbps = |tokens_per_s: f64| (weight_bytes + kv_bytes) as f64 * tokens_per_s / 1e9;
    let mut per_round = Vec::with_capacity(args.rounds);
    let mut probes = Vec::with_capacity(args.rounds);
    let (mut op_times, mut decode_s) = (OpTimes::default(), 0.0);
    for _ in 0..args.rounds {
        probes.push(probe.gbps(PROBE_PASSES));
        let mut logits = first.clone();
        kv.states().restore(0, &prefilled)?;
        let recording = args.ops.then(Recording::start);
        let t = Instant::now();
        for pos in context..context + steps {
            logits = model.forward(&[argmax(&logits)], pos, &mut kv)?;
        }
        let round_s = t.elapsed().as_secs_f64();
        if let Some(r) = recording {
            op_times += r.finish();
        }
        decode_s += round_s;
        per_round.push(steps as f64 / round_s.max(1e-9));
    }
    let ops = args.ops.then(|| {
        let tokens = (args.rounds * steps) as f64;
        op_rows(
            &op_times,
            &op_bytes(model, kv_bytes),
            decode_s / tokens,
            tokens,
        )
    });
    let decode = median(&per_round);
    let fractions: Vec<f64> = per_round
        .iter()
        .zip(&probes)
        .map(|(&tps, &read)| gbps(tps) / read)
        .collect();
    Ok(DecodeRow {
        context,
        prefill_tokens_per_s: context as f64 / prefill_s.max(1e-9),
        decode_tokens_per_s: decode,
        decode_tokens_per_s_per_round: per_round,
        weight_bytes_per_token: weight_bytes,
        kv_bytes_per_token: kv_bytes,
        achieved_gbps: gbps(decode),
        read_gbps_per_round: probes,
        bandwidth_fraction: median(&fractions),
        bandwidth_fraction_per_round: fractions,
        ops,
    })
}

/// What each op reads a decode token, as `Op::ALL`: its weights over every layer (the LM
/// head's once); attention the K and V (`kv_bytes`).
fn op_bytes(model: &Model, kv_bytes: u64) -> Vec<u64> {
    let w = &model.weights;
    let layers =
        |f: fn(&LayerWeights) -> &Weight| w.layers.iter().map(|l| f(l).bytes() as u64).sum();
    let top_k = model.cfg.moe.map_or(0, |m| m.top_k);
    let layers_u64 =
        |f: &dyn Fn(&LayerWeights) -> usize| -> u64 { w.layers.iter().map(|l| f(l) as u64).sum() };
    Op::ALL
        .iter()
        .map(|op| match op {
            Op::Qkv => layers(|l| &l.wqkv),
            Op::Attention => kv_bytes,
            Op::OutProj => layers(|l| &l.wo),
            Op::GateUp => layers_u64(&|l: &LayerWeights| l.mlp.token_op_bytes(top_k).0),
            Op::Down => layers_u64(&|l: &LayerWeights| l.mlp.token_op_bytes(top_k).1),
            Op::LmHead => w.lm_head().bytes() as u64,
        })
        .collect()
}

/// The `--ops` rows: each op's time a token (`times` summed over `tokens` steps of
/// `step_s` seconds each), share and bandwidth (`bytes` as `Op::ALL`), then "other".
fn op_rows(times: &OpTimes, bytes: &[u64], step_s: f64, tokens: f64) -> Vec<OpRow> {
    let mut rows: Vec<OpRow> = Op::ALL
        .iter()
        .zip(bytes)
        .map(|(&op, &b)| {
            let s = times.get(op).as_secs_f64() / tokens;
            OpRow {
                op: op.name().to_string(),
                ms_per_token: 1e3 * s,
                share: s / step_s,
                bytes_per_token: b,
                gbps: if s > 0.0 { b as f64 / s / 1e9 } else { 0.0 },
            }
        })
        .collect();
    let other = (step_s - times.total().as_secs_f64() / tokens).max(0.0);
    rows.push(OpRow {
        op: "other".to_string(),
        ms_per_token: 1e3 * other,
        share: other / step_s,
        bytes_per_token: 0,
        gbps: 0.0,
    });
    rows
}

/// A buffer far larger than any last-level cache, written once (so every page is
/// resident), whose plain sum measures the machine's read bandwidth.
pub struct Probe {
    buf: Vec<u64>,
}

impl Probe {
    pub fn new(bytes: usize) -> Result<Self> {
        let n = bytes / 8;
        let mut buf: Vec<u64> = Vec::new();
        buf.try_reserve_exact(n)
            .map_err(|_| anyhow::anyhow!("cannot allocate the bandwidth probe's {bytes} bytes"))?;
        buf.extend((0..n as u64).map(|i| i.wrapping_mul(0x9e37_79b9)));
        Ok(Self { buf })
    }

    /// The read bandwidth with the compute threads (rayon's pool), GB/s: the best of
    /// `passes` passes summing the buffer, one contiguous chunk per thread (as decode
    /// streams a weight matrix's rows).
    pub fn gbps(&self, passes: usize) -> f64 {
        let bytes = std::mem::size_of_val(self.buf.as_slice());
        let chunk = self.buf.len().div_ceil(rayon::current_num_threads()).max(1);
        let mut best = 0.0f64;
        for _ in 0..passes {
            let t = Instant::now();
            let sum = self
                .buf
                .par_chunks(chunk)
                .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
                .reduce(|| 0, u64::wrapping_add);
            std::hint::black_box(sum);
            best = best.max(bytes as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9);
        }
        best
    }
}

impl std::fmt::Display for DecodeBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bench decode: {} ({}, KV {}), {} threads, measured read bandwidth {:.1} GB/s ({:.1} GB/s one thread)",
            self.model, self.dtype, self.kv_dtype, self.threads, self.read_gbps, self.read_gbps_one_thread
        )?;
        writeln!(
            f,
            "{:>8} {:>12} {:>11} {:>17} {:>10} {:>8} {:>10} {:>8} {:>11} {:>13}",
            "context",
            "prefill t/s",
            "decode t/s",
            "(range)",
            "weights MB",
            "KV MB",
            "read GB/s",
            "of peak",
            "(range)",
            "probed GB/s"
        )?;
        for r in &self.rows {
            let (lo, hi) = range(&r.decode_tokens_per_s_per_round);
            let (flo, fhi) = range(&r.bandwidth_fraction_per_round);
            let (plo, phi) = range(&r.read_gbps_per_round);
            writeln!(
                f,
                "{:>8} {:>12.1} {:>11.1} {:>17} {:>10.1} {:>8.1} {:>10.2} {:>7.0}% {:>11} {:>13}",
                r.context,
                r.prefill_tokens_per_s,
                r.decode_tokens_per_s,
                format!("{lo:.1}-{hi:.1}"),
                r.weight_bytes_per_token as f64 / 1e6,
                r.kv_bytes_per_token as f64 / 1e6,
                r.achieved_gbps,
                100.0 * r.bandwidth_fraction,
                format!("{:.0}-{:.0}%", 100.0 * flo, 100.0 * fhi),
                format!("{plo:.1}-{phi:.1}")
            )?;
        }
        writeln!(
            f,
            "(\"of peak\": the median over the rounds of each round's read GB/s ÷ the bandwidth probed right before it \
             (\"probed GB/s\": those probes' range; on a shared machine they move with the neighbours' load); \
             above 100%, part of the bytes came from the CPU's caches instead of memory)"
        )?;
        for r in &self.rows {
            let Some(ops) = &r.ops else { continue };
            let probe = median(&r.read_gbps_per_round);
            writeln!(
                f,
                "\nops of a decode token at context {} (all rounds; \"of probe\": of the rounds' median probe, {probe:.1} GB/s):",
                r.context
            )?;
            writeln!(
                f,
                "{:>10} {:>8} {:>7} {:>9} {:>9} {:>9}",
                "op", "ms", "share", "MB", "GB/s", "of probe"
            )?;
            for o in ops {
                if o.bytes_per_token == 0 {
                    writeln!(
                        f,
                        "{:>10} {:>8.3} {:>6.1}%",
                        o.op,
                        o.ms_per_token,
                        100.0 * o.share
                    )?;
                } else {
                    writeln!(
                        f,
                        "{:>10} {:>8.3} {:>6.1}% {:>9.1} {:>9.1} {:>8.0}%",
                        o.op,
                        o.ms_per_token,
                        100.0 * o.share,
                        o.bytes_per_token as f64 / 1e6,
                        o.gbps,
                        100.0 * o.gbps / probe
                    )?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_reads_at_a_plausible_speed() {
        // 64 MiB: beyond caches of this kind of machine, fast enough for a unit test. A
        // probe that read nothing (optimised away) would report absurd speeds.
        let g = Probe::new(64 << 20).unwrap().gbps(2);
        assert!((0.1..2_000.0).contains(&g), "{g} GB/s");
    }

    /// The printed report of one row (a 2-thread q8 / f16 run).
    fn table_of(row: DecodeRow) -> String {
        DecodeBenchReport {
            model: "m.gguf".into(),
            dtype: "q8".into(),
            kv_dtype: "f16".into(),
            threads: 2,
            read_gbps: 34.0,
            read_gbps_one_thread: 29.0,
            rows: vec![row],
        }
        .to_string()
    }

    /// The first line of `text` whose first word starts with `word`.
    fn line_starting<'a>(text: &'a str, word: &str) -> &'a str {
        text.lines()
            .find(|l| l.trim_start().starts_with(word))
            .unwrap_or_else(|| panic!("no line of {word}: {text}"))
    }

    #[test]
    fn the_table_shows_the_range_of_the_probes_each_row_was_measured_against() {
        let row = DecodeRow {
            context: 1024,
            prefill_tokens_per_s: 400.0,
            decode_tokens_per_s: 200.0,
            decode_tokens_per_s_per_round: vec![190.0, 200.0, 210.0],
            weight_bytes_per_token: 96_600_000,
            kv_bytes_per_token: 24_000_000,
            achieved_gbps: 24.1,
            read_gbps_per_round: vec![55.3, 34.0, 33.6],
            bandwidth_fraction_per_round: vec![0.4, 0.7, 0.75],
            bandwidth_fraction: 0.7,
            ops: None,
        };
        let text = table_of(row);
        let header = text.lines().nth(1).unwrap();
        let line = text.lines().nth(2).unwrap();
        assert!(header.trim_end().ends_with("probed GB/s"), "{header}");
        // The lowest and the highest probe, whatever the rounds' order.
        assert!(line.trim_end().ends_with(" 33.6-55.3"), "{line}");
        assert!(line.contains(" 70% ") && line.contains("40-75%"), "{line}");
        assert!(
            !text.contains("ops of a decode token"),
            "no --ops, no op table"
        );
    }

    /// Each op's time a token, share and bandwidth from the summed times; "other" is what
    /// the ops leave of the step.
    #[test]
    fn op_rows_divide_the_summed_times_by_the_tokens() {
        use crate::model::op_times::timed;
        let sleep = |ms| std::thread::sleep(std::time::Duration::from_millis(ms));
        // Sums made by a recording (OpTimes has no constructor from values).
        let rec = Recording::start();
        timed(Op::GateUp, || sleep(40));
        timed(Op::Attention, || sleep(20));
        let times = rec.finish();
        let (gu, attn) = (times.get(Op::GateUp), times.get(Op::Attention));
        let bytes = [0, 1_000_000, 0, 4_000_000, 0, 0];
        // 4 tokens of 25 ms each.
        let rows = op_rows(&times, &bytes, 0.025, 4.0);
        assert_eq!(rows.len(), Op::ALL.len() + 1);
        let row = |name: &str| rows.iter().find(|r| r.op == name).unwrap();
        let g = row("gate_up");
        let per_token = gu.as_secs_f64() / 4.0;
        assert!((g.ms_per_token - 1e3 * per_token).abs() < 1e-9);
        assert!((g.share - per_token / 0.025).abs() < 1e-9);
        assert!((g.gbps - 4e6 / per_token / 1e9).abs() < 1e-9);
        assert_eq!(row("qkv").ms_per_token, 0.0);
        assert_eq!(
            row("qkv").gbps,
            0.0,
            "no time, no bandwidth (not a division by zero)"
        );
        let other = row("other");
        let timed = (gu + attn).as_secs_f64() / 4.0;
        assert!((other.ms_per_token - 1e3 * (0.025 - timed)).abs() < 1e-9);
        let shares: f64 = rows.iter().map(|r| r.share).sum();
        assert!(
            (shares - 1.0).abs() < 1e-9,
            "shares sum to the step: {shares}"
        );
    }

    #[test]
    fn the_op_table_follows_the_main_table_per_context() {
        let ops = vec![
            OpRow {
                op: "attention".into(),
                ms_per_token: 4.12,
                share: 0.495,
                bytes_per_token: 94_800_000,
                gbps: 23.0,
            },
            OpRow {
                op: "other".into(),
                ms_per_token: 0.25,
                share: 0.03,
                bytes_per_token: 0,
                gbps: 0.0,
            },
        ];
        let row = DecodeRow {
            context: 4096,
            prefill_tokens_per_s: 300.0,
            decode_tokens_per_s: 120.0,
            decode_tokens_per_s_per_round: vec![120.0],
            weight_bytes_per_token: 96_600_000,
            kv_bytes_per_token: 94_800_000,
            achieved_gbps: 23.0,
            read_gbps_per_round: vec![46.0],
            bandwidth_fraction_per_round: vec![0.5],
            bandwidth_fraction: 0.5,
            ops: Some(ops),
        };
        let text = table_of(row);
        assert!(
            text.contains("ops of a decode token at context 4096"),
            "{text}"
        );
        let attn = line_starting(&text, "attention");
        // 23.0 GB/s of the 46.0 probe: 50%.
        assert!(
            attn.contains(" 94.8 ") && attn.trim_end().ends_with(" 50%"),
            "{attn}"
        );
        let other = line_starting(&text, "other");
        assert!(
            other.trim_end().ends_with("3.0%"),
            "other has no bandwidth: {other}"
        );
    }
}
