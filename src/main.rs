//! The `strata` command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand};

use strata::device::{self, DeviceKind};
use strata::engine::{self, GenerateOptions, GenerationOutput, SamplingParams};
use strata::model::tokenizer::StreamDecoder;
use strata::model::{Model, Tokenizer};
use strata::offload::{experts::ExpertOffload, OffloadConfig};
use strata::session::ProfileSteps;
use strata::{errors, flags, output, Session, SessionConfig};

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "LLM inference with layerwise KV-cache offload"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Generate(GenerateArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(strata::server::ServeArgs),
    /// A text file's perplexity under the model, by llama-perplexity's method
    /// (non-overlapping windows of --ctx tokens, the second half of each scored).
    Perplexity(strata::perplexity::PerplexityArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Layerwise offload vs compute alone and transfer alone (simulated link on the CPU device).
    Offload(strata::offload::bench::OffloadBenchArgs),
    /// Continuous batching over a paged KV cache, preemption to host memory or recompute.
    Serve(strata::serve::bench::ServeArgs),
    /// The disk tier's store: sequential write/read GB/s against dd with O_DIRECT.
    Disk(strata::serve::disk::bench::DiskBenchArgs),
    /// Plain decode and prefill speed at given contexts, with the bytes a decode token reads
    /// and the fraction of the machine's measured read bandwidth that achieves.
    Decode(strata::engine::bench::DecodeBenchArgs),
    /// Sparse decode vs full attention on RULER's retrieval tasks (accuracy per task,
    /// context and budget).
    SparseEval(strata::sparse::eval::SparseEvalArgs),
    /// One weight mode against another on the same model (e.g. q8 against stored):
    /// teacher-forced top-1 agreement and KL, and greedy agreement on chat prompts.
    Agreement(strata::agreement::AgreementArgs),
}

#[derive(Args)]
struct GenerateArgs {
    /// GGUF file or Hugging Face model directory [default: $STRATA_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt text.
    #[arg(
        long,
        conflicts_with = "prompt_file",
        required_unless_present = "prompt_file"
    )]
    prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Most new tokens to generate.
    #[arg(long, default_value_t = 256, value_parser = flags::tokens_or_zero())]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy [default: the model's generation_config, else 0]
    #[arg(long)]
    temperature: Option<f32>,
    /// Keep only the K most likely tokens (0 = all) [default: generation_config, else 0]
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches P [default: generation_config, else 1]
    #[arg(long)]
    top_p: Option<f32>,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Wrap the prompt in the model's chat template as one user turn.
    #[arg(long)]
    chat: bool,
    /// Device to run on.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// Context limit in tokens (prompt + output) [default: the model's maximum]
    #[arg(long, value_parser = flags::tokens())]
    max_model_len: Option<usize>,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    dtype: flags::WeightDtypeArg,
    #[command(flatten)]
    kv: flags::KvDtypeArg,
    /// Layerwise KV offload: the KV cache lives in host memory, layers stream through a device ring.
    #[arg(long)]
    enable_offload: bool,
    /// Device ring slots (prefetch depth = slots - 1).
    #[arg(long, default_value_t = 4, requires = "enable_offload", value_parser = flags::kv_buffers())]
    num_kv_buffers: usize,
    /// Tokens per host KV block.
    #[arg(long, default_value_t = 256, requires = "enable_offload", value_parser = flags::block_size())]
    block_size: usize,
    /// Host KV blocks per layer [default: enough for --max-model-len]
    #[arg(long, requires = "enable_offload", value_parser = flags::blocks())]
    num_cpu_blocks: Option<usize>,
    /// Throttle host-device copies of the CPU device to this many GB/s (0 = unthrottled).
    #[arg(long, default_value_t = 0.0, requires = "enable_offload", value_parser = flags::link_gbps)]
    sim_link_gbps: f64,
    /// Sanitizer: poison released ring slots and delay copies at random (also STRATA_SANITIZE=1).
    #[arg(long, requires = "enable_offload")]
    sanitize: bool,
    /// Write a Chrome/Perfetto trace of every op on every stream.
    #[arg(long, requires = "enable_offload")]
    trace_out: Option<PathBuf>,
    /// CUDA, a mixture of experts: keep the routed experts in host memory and stream them
    /// to the GPU a layer at a time (for models whose experts do not fit; docs/cuda.md).
    #[arg(long)]
    offload_experts: bool,
    /// Device slots for streamed experts, each one layer's (prefetch depth = slots - 1).
    #[arg(long, default_value_t = 2, requires = "offload_experts", value_parser = flags::expert_buffers())]
    num_expert_buffers: usize,
    #[command(flatten)]
    sparse: strata::sparse::SparseArgs,
    /// CUDA: run decode steps A..B (0-based, B exclusive) between cuProfilerStart/Stop, for
    /// `nsys profile --capture-range=cudaProfilerApi`.
    #[arg(long, value_name = "A:B")]
    profile_steps: Option<ProfileSteps>,
}

fn main() -> ExitCode {
    if let Some(code) = strata::model::template::worker::enter() {
        return code;
    }
    strata::engine::return_large_buffers_to_the_system();
    let cli = match errors::parse_args::<Cli>("strata") {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    // The subcommand a usage error found after parsing points at (`--help`).
    let command = match &cli.command {
        Command::Generate(_) => "strata generate",
        Command::Serve(_) => "strata serve",
        Command::Perplexity(_) => "strata perplexity",
        Command::Bench(BenchCommand::Offload(_)) => "strata bench offload",
        Command::Bench(BenchCommand::Serve(_)) => "strata bench serve",
        Command::Bench(BenchCommand::Disk(_)) => "strata bench disk",
        Command::Bench(BenchCommand::SparseEval(_)) => "strata bench sparse-eval",
        Command::Bench(BenchCommand::Decode(_)) => "strata bench decode",
        Command::Bench(BenchCommand::Agreement(_)) => "strata bench agreement",
    };
    // Every command but `serve` runs its model on this thread (`serve` on its engine thread,
    // which makes its own pool: `server::engine_thread`).
    if !matches!(cli.command, Command::Serve(_)) {
        if let Err(e) = strata::engine::compute_on_this_thread() {
            return errors::report(&e);
        }
    }
    let bench = matches!(cli.command, Command::Bench(_));
    let result = match cli.command {
        Command::Generate(args) => run_generate(args),
        Command::Serve(args) => {
            strata::model::resolve(args.model.clone()).and_then(|m| strata::server::run(args, m))
        }
        Command::Perplexity(args) => strata::perplexity::run(args),
        Command::Bench(BenchCommand::Offload(args)) => strata::offload::bench::run(args),
        Command::Bench(BenchCommand::Serve(args)) => strata::serve::bench::run_serve(args),
        Command::Bench(BenchCommand::Disk(args)) => {
            strata::serve::disk::bench::run_disk_bench(args)
        }
        Command::Bench(BenchCommand::SparseEval(args)) => strata::sparse::eval::run(args),
        Command::Bench(BenchCommand::Decode(args)) => strata::engine::bench::run(args),
        Command::Bench(BenchCommand::Agreement(args)) => strata::agreement::run(args),
    };
    match result {
        Ok(()) => {
            // After the report, not before: an error stays one line.
            if let Some(note) = strata::device::order::timing_note().filter(|_| bench) {
                eprintln!("{note}");
            }
            ExitCode::SUCCESS
        }
        // One line naming the cause chain, e.g. "error: model.safetensors: invalid safetensors file: ...".
        Err(e) => errors::report_for(&e, Some(command)),
    }
}

/// Largest `--prompt-file` (a prompt of `flags::MAX_TOKENS` tokens is far smaller).
const MAX_PROMPT_FILE_BYTES: u64 = 256 << 20;

fn run_generate(args: GenerateArgs) -> Result<()> {
    // Everything is checked before anything is printed: a failing run prints only its
    // error line (docs/errors.md); warnings and the memory plan follow validation.
    device::check_available(args.device)?;
    let kv_dtype = args.kv.resolve(args.device)?;
    if let Some(path) = &args.trace_out {
        strata::offload::trace::check_trace_out(path)?;
    }
    let prompt_text = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => strata::safe_file::read_regular_text(
            f,
            MAX_PROMPT_FILE_BYTES,
            "--prompt-file",
            strata::safe_file::Links::Follow,
        )?,
        (None, None) => bail!("give --prompt or --prompt-file"),
    };
    if prompt_text.is_empty() {
        bail!("empty prompt: nothing to generate from");
    }
    let path = strata::model::resolve(args.model.clone())?;
    let (model, tok) = Model::load_as(&path, !args.json, args.dtype.resolve(args.device))?;
    let cfg = &model.cfg;
    let text = if args.chat {
        tok.apply_chat_template(&prompt_text)?
    } else {
        prompt_text
    };
    let prompt = tok.encode(&text, !args.chat)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let max_model_len = args.max_model_len.unwrap_or(cfg.max_position_embeddings);
    let defaults = &cfg.generation;
    let sampling = SamplingParams {
        temperature: args.temperature.unwrap_or(defaults.temperature),
        top_k: args.top_k.unwrap_or(defaults.top_k),
        top_p: args.top_p.unwrap_or(defaults.top_p),
        seed: args.seed,
    };
    sampling.validate()?;
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling,
        stop_ids: cfg.eos_token_ids.clone(),
    };
    engine::check_prompt(&prompt, max_model_len)?;
    // Size the KV for this request (prompt + output, within the context) unless told.
    // `--max-tokens 0` is checked and planned like a run of one token, then generates none.
    let request_len = engine::request_len(prompt.len(), args.max_tokens.max(1), max_model_len);
    let max_len = args.max_model_len.unwrap_or(request_len);
    let sanitize = args.sanitize || std::env::var("STRATA_SANITIZE").is_ok_and(|v| v == "1");
    let sparse = args.sparse.config(args.enable_offload)?;
    let session_cfg = SessionConfig {
        device: args.device,
        kv_dtype,
        max_len: if args.enable_offload {
            max_len
        } else {
            request_len
        },
        offload: args.enable_offload.then_some(OffloadConfig {
            num_kv_buffers: args.num_kv_buffers,
            block_size: args.block_size,
            max_model_len: max_len,
            num_cpu_blocks: args.num_cpu_blocks,
            link_gbps: args.sim_link_gbps,
            sanitize,
            check_order: strata::device::order::on_by_default(),
            sparse,
        }),
        trace_out: args.trace_out.clone(),
        profile: args.profile_steps,
        sparse_verify: args.sparse.verify()?,
        offload_experts: args.offload_experts.then_some(ExpertOffload {
            slots: args.num_expert_buffers,
            check_order: strata::device::order::on_by_default(),
            sanitize,
        }),
    };
    let plan = session_cfg.plan(cfg)?;
    session_cfg.check_prompt(cfg, prompt.len())?;
    if max_model_len > cfg.max_position_embeddings {
        eprintln!(
            "warning: --max-model-len {max_model_len} exceeds the model's trained context ({})",
            cfg.max_position_embeddings
        );
    }
    engine::print_threads_note();
    eprintln!("{}", model.weights.describe());
    if let Some(plan) = plan {
        eprintln!("{plan}");
    }
    let mut session = Session::new(Arc::clone(&model), session_cfg)?;

    let mut stream = StreamDecoder::new();
    let json = args.json;
    let mut on_token = |id: u32| -> Result<()> {
        if json || opts.stop_ids.contains(&id) {
            return Ok(());
        }
        if let Some(piece) = stream.push(&tok, id)? {
            output::print(piece)?;
        }
        Ok(())
    };
    let out = if opts.max_tokens == 0 {
        engine::GenerationOutput {
            prompt_tokens: prompt.len(),
            ..Default::default()
        }
    } else {
        session.generate(&prompt, &opts, &mut on_token)?
    };
    // Tokens computed from a model file truncated mid-run are not the model's.
    strata::model::mapped::check_unchanged()?;
    print_result(&model, &tok, &out, json)
}

/// The text (JSON: one object) on stdout, the stats line on stderr.
fn print_result(model: &Model, tok: &Tokenizer, out: &GenerationOutput, json: bool) -> Result<()> {
    let text = tok.decode(&out.token_ids, true)?;
    let peak = engine::peak_rss_bytes().unwrap_or(0);
    if json {
        let obj = serde_json::json!({
            "text": text,
            "token_ids": out.token_ids,
            "logprobs": out.logprobs,
            "prompt_tokens": out.prompt_tokens,
            "prefill_tokens_per_s": out.prefill_tokens_per_s(),
            "decode_tokens_per_s": out.decode_tokens_per_s(),
            "peak_memory_bytes": peak,
            "weights_bytes": model.weight_bytes(),
            "weights_resident_bytes": model.weights.resident_bytes(),
            "sparse_verify": out.verified,
        });
        output::println(obj)?;
    } else {
        output::println("")?;
    }
    eprintln!(
        "prompt tokens: {} | generated: {} | prefill: {:.1} tok/s | decode: {:.1} tok/s | peak memory: {:.1} MiB | weights resident: {:.1} MiB",
        out.prompt_tokens,
        out.token_ids.len(),
        out.prefill_tokens_per_s(),
        out.decode_tokens_per_s(),
        peak as f64 / (1024.0 * 1024.0),
        model.weights.resident_bytes() as f64 / (1024.0 * 1024.0)
    );
    if let Some(v) = out.verified {
        eprintln!(
            "sparse verify: {} rounds | {} drafted | {} kept ({:.1}%) | {:.2} tokens per full load",
            v.rounds,
            v.drafted,
            v.accepted,
            100.0 * v.acceptance(),
            v.tokens_per_round()
        );
    }
    Ok(())
}
