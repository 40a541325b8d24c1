//! The `strata` command line.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use strata::device::{self, DeviceKind};
use strata::engine::{self, GenerateOptions, SamplingParams};
use strata::model::tokenizer::StreamDecoder;
use strata::model::Model;

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
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        command: strata::serve::bench::BenchCommand,
    },
}

#[derive(Args)]
struct GenerateArgs {
    /// GGUF file or Hugging Face model directory [default: models/SmolLM2-135M-Instruct.Q4_1.gguf]
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
    #[arg(long, default_value_t = 256)]
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
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => run_generate(args),
        Command::Bench { command } => strata::serve::bench::run(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line naming the cause chain, e.g. "error: model.safetensors: invalid safetensors file: ...".
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `--model`, else `$STRATA_MODEL`, else the default model in ./models or beside the binary's checkout.
fn resolve_model(arg: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = arg.or_else(|| std::env::var_os("STRATA_MODEL").map(PathBuf::from)) {
        return Ok(p);
    }
    let mut candidates = vec![PathBuf::from(DEFAULT_MODEL)];
    if let Ok(exe) = std::env::current_exe() {
        // target/{release,debug}/strata → the checkout's models/
        if let Some(root) = exe.parent().and_then(Path::parent).and_then(Path::parent) {
            candidates.push(root.join(DEFAULT_MODEL));
        }
    }
    candidates
        .into_iter()
        .find(|p| p.exists())
        .context("no --model given and the default model is missing: run `models/fetch.sh` to download SmolLM2-135M-Instruct")
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    device::check_available(args.device)?;
    let prompt_text = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading prompt file {}", f.display()))?,
        (None, None) => bail!("give --prompt or --prompt-file"),
    };
    if prompt_text.is_empty() {
        bail!("empty prompt: nothing to generate from");
    }
    let model_path = resolve_model(args.model)?;
    let (model, tok) = Model::load(&model_path, !args.json)?;
    let cfg = &model.cfg;

    let text = if args.chat {
        tok.apply_chat_template(&prompt_text)?
    } else {
        prompt_text
    };
    let prompt = tok.encode(&text, !args.chat)?;
    let max_model_len = args.max_model_len.unwrap_or(cfg.max_position_embeddings);
    if max_model_len > cfg.max_position_embeddings {
        eprintln!(
            "warning: --max-model-len {max_model_len} exceeds the model's trained context ({})",
            cfg.max_position_embeddings
        );
    }
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

    let mut stream = StreamDecoder::new();
    let stdout = std::io::stdout();
    let json = args.json;
    let mut on_token = |id: u32| -> Result<()> {
        if json || opts.stop_ids.contains(&id) {
            return Ok(());
        }
        if let Some(piece) = stream.push(&tok, id)? {
            let mut out = stdout.lock();
            out.write_all(piece.as_bytes())?;
            out.flush()?;
        }
        Ok(())
    };
    let out = engine::generate(&model, &prompt, &opts, max_model_len, &mut on_token)?;
    let text = tok.decode(&out.token_ids, true)?;
    let peak = engine::peak_rss_bytes().unwrap_or(0);
    if json {
        let obj = serde_json::json!({
            "text": text,
            "token_ids": out.token_ids,
            "prompt_tokens": out.prompt_tokens,
            "prefill_tokens_per_s": out.prefill_tokens_per_s(),
            "decode_tokens_per_s": out.decode_tokens_per_s(),
            "peak_memory_bytes": peak,
        });
        println!("{obj}");
    } else {
        println!();
    }
    eprintln!(
        "prompt tokens: {} | generated: {} | prefill: {:.1} tok/s | decode: {:.1} tok/s | peak memory: {:.1} MiB",
        out.prompt_tokens,
        out.token_ids.len(),
        out.prefill_tokens_per_s(),
        out.decode_tokens_per_s(),
        peak as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}
