//! `needle`: needle-in-a-haystack retrieval at chosen input lengths and depths, with and
//! without layerwise offload, and the offload accuracy comparison (`--compare-offload`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use strata::{errors, flags};

use strata::device::{self, DeviceKind, Feature};
use strata::engine::{self, GenerateOptions, GenerationOutput, SamplingParams};
use strata::model::Model;
use strata::needle::{answer_found, Case, NeedleKind};
use strata::offload::OffloadConfig;
use strata::{Session, SessionConfig};

/// New tokens allowed for the answer: small models often restate the question first.
const NEW_TOKENS: usize = 32;
/// Room beyond the value's own tokens (a UUID alone can take 30+ tokens).
const ANSWER_SLACK: usize = 24;

#[derive(Parser)]
#[command(
    name = "needle",
    version,
    about = "Needle-in-a-haystack retrieval test for strata"
)]
struct Args {
    /// GGUF file or Hugging Face model directory [default: $STRATA_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Context limit [default: the longest --input-len plus 32 answer tokens]
    #[arg(long, value_parser = flags::tokens())]
    max_model_len: Option<usize>,
    /// Prompt lengths in tokens, chat template included (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1024", value_parser = flags::tokens())]
    input_len: Vec<usize>,
    /// Needle depths in [0, 1] (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.5,0.9", value_parser = flags::fraction)]
    depth: Vec<f64>,
    #[arg(long, value_enum, default_value_t = NeedleKind::MagicNumber)]
    needle_kind: NeedleKind,
    /// Seed for keys and values (reported with each case).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run every case this many times in one process (catches state leaking between requests).
    #[arg(long, default_value_t = 1, value_parser = flags::repeats())]
    repeats: usize,
    /// Run with layerwise KV offload.
    #[arg(long)]
    enable_offload: bool,
    /// Run each case with and without offload; fail on any token mismatch.
    #[arg(long, conflicts_with = "enable_offload")]
    compare_offload: bool,
    #[arg(long, default_value_t = 4, value_parser = flags::kv_buffers())]
    num_kv_buffers: usize,
    #[arg(long, default_value_t = 256, value_parser = flags::block_size())]
    block_size: usize,
    /// Host KV blocks per layer [default: enough for --max-model-len]
    #[arg(long, value_parser = flags::blocks())]
    num_cpu_blocks: Option<usize>,
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    #[command(flatten)]
    dtype: flags::WeightDtypeArg,
    #[command(flatten)]
    kv: flags::KvDtypeArg,
    /// Sanitizer (with offload, CPU device): poison released ring slots and delay copies at
    /// random, so a missing wait changes the answer.
    #[arg(long)]
    sanitize: bool,
    #[command(flatten)]
    sparse: strata::sparse::SparseArgs,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct CaseReport {
    input_len: usize,
    depth: f64,
    kind: NeedleKind,
    repeat: usize,
    seed: u64,
    key: String,
    value: String,
    offload: bool,
    passed: bool,
    answer: String,
    prefill_s: f64,
    ttft_s: f64,
    decode_tokens_per_s: f64,
    peak_memory_mib: f64,
    /// With --compare-offload: tokens identical with and without offload.
    tokens_agree: Option<bool>,
    /// With --compare-offload: largest |log p(offload) - log p(resident)| over the answer tokens.
    max_logprob_diff: Option<f32>,
    /// With --sparse-budget: the budget, and the share of selected pages already prefetched.
    sparse_budget: Option<usize>,
    sparse_hit_rate: Option<f64>,
    /// With --sparse-verify: drafted and kept tokens (the answer is full attention's).
    sparse_verify: Option<strata::engine::verified::VerifyStats>,
}

fn main() -> ExitCode {
    if let Some(code) = strata::model::template::worker::enter() {
        return code;
    }
    let args = match errors::parse_args::<Args>("needle") {
        Ok(args) => args,
        Err(code) => return code,
    };
    // The model runs on this thread: make it a compute thread (as `strata generate` does).
    if let Err(e) = strata::engine::compute_on_this_thread() {
        return errors::report(&e);
    }
    match run(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => errors::report_for(&e, Some("needle")),
    }
}

/// Generates the answer greedily, on the session's KV (offloaded when asked) or, for
/// `--compare-offload`'s reference, all resident; returns the output and the time to the
/// first token.
fn answer(
    session: &mut Session,
    resident: bool,
    ids: &[u32],
    new_tokens: usize,
) -> Result<(GenerationOutput, f64)> {
    let opts = GenerateOptions {
        max_tokens: new_tokens,
        sampling: SamplingParams::default(),
        stop_ids: session.model().cfg.eos_token_ids.clone(),
    };
    let start = Instant::now();
    let mut ttft = None;
    let mut on_token = |_| {
        ttft.get_or_insert(start.elapsed().as_secs_f64());
        Ok(())
    };
    let out = if resident {
        session.generate_resident(ids, &opts, &mut on_token)?
    } else {
        session.generate(ids, &opts, &mut on_token)?
    };
    Ok((out, ttft.unwrap_or(0.0)))
}

fn run(args: Args) -> Result<bool> {
    // Validate first, then inform: the flags, the model and every case's prompt are
    // checked before the plan (or anything else) is printed.
    let offloaded = args.enable_offload || args.compare_offload;
    if args.sanitize && !offloaded {
        return Err(errors::usage(
            "--sanitize checks the offload engine's ordering: add --enable-offload or --compare-offload",
        ));
    }
    device::check_available(args.device)?;
    let kv_dtype = args.kv.resolve(args.device)?;
    let path = strata::model::resolve(args.model.clone())?;
    let (model, tok) = Model::load_as(&path, !args.json, args.dtype.resolve(args.device))?;
    let longest = *args
        .input_len
        .iter()
        .max()
        .context("give at least one --input-len")?;
    let answer_room = if args.needle_kind == NeedleKind::Uuid {
        2 * NEW_TOKENS
    } else {
        NEW_TOKENS
    };
    let max_len = args.max_model_len.unwrap_or(longest + answer_room);
    if max_len > model.cfg.max_position_embeddings {
        bail!(
            "--max-model-len {max_len} exceeds the model's context of {} tokens",
            model.cfg.max_position_embeddings
        );
    }
    if longest.saturating_add(NEW_TOKENS) > max_len {
        // Only flags decide this when --max-model-len is given (a usage error).
        let e = anyhow::anyhow!("--input-len {longest} leaves no room for the {NEW_TOKENS}-token answer within --max-model-len {max_len}");
        return Err(match args.max_model_len {
            Some(_) => errors::usage(e),
            None => e,
        });
    }
    let sparse = args.sparse.config(offloaded)?;
    if args.sanitize {
        args.device.require(Feature::Sanitizer)?;
    }
    let ocfg = offloaded.then(|| OffloadConfig {
        num_kv_buffers: args.num_kv_buffers,
        block_size: args.block_size,
        max_model_len: max_len,
        num_cpu_blocks: args.num_cpu_blocks,
        sanitize: args.sanitize,
        sparse,
        ..Default::default()
    });
    let session_cfg = SessionConfig {
        offload: ocfg,
        kv_dtype,
        sparse_verify: args.sparse.verify()?,
        ..SessionConfig::new(args.device, max_len)
    };
    let plan = session_cfg.plan(&model.cfg)?;
    // --num-cpu-blocks may hold less than --max-model-len: the longest case and its answer
    // must fit what the engine holds, or the run would fail after its first cases.
    let (cap, need) = (
        session_cfg.capacity(&model.cfg)?,
        longest.saturating_add(NEW_TOKENS),
    );
    if need > cap {
        return Err(errors::usage(format!(
            "--input-len {longest} and the {NEW_TOKENS}-token answer need {need} tokens, the offload engine holds {cap} (--num-cpu-blocks × --block-size {}); raise --num-cpu-blocks",
            args.block_size
        )));
    }
    // Every input length builds its prompt (one that is too short fails here, not after
    // the plan and the first rows).
    for &input_len in &args.input_len {
        Case {
            input_len,
            depth: args.depth.first().copied().unwrap_or(0.5),
            kind: args.needle_kind,
            seed: args.seed,
        }
        .build(&tok)?;
    }
    // Checked: say what the run holds (on stderr, so `--json`'s stdout stays one object; a
    // long JSON run is otherwise silent until its end).
    strata::engine::print_threads_note();
    eprintln!(
        "needle: {} cases (input lengths {:?} × {} depths × {} repeats)",
        args.input_len.len() * args.depth.len() * args.repeats,
        args.input_len,
        args.depth.len(),
        args.repeats
    );
    if let Some(plan) = plan {
        eprintln!("{plan}");
    }
    // One session for every case and repeat: weights uploaded and engines made once.
    let mut session = Session::new(Arc::clone(&model), session_cfg)?;

    let mut reports = Vec::new();
    for repeat in 0..args.repeats {
        for &input_len in &args.input_len {
            for (i, &depth) in args.depth.iter().enumerate() {
                // Wrapping: any --seed is valid, and the cases' seeds follow it.
                let seed = args.seed.wrapping_add((repeat * 1000 + i) as u64);
                let case = Case {
                    input_len,
                    depth,
                    kind: args.needle_kind,
                    seed,
                };
                let prompt = case.build(&tok)?;
                let new_tokens = NEW_TOKENS
                    .max(tok.encode(&prompt.value, false)?.len() + ANSWER_SLACK)
                    .min(max_len - input_len);
                let (out, ttft) = answer(&mut session, false, &prompt.ids, new_tokens)?;
                let text = tok.decode(&out.token_ids, true)?;
                let mut report = CaseReport {
                    input_len,
                    depth,
                    kind: args.needle_kind,
                    repeat,
                    seed,
                    passed: answer_found(&text, &prompt.value),
                    key: prompt.key.clone(),
                    value: prompt.value.clone(),
                    offload: offloaded,
                    answer: text,
                    prefill_s: out.prefill_secs,
                    ttft_s: ttft,
                    decode_tokens_per_s: out.decode_tokens_per_s(),
                    peak_memory_mib: engine::peak_rss_bytes().unwrap_or(0) as f64
                        / (1 << 20) as f64,
                    tokens_agree: None,
                    max_logprob_diff: None,
                    sparse_budget: sparse.map(|s| s.budget),
                    sparse_hit_rate: session.sparse_stats().map(|s| s.hit_rate()),
                    sparse_verify: out.verified,
                };
                if args.compare_offload {
                    let (plain, _) = answer(&mut session, true, &prompt.ids, new_tokens)?;
                    let plain_text = tok.decode(&plain.token_ids, true)?;
                    report.tokens_agree = Some(plain.token_ids == out.token_ids);
                    report.max_logprob_diff = Some(
                        plain
                            .logprobs
                            .iter()
                            .zip(&out.logprobs)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0.0, f32::max),
                    );
                    report.passed &= answer_found(&plain_text, &prompt.value)
                        && report.tokens_agree == Some(true);
                }
                if !args.json {
                    print_row(&report, reports.is_empty())?;
                }
                reports.push(report);
            }
        }
    }
    let failed = reports.iter().filter(|r| !r.passed).count();
    if args.json {
        let doc = serde_json::json!({"cases": reports, "passed": reports.len() - failed, "failed": failed});
        strata::outln!("{doc}")?;
    } else {
        strata::outln!("{} passed, {} failed", reports.len() - failed, failed)?;
    }
    Ok(failed == 0)
}

fn print_row(r: &CaseReport, header: bool) -> anyhow::Result<()> {
    if header {
        strata::outln!(
            "{:>6} {:>5} {:>3} {:>4} {:>9} {:>7} {:>9} {:>8} {:>6} {:>9}  key = value -> answer",
            "input",
            "depth",
            "rep",
            "pass",
            "prefill_s",
            "ttft_s",
            "decode/s",
            "peak_MiB",
            "agree",
            "max_dlogp"
        )?;
    }
    let agree = r.tokens_agree.map_or(
        "-".to_string(),
        |a| if a { "yes".into() } else { "NO".into() },
    );
    let dlp = r
        .max_logprob_diff
        .map_or("-".to_string(), |d| format!("{d:.2e}"));
    strata::outln!(
        "{:>6} {:>5.2} {:>3} {:>4} {:>9.2} {:>7.2} {:>9.1} {:>8.0} {:>6} {:>9}  {} = {} -> {:?}",
        r.input_len,
        r.depth,
        r.repeat,
        if r.passed { "ok" } else { "FAIL" },
        r.prefill_s,
        r.ttft_s,
        r.decode_tokens_per_s,
        r.peak_memory_mib,
        agree,
        dlp,
        r.key,
        r.value,
        r.answer.trim()
    )?;
    Ok(())
}
