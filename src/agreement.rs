//! `strata bench agreement`: how far one mode's outputs move from another's on the same
//! model file, a mode being a weight mode and a KV element. Made for the `q8` mode (8-bit
//! activations, integer dots) and the 16-bit KV caches, neither bitwise equal to the
//! reference: accuracy is measured, not assumed (issue 33).
//!
//! Two measurements, both modes loaded side by side:
//! - teacher-forced: a fixed text fed one token at a time (the decode path), and at every
//!   position the two next-token distributions compared: top-1 agreement and
//!   KL(reference ‖ mode) in f64;
//! - greedy: the chat prompts decoded greedily in both modes: the tokens up to the first
//!   divergence, and how close the reference's choice was there.

use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use rand::SeedableRng;

use crate::device::{DeviceKind, KvDtype};
use crate::engine::sampler;
use crate::kv::ContiguousKv;
use crate::model::weights::WeightDtype;
use crate::model::{self, Model};

/// The chat prompts of the greedy comparison (the first is tests/smollm2.rs's HF reference).
const PROMPTS: [&str; 4] = [
    "Write a short story about a robot who learns to paint.",
    "What is the capital of France?",
    "List three prime numbers and explain why each of them is prime, in one sentence each.",
    "Explain in a few sentences why the sky is blue.",
];

#[derive(Debug, Clone, clap::Args)]
pub struct AgreementArgs {
    /// GGUF file or Hugging Face model directory [default: $STRATA_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The weight mode measured.
    #[arg(long, value_enum, default_value_t = WeightDtype::Q8)]
    pub dtype: WeightDtype,
    /// The weight mode it is measured against.
    #[arg(long, value_enum, default_value_t = WeightDtype::Stored)]
    pub reference: WeightDtype,
    /// The KV element of the mode measured [default: the CPU device's]
    #[arg(long, value_enum, value_name = "DTYPE")]
    pub kv_dtype: Option<KvDtype>,
    /// The KV element of the reference.
    #[arg(long, value_enum, value_name = "DTYPE", default_value_t = KvDtype::F32)]
    pub reference_kv_dtype: KvDtype,
    /// Teacher-forced positions.
    #[arg(long, default_value_t = 1024, value_parser = crate::flags::tokens())]
    pub positions: usize,
    /// A text file to teacher-force [default: generated essay-like prose, seed 33]; it must
    /// hold more than --positions tokens.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Greedy tokens per chat prompt.
    #[arg(long, default_value_t = 48, value_parser = crate::flags::tokens_or_zero())]
    pub greedy_tokens: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What the teacher-forced pass found.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Forced {
    pub positions: usize,
    pub top1_agreement: f64,
    pub mean_kl: f64,
    pub p99_kl: f64,
    pub max_kl: f64,
}

/// One greedy prompt: tokens equal before the first difference, of `tokens`, and at that
/// difference the reference's probabilities of its own choice and of the mode's.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Greedy {
    pub prompt: String,
    pub tokens: usize,
    pub agree: usize,
    pub diverged_at_p: Option<(f64, f64)>,
}

/// A model with its KV element: one side of a comparison.
#[derive(Clone, Copy)]
pub struct Side<'a> {
    pub model: &'a Model,
    pub kv: KvDtype,
}

/// One forward step `(tokens, pos0)` → the last logits.
type Step<'a> = Box<dyn FnMut(&[u32], usize) -> Result<Vec<f32>> + 'a>;

impl<'a> Side<'a> {
    /// Its forward over a fresh cache of `cap` tokens in its KV element.
    fn stepper(self, cap: usize) -> Step<'a> {
        let (m, c) = (self.model, &self.model.cfg);
        crate::with_kv_elem!(self.kv, T => {
            let mut kv = ContiguousKv::<T>::for_model(c, cap);
            Box::new(move |tokens: &[u32], pos0: usize| m.forward(tokens, pos0, &mut kv))
        })
    }
}

/// Greedy decoding of `prompt` on both sides (each on its own tokens) until they first
/// choose differently or `steps` tokens.
pub fn greedy(
    reference: Side<'_>,
    mode: Side<'_>,
    prompt: &[u32],
    steps: usize,
) -> Result<(usize, Option<(f64, f64)>)> {
    let cap = prompt.len() + steps;
    let (mut fr, mut fm) = (reference.stepper(cap), mode.stepper(cap));
    let mut lr = fr(prompt, 0)?;
    let mut lm = fm(prompt, 0)?;
    for step in 0..steps {
        let (tr, tm) = (sampler::argmax(&lr), sampler::argmax(&lm));
        if tr != tm {
            let p = log_softmax(&lr);
            return Ok((step, Some((p[tr as usize].exp(), p[tm as usize].exp()))));
        }
        let pos = prompt.len() + step;
        lr = fr(&[tr], pos)?;
        lm = fm(&[tr], pos)?;
    }
    Ok((steps, None))
}

/// log-softmax in f64 of `logits[vocab]`.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let lse = logits
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// KL(p ‖ q) of two logit rows, in nats.
pub fn kl(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter()
        .zip(&lq)
        .map(|(a, b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0)
}

/// Feeds `tokens` one at a time through both sides and compares every position's logits.
pub fn teacher_forced(reference: Side<'_>, mode: Side<'_>, tokens: &[u32]) -> Result<Forced> {
    let cap = tokens.len();
    let (mut fr, mut fm) = (reference.stepper(cap), mode.stepper(cap));
    let (mut agree, mut kls) = (0usize, Vec::with_capacity(tokens.len()));
    for (pos, &t) in tokens.iter().enumerate() {
        let lr = fr(&[t], pos)?;
        let lm = fm(&[t], pos)?;
        agree += usize::from(sampler::argmax(&lr) == sampler::argmax(&lm));
        kls.push(kl(&lr, &lm));
    }
    let n = kls.len().max(1);
    let mean = kls.iter().sum::<f64>() / n as f64;
    let mut sorted = kls.clone();
    sorted.sort_by(f64::total_cmp);
    Ok(Forced {
        positions: kls.len(),
        top1_agreement: agree as f64 / n as f64,
        mean_kl: mean,
        p99_kl: sorted.get((n * 99) / 100).copied().unwrap_or(0.0),
        max_kl: sorted.last().copied().unwrap_or(0.0),
    })
}

pub fn run(a: AgreementArgs) -> Result<()> {
    let path = model::resolve(a.model.clone())?;
    let kv = DeviceKind::Cpu.kv_dtype(a.kv_dtype)?;
    let (reference, tok) = Model::load_as(&path, false, a.reference)?;
    let (mode, _) = Model::load_as(&path, false, a.dtype)?;
    let reference = Side {
        model: &reference,
        kv: a.reference_kv_dtype,
    };
    let mode = Side { model: &mode, kv };
    let context = reference.model.cfg.max_position_embeddings;
    ensure!(
        a.positions <= context,
        "--positions {} exceeds the model's context of {context} tokens",
        a.positions
    );
    let text = match &a.text {
        Some(p) => model::files::read_text(p)?,
        None => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(33);
            crate::ruler::essay::sentences(&mut rng, a.positions + 64).join(" ")
        }
    };
    let mut tokens = tok.encode(&text, false).context("encoding the text")?;
    if tokens.len() < a.positions {
        bail!(
            "the text has {} tokens, fewer than --positions {}",
            tokens.len(),
            a.positions
        );
    }
    tokens.truncate(a.positions);
    // Everything checked before the long work starts (and before anything is printed).
    let prompts = PROMPTS
        .iter()
        .map(|p| Ok((*p, tok.encode(&tok.apply_chat_template(p)?, false)?)))
        .collect::<Result<Vec<_>>>()?;
    let longest = prompts.iter().map(|(_, ids)| ids.len()).max().unwrap_or(0);
    ensure!(
        longest.saturating_add(a.greedy_tokens) <= context,
        "a {longest}-token chat prompt and --greedy-tokens {} exceed the model's context of \
         {context} tokens",
        a.greedy_tokens
    );
    crate::engine::print_threads_note();
    eprintln!(
        "strata bench agreement: {} teacher-forced positions, then {} chat prompts × {} \
         greedy tokens, in both modes",
        a.positions,
        prompts.len(),
        a.greedy_tokens
    );
    let forced = teacher_forced(reference, mode, &tokens)?;

    let mut greedy_rows = Vec::new();
    for (p, prompt) in prompts {
        let (agree, diverged_at_p) = greedy(reference, mode, &prompt, a.greedy_tokens)?;
        greedy_rows.push(Greedy {
            prompt: p.to_string(),
            tokens: a.greedy_tokens,
            agree,
            diverged_at_p,
        });
    }
    let greedy = greedy_rows;

    let name = |d: WeightDtype| format!("{d:?}").to_lowercase();
    let (mode_name, ref_name) = (
        format!("{} (KV {kv})", name(a.dtype)),
        format!("{} (KV {})", name(a.reference), a.reference_kv_dtype),
    );
    if a.json {
        let j = serde_json::json!({
            "dtype": name(a.dtype),
            "reference": name(a.reference),
            "kv_dtype": kv.name(),
            "reference_kv_dtype": a.reference_kv_dtype.name(),
            "teacher_forced": forced,
            "greedy": greedy,
        });
        crate::outln!("{j}")?;
        return Ok(());
    }
    crate::outln!(
        "{} against {}: {} teacher-forced positions: top-1 agreement {:.4}, mean KL {:.3e} \
         nats (p99 {:.3e}, max {:.3e})",
        mode_name,
        ref_name,
        forced.positions,
        forced.top1_agreement,
        forced.mean_kl,
        forced.p99_kl,
        forced.max_kl
    )?;
    crate::outln!("greedy (chat template, {} tokens):", a.greedy_tokens)?;
    for g in &greedy {
        let at = match g.diverged_at_p {
            Some((pr, pm)) => {
                format!(" (then the reference's p = {pr:.3} for its token, {pm:.3} for the mode's)")
            }
            None => String::new(),
        };
        crate::outln!("  {}/{} tokens equal{at}: {}", g.agree, g.tokens, g.prompt)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_equal_rows_and_positive_otherwise() {
        let a = [1.0f32, 2.0, 3.0];
        assert_eq!(kl(&a, &a), 0.0);
        let b = [3.0f32, 2.0, 1.0];
        // p = softmax(a), q = softmax(b): KL = Σ p (a_i − b_i) since the normalisers cancel.
        let p = log_softmax(&a);
        let want: f64 = (0..3).map(|i| p[i].exp() * (a[i] - b[i]) as f64).sum();
        assert!((kl(&a, &b) - want).abs() < 1e-12);
    }
}
