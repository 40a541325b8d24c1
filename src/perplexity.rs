//! `strata perplexity FILE`: a text's perplexity under the model, by llama.cpp's
//! `llama-perplexity` method, so the two numbers compare (docs/evaluation.md):
//!
//! - the whole text (one trailing newline dropped, as llama.cpp reads `-f`) is tokenized
//!   once, with the model's BOS if it adds one;
//! - it is cut into `floor(tokens / ctx)` non-overlapping windows of `--ctx` tokens (the
//!   rest is unused); each window runs from an empty cache at positions `0..ctx`, its first
//!   token replaced by BOS when the model adds one;
//! - in each window the tokens at `ctx/2 + 1 .. ctx` are scored (from the rows
//!   `ctx/2 .. ctx-2`) — the second half, each token predicted with more than `ctx/2`
//!   tokens of context — as the negative
//!   log-likelihood `-log softmax(logits)[next]`;
//! - PPL = exp(mean NLL); its error is PPL × the standard error of the mean NLL,
//!   `sqrt((mean(nll²) − mean(nll)²) / (n − 1))`, as llama.cpp prints it.

use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use crate::device::{DeviceKind, KvDtype};
use crate::engine::logprobs::log_prob;
use crate::kv::ContiguousKv;
use crate::model::weights::WeightDtype;
use crate::model::{self, Model, Tokenizer};

/// Rows of logits `[rows, vocab]` held at once while a window is scored.
const SCORE_ROWS: usize = 64;

#[derive(Debug, Clone, clap::Args)]
pub struct PerplexityArgs {
    /// The text file to score (UTF-8).
    pub file: PathBuf,
    /// GGUF file or Hugging Face model directory [default: $STRATA_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Tokens per window (llama-perplexity's -c); the text must hold at least two windows.
    #[arg(long, default_value_t = 512, value_parser = crate::flags::tokens())]
    pub ctx: usize,
    /// Score only the first N windows (llama-perplexity's --chunks) [default: all]
    #[arg(long, value_parser = crate::flags::tokens())]
    pub chunks: Option<usize>,
    /// How the CPU holds the weights (as `generate --dtype`).
    #[arg(long, value_enum, default_value_t = WeightDtype::Q8)]
    pub dtype: WeightDtype,
    /// The KV cache's element [default: the CPU device's]
    #[arg(long, value_enum, value_name = "DTYPE")]
    pub kv_dtype: Option<KvDtype>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// A perplexity measurement.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Perplexity {
    pub ppl: f64,
    /// PPL × the standard error of the mean NLL (llama.cpp's `+/-`).
    pub ppl_error: f64,
    pub mean_nll: f64,
    /// Tokens scored.
    pub scored: usize,
    pub windows: usize,
    pub ctx: usize,
    /// The text's tokens.
    pub text_tokens: usize,
    /// PPL over the windows so far, after each (llama.cpp's `[k]value` line).
    pub running: Vec<f64>,
}

/// The BOS id `encode(_, true)` puts first, if the tokenizer adds one.
fn added_bos(tok: &Tokenizer) -> Result<Option<u32>> {
    let with = tok.encode("a", true)?;
    let without = tok.encode("a", false)?;
    Ok((with.len() == without.len() + 1 && with[1..] == without[..]).then(|| with[0]))
}

/// The text's tokens as llama-perplexity reads and tokenizes a file.
pub fn tokenize(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let text = text.strip_suffix('\n').unwrap_or(text);
    tok.encode(text, true).context("tokenizing the text")
}

/// The text must hold two windows (llama-perplexity's rule) of at least 4 tokens.
fn check(tokens: &[u32], ctx: usize) -> Result<()> {
    ensure!(ctx >= 4, "--ctx must be at least 4 tokens, got {ctx}");
    if tokens.len() < 2 * ctx {
        bail!(
            "the text has {} tokens; at least 2 × --ctx = {} are needed (llama-perplexity's rule)",
            tokens.len(),
            2 * ctx
        );
    }
    Ok(())
}

/// Scores `tokens` in windows of `ctx` (at most `max_windows`), calling `progress` after
/// each window.
pub fn measure(
    model: &Model,
    kv: KvDtype,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    max_windows: Option<usize>,
    progress: &mut dyn FnMut(usize, f64),
) -> Result<Perplexity> {
    check(tokens, ctx)?;
    let windows = (tokens.len() / ctx).min(max_windows.unwrap_or(usize::MAX));
    let c = &model.cfg;
    let first = ctx / 2;
    let (mut sum, mut sum2, mut n) = (0f64, 0f64, 0usize);
    let mut running = Vec::with_capacity(windows);
    for w in 0..windows {
        let mut window = tokens[w * ctx..(w + 1) * ctx].to_vec();
        if let Some(b) = bos {
            window[0] = b;
        }
        crate::with_kv_elem!(kv, T => {
            let mut cache = ContiguousKv::<T>::for_model(c, ctx);
            // The first half is context only; then rows `first..ctx-1` each score the next
            // token, a bounded number of rows of logits at a time.
            model.forward(&window[..first], 0, &mut cache)?;
            let mut pos = first;
            while pos < ctx - 1 {
                let end = (pos + SCORE_ROWS).min(ctx - 1);
                let rows = model.forward_rows(&window[pos..end], pos, &mut cache)?;
                for (i, row) in rows.iter().enumerate() {
                    let nll = -log_prob(row, window[pos + i + 1]);
                    sum += nll;
                    sum2 += nll * nll;
                    n += 1;
                }
                pos = end;
            }
        });
        let ppl = (sum / n as f64).exp();
        running.push(ppl);
        progress(w + 1, ppl);
    }
    let mean = sum / n as f64;
    let var = (sum2 / n as f64 - mean * mean).max(0.0);
    let se = (var / (n as f64 - 1.0).max(1.0)).sqrt();
    let ppl = mean.exp();
    Ok(Perplexity {
        ppl,
        ppl_error: se * ppl,
        mean_nll: mean,
        scored: n,
        windows,
        ctx,
        text_tokens: tokens.len(),
        running,
    })
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    let path = model::resolve(a.model.clone())?;
    let kv = DeviceKind::Cpu.kv_dtype(a.kv_dtype)?;
    let text = model::files::read_text(&a.file)?;
    let (model, tok) = Model::load_as(&path, !a.json, a.dtype)?;
    let tokens = tokenize(&tok, &text)?;
    ensure!(
        a.ctx <= model.cfg.max_position_embeddings,
        "--ctx {} exceeds the model's context of {} tokens",
        a.ctx,
        model.cfg.max_position_embeddings
    );
    check(&tokens, a.ctx)?;
    let bos = added_bos(&tok)?;
    let windows = (tokens.len() / a.ctx).min(a.chunks.unwrap_or(usize::MAX));
    crate::engine::print_threads_note();
    if !a.json {
        eprintln!(
            "strata perplexity: {} tokens, {windows} windows of {} (second half of each scored), {:?} weights, KV {kv}",
            tokens.len(),
            a.ctx,
            a.dtype
        );
    }
    let bar = if a.json {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(windows as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} windows [{elapsed}<{eta}] {msg}")
                .expect("static progress template"),
        );
        bar
    };
    let r = measure(&model, kv, &tokens, a.ctx, bos, a.chunks, &mut |_, ppl| {
        bar.set_message(format!("PPL {ppl:.4}"));
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    // Through `output`: a closed or full stdout is an error line, not a panic.
    if a.json {
        crate::output::println(serde_json::to_string(&r)?)?;
    } else {
        let running: Vec<String> = r
            .running
            .iter()
            .enumerate()
            .map(|(i, p)| format!("[{}]{p:.4}", i + 1))
            .collect();
        crate::output::println(running.join(","))?;
        crate::output::println(format!(
            "Final estimate: PPL = {:.4} +/- {:.5} ({} tokens scored in {} windows of {})",
            r.ppl, r.ppl_error, r.scored, r.windows, r.ctx
        ))?;
    }
    Ok(())
}
