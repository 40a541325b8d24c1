//! `strata bench sparse-eval`: sparse decode against full attention on RULER's retrieval
//! tasks (`crate::ruler`), per task, context and budget. Full attention's answer is the
//! reference: sparse decode is scored only on the cases full attention gets right (all
//! expected values found), since a miss there is the model's, not the selection's.
//!
//! Multi-value answers get a second, finer measure: on every case where full attention
//! finds at least one value, the share of the values it found that sparse decode finds
//! too ("values kept"). It is what a selection can be tuned on where the model finds only
//! some of the values (the small default model at 8K finds one or two of four queried
//! keys' values on most cases), and it counts a lost value where the whole-case score
//! would need every value right first.
//!
//! A third measure is per token, on every case: sparse decode fed full attention's own
//! tokens (teacher-forced), and at each of full attention's decode steps whether its greedy
//! choice is full attention's ("agree") and KL(full ‖ sparse) of the next-token
//! distributions. A case gives one score but tens to hundreds of steps, so two selections
//! that score alike on a handful of cases can still be told apart; and the agreement is
//! the acceptance rate a verifier would see if full attention checked sparse decode's
//! tokens (self-speculative decoding with a sparse draft).
//!
//! Each case is prefilled once into a `Replay` cache and decoded greedily with full
//! attention, then (if full attention found any value) at each budget, then fed full
//! attention's tokens at each budget, rewound to the prompt between them: the engine's own
//! selection (`replay`), one prefill instead of one per decode. Prefill is full attention
//! in every mode, so sharing it changes nothing.

use std::fmt;
use std::path::PathBuf;
use std::time::Instant;

use crate::errors::usage;
use anyhow::{bail, Result};

use super::replay::Replay;
use super::SparseConfig;
use crate::device::kv_elem::KvElem;
use crate::engine::verified::{CacheSteps, Verifier, VerifyStats};
use crate::engine::{sampler, Sampler, SamplingParams};
use crate::flags;
use crate::model::{Model, Tokenizer};
use crate::ruler::{self, RulerCase, SeedSet, Task};

/// A budget: `1/N` of the context (rounded down to whole pages) or a token count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BudgetSpec {
    Fraction(usize),
    Tokens(usize),
}

impl BudgetSpec {
    /// Tokens at `context`, in whole pages of `page_size`.
    pub fn tokens(self, context: usize, page_size: usize) -> usize {
        let t = match self {
            BudgetSpec::Fraction(n) => context / n,
            BudgetSpec::Tokens(t) => t,
        };
        t / page_size * page_size
    }
}

impl fmt::Display for BudgetSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BudgetSpec::Fraction(n) => write!(f, "1/{n}"),
            BudgetSpec::Tokens(t) => write!(f, "{t}"),
        }
    }
}

/// `--budget`'s parser: `1/N` (N in 1..=1024) or tokens (1..=`flags::MAX_TOKENS`).
pub fn budget_spec(s: &str) -> Result<BudgetSpec, String> {
    let s = s.trim();
    let num = |x: &str, hi: usize| -> Result<usize, String> {
        match x.trim().parse::<usize>() {
            Ok(n) if (1..=hi).contains(&n) => Ok(n),
            _ => Err(format!(
                "expected 1/N (N in 1..=1024) or tokens in 1..={}, got {s:?}",
                flags::MAX_TOKENS
            )),
        }
    };
    match s.split_once('/') {
        Some(("1", n)) => Ok(BudgetSpec::Fraction(num(n, 1024)?)),
        Some(_) => Err(format!("expected 1/N, got {s:?}")),
        None => Ok(BudgetSpec::Tokens(num(s, flags::MAX_TOKENS)?)),
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct SparseEvalArgs {
    /// GGUF file or Hugging Face model directory [default: $STRATA_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// RULER tasks (comma-separated) [default: all eight niah tasks]
    #[arg(long, value_enum, value_delimiter = ',')]
    pub task: Vec<Task>,
    /// Context sizes in tokens: prompt plus the task's answer tokens, chat template included.
    #[arg(long, value_delimiter = ',', default_value = "2048,4096,8192", value_parser = flags::tokens())]
    pub context: Vec<usize>,
    /// Cases per task and context.
    #[arg(long, default_value_t = 2, value_parser = flags::repeats())]
    pub cases: usize,
    /// Index of the first case (cases are numbered within their task and context).
    #[arg(long, default_value_t = 0, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1_000_000))]
    pub first_case: usize,
    /// Sparse budgets (comma-separated): 1/N of the context, or tokens.
    #[arg(long, value_delimiter = ',', default_value = "1/8,1/16", value_parser = budget_spec)]
    pub budget: Vec<BudgetSpec>,
    #[arg(long, default_value_t = super::DEFAULT_PAGE_SIZE, value_parser = flags::block_size())]
    pub sparse_page_size: usize,
    /// Host block size: the recent window is the partial last block. 64 so that 1/16 of a
    /// 2K context (128 tokens) holds the sink page and a whole window.
    #[arg(long, default_value_t = 64, value_parser = flags::block_size())]
    pub block_size: usize,
    /// Also decode each case at each budget verified (`generate --sparse-verify`): sparse
    /// drafts of this many tokens checked by full attention. Its answers must be full
    /// attention's (`verified_same` counts the cases where they are); `kept` is the share
    /// of drafts full attention kept and `tok/full` the tokens per full-attention pass.
    #[arg(long, value_name = "DRAFTS")]
    pub sparse_verify: Option<usize>,
    /// Seeds: the tuning set, or the held-out set (run once, with the final method).
    #[arg(long, value_enum, default_value_t = SeedSet::Tune)]
    pub seed_set: SeedSet,
    /// As `generate`'s: the defaults evaluate what a user runs; `--dtype stored --kv-dtype
    /// f32` is the bitwise reference mode (every table before 2026-12-04 evening ran in it).
    #[command(flatten)]
    pub dtype: flags::WeightDtypeArg,
    #[command(flatten)]
    pub kv: flags::KvDtypeArg,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One decode of a case: its answer and score.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Decoded {
    /// Tokens per layer and step (`None`: full attention).
    pub budget: Option<usize>,
    pub answer: String,
    pub score: f64,
    /// Per expected value (the case's `answers`, in order): whether the answer has it.
    pub found: Vec<bool>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct CaseReport {
    pub task: &'static str,
    pub context: usize,
    pub index: usize,
    pub seed: u64,
    pub prompt_tokens: usize,
    pub answers: Vec<String>,
    /// Depths (percent) of the asked needles.
    pub depths: Vec<u32>,
    pub full: Decoded,
    /// One per budget, in `--budget` order; empty when full attention finds no value.
    pub sparse: Vec<Decoded>,
    /// One per budget, in `--budget` order, on every case.
    pub forced: Vec<Forced>,
    /// With `--sparse-verify`: one per budget, in `--budget` order, on every case.
    pub verified: Vec<Verified>,
}

/// Verified sparse decode of a case at one budget (`--sparse-verify`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Verified {
    pub budget: usize,
    /// Its tokens are full attention's (verification is exact: anything else is a bug).
    pub same_as_full: bool,
    pub score: f64,
    pub stats: VerifyStats,
}

/// Sparse decode fed full attention's tokens (teacher-forced) at one budget: at each of
/// full attention's decode steps, the step's next-token choice and distribution against
/// full attention's at the same position.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Forced {
    pub budget: usize,
    /// Full attention's decode steps (its tokens after the prefill's first).
    pub steps: usize,
    /// Steps where sparse decode's greedy choice is full attention's.
    pub agreed: usize,
    /// The other steps (0: the first decode step), where a verifier would reject sparse
    /// decode's token: with them, a speculative round's accepted run can be replayed.
    pub disagreed: Vec<usize>,
    /// Mean over the steps of KL(full ‖ sparse), nats.
    pub mean_kl: f64,
    pub max_kl: f64,
}

/// One table row: a task (or "all"), a context and a budget.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Cell {
    pub task: String,
    pub context: usize,
    pub budget_spec: BudgetSpec,
    pub budget: usize,
    pub cases: usize,
    /// Mean score of full attention over every case, percent.
    pub full_accuracy: f64,
    /// Cases full attention gets right (score 1), the ones sparse is scored on.
    pub full_correct: usize,
    /// Of those, the ones sparse gets right too.
    pub sparse_correct: usize,
    /// Mean sparse score over the full-correct cases, percent (full attention's is 100).
    pub sparse_accuracy: Option<f64>,
    /// Values full attention found, over every case where it found one (a case's values
    /// count only once, however many budgets).
    pub values_full_found: usize,
    /// Of those, the ones sparse decode found too.
    pub values_kept: usize,
    /// Teacher-forced (`Forced`), over every case: full attention's decode steps, the ones
    /// where sparse decode chose the same token, and the mean KL(full ‖ sparse) per step.
    pub forced_steps: usize,
    pub forced_agreed: usize,
    pub forced_mean_kl: Option<f64>,
    /// With `--sparse-verify`, over every case: those whose verified tokens are full
    /// attention's, the full-correct ones it got right, and its rounds, drafts and drafts
    /// kept, summed.
    pub verified_same: Option<usize>,
    pub verified_correct: Option<usize>,
    pub verified: VerifyStats,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalReport {
    pub seed_set: SeedSet,
    /// The weights' mode and the KV element the cases ran with.
    pub dtype: String,
    pub kv_dtype: String,
    pub block_size: usize,
    pub page_size: usize,
    pub cells: Vec<Cell>,
    pub cases: Vec<CaseReport>,
}

/// The command: check the flags, load the model, run every case, print the table (or JSON).
pub fn run(args: SparseEvalArgs) -> Result<()> {
    let tasks = if args.task.is_empty() {
        Task::ALL.to_vec()
    } else {
        args.task.clone()
    };
    // Every (context, budget) checked before the model loads: one line, nothing run.
    for &c in &args.context {
        for &b in &args.budget {
            let sc = SparseConfig {
                budget: b.tokens(c, args.sparse_page_size),
                page_size: args.sparse_page_size,
            };
            if let Err(e) = sc.check(args.block_size) {
                return Err(usage(format!("--budget {b} at --context {c}: {e:#}")));
            }
        }
    }
    if let Some(k) = args.sparse_verify {
        crate::engine::verified::check_draft_len(k).map_err(|e| usage(format!("{e:#}")))?;
    }
    let kv_dtype = args.kv.resolve(crate::device::DeviceKind::Cpu)?;
    let dtype = args.dtype.resolve(crate::device::DeviceKind::Cpu);
    let path = crate::model::resolve(args.model.clone())?;
    let (model, tok) = Model::load_as(&path, false, dtype)?;
    let longest = *args.context.iter().max().expect("clap gives a default");
    if longest > model.cfg.max_position_embeddings {
        bail!(
            "--context {longest} exceeds the model's context of {} tokens",
            model.cfg.max_position_embeddings
        );
    }
    crate::engine::print_threads_note();
    let report = crate::with_kv_elem!(kv_dtype, T => evaluate::<T>(&model, &tok, &args, &tasks)?);
    if args.json {
        crate::outln!("{}", serde_json::to_string(&report)?)?;
    } else {
        crate::output::print(format_args!("{report}"))?;
    }
    Ok(())
}

/// Runs every case (progress on stderr) and tabulates.
pub fn evaluate<T: KvElem>(
    model: &Model,
    tok: &Tokenizer,
    args: &SparseEvalArgs,
    tasks: &[Task],
) -> Result<EvalReport> {
    let c = &model.cfg;
    let page = args.sparse_page_size;
    let longest = *args.context.iter().max().expect("clap gives a default");
    let sc = |budget| SparseConfig {
        budget,
        page_size: page,
    };
    let mut kv = Replay::<T>::new(c, sc(page + args.block_size), args.block_size, longest);
    let total = tasks.len() * args.context.len() * args.cases;
    let mut cases = Vec::new();
    for &context in &args.context {
        for &task in tasks {
            for index in args.first_case..args.first_case + args.cases {
                let case = RulerCase {
                    task,
                    context,
                    index,
                    set: args.seed_set,
                };
                let t0 = Instant::now();
                let p = case.build(tok)?;
                let built = t0.elapsed().as_secs_f64();
                let budgets: Vec<usize> = args
                    .budget
                    .iter()
                    .map(|b| b.tokens(context, page))
                    .collect();
                // Prefill once (full attention whatever the budget), then decode each way.
                let logits = model.forward(&p.ids, 0, &mut kv)?;
                let first = Sampler::new(SamplingParams::default()).sample(&logits);
                let prefilled = t0.elapsed().as_secs_f64();
                let score = |budget: Option<usize>, ids: &[u32]| -> Result<Decoded> {
                    let answer = tok.decode(ids, true)?;
                    let found = ruler::found(&answer, &p.answers);
                    Ok(Decoded {
                        budget,
                        answer,
                        score: ruler::score_found(&found),
                        found,
                    })
                };
                let mut decode = |budget: Option<usize>, on_step: &mut dyn FnMut(&[f32])| {
                    kv.rewind(p.ids.len())?;
                    kv.set_sparse(budget.map(sc))?;
                    let (pos, max_new) = (p.ids.len(), p.max_new_tokens);
                    greedy(model, &mut kv, first, pos, max_new, context, on_step)
                };
                // Full attention, its logits kept for the teacher-forced passes.
                let mut full_logits = Vec::new(); // [decode steps, vocab]
                let full_ids = decode(None, &mut |l| full_logits.push(l.to_vec()))?;
                let full = score(None, &full_ids)?;
                // Sparse wherever full attention found a value: scored per case where it
                // found them all, per value (`values_kept`) where it found any.
                let sparse = if full.score > 0.0 {
                    budgets
                        .iter()
                        .map(|&b| score(Some(b), &decode(Some(b), &mut |_| {})?))
                        .collect::<Result<_>>()?
                } else {
                    Vec::new()
                };
                let forced = budgets
                    .iter()
                    .map(|&b| {
                        kv.rewind(p.ids.len())?;
                        kv.set_sparse(Some(sc(b)))?;
                        teacher_forced(model, &mut kv, b, &full_ids, p.ids.len(), &full_logits)
                    })
                    .collect::<Result<Vec<_>>>()?;
                let verified = match args.sparse_verify {
                    None => Vec::new(),
                    Some(k) => budgets
                        .iter()
                        .map(|&b| {
                            kv.rewind(p.ids.len())?;
                            kv.set_sparse(Some(sc(b)))?;
                            let (pos, max_new) = (p.ids.len(), p.max_new_tokens);
                            let (ids, stats) =
                                verified(model, &mut kv, first, pos, max_new, context, k)?;
                            Ok(Verified {
                                budget: b,
                                same_as_full: ids == full_ids,
                                score: score(Some(b), &ids)?.score,
                                stats,
                            })
                        })
                        .collect::<Result<Vec<_>>>()?,
                };
                let scores: Vec<String> =
                    sparse.iter().map(|d| format!("{:.2}", d.score)).collect();
                let agreed: Vec<String> = forced
                    .iter()
                    .map(|f| format!("{}/{}", f.agreed, f.steps))
                    .collect();
                eprintln!(
                    "[{}/{total}] {} {context} #{index}: full {:.2}{}{}, agree {} (build {built:.1} s, prefill {:.1} s, decode {:.1} s)",
                    cases.len() + 1,
                    task.name(),
                    full.score,
                    if scores.is_empty() { "" } else { ", sparse " },
                    scores.join(" "),
                    agreed.join(" "),
                    prefilled - built,
                    t0.elapsed().as_secs_f64() - prefilled
                );
                cases.push(CaseReport {
                    task: task.name(),
                    context,
                    index,
                    seed: case.seed(),
                    prompt_tokens: p.ids.len(),
                    answers: p.answers.clone(),
                    depths: p
                        .needles
                        .iter()
                        .filter(|n| n.asked)
                        .map(|n| n.depth)
                        .collect(),
                    full,
                    sparse,
                    forced,
                    verified,
                });
            }
        }
    }
    let mut cells = Vec::new();
    for &context in &args.context {
        for (bi, &spec) in args.budget.iter().enumerate() {
            let names: Vec<&str> = tasks.iter().map(|t| t.name()).chain(["all"]).collect();
            for name in names {
                let of: Vec<&CaseReport> = cases
                    .iter()
                    .filter(|r| r.context == context && (name == "all" || r.task == name))
                    .collect();
                cells.push(cell(
                    name,
                    context,
                    spec,
                    spec.tokens(context, page),
                    bi,
                    &of,
                ));
            }
        }
    }
    Ok(EvalReport {
        seed_set: args.seed_set,
        dtype: args
            .dtype
            .resolve(crate::device::DeviceKind::Cpu)
            .name()
            .to_string(),
        kv_dtype: T::NAME.to_string(),
        block_size: args.block_size,
        page_size: page,
        cells,
        cases,
    })
}

fn cell(
    task: &str,
    context: usize,
    spec: BudgetSpec,
    budget: usize,
    bi: usize,
    of: &[&CaseReport],
) -> Cell {
    let right: Vec<&&CaseReport> = of.iter().filter(|r| r.full.score == 1.0).collect();
    let sparse: Vec<f64> = right.iter().map(|r| r.sparse[bi].score).collect();
    // (full found, sparse found too) per value, over the cases with sparse decodes.
    let values = of
        .iter()
        .filter(|r| !r.sparse.is_empty())
        .flat_map(|r| r.full.found.iter().zip(&r.sparse[bi].found))
        .filter(|&(&full, _)| full);
    let forced = of.iter().map(|r| &r.forced[bi]);
    let verified: Vec<&Verified> = of.iter().filter_map(|r| r.verified.get(bi)).collect();
    let any = !verified.is_empty();
    let forced_steps = forced.clone().map(|f| f.steps).sum::<usize>();
    let kl_sum = forced
        .clone()
        .map(|f| f.mean_kl * f.steps as f64)
        .sum::<f64>();
    Cell {
        task: task.to_string(),
        context,
        budget_spec: spec,
        budget,
        cases: of.len(),
        full_accuracy: 100.0 * of.iter().map(|r| r.full.score).sum::<f64>()
            / of.len().max(1) as f64,
        full_correct: right.len(),
        sparse_correct: sparse.iter().filter(|&&s| s == 1.0).count(),
        sparse_accuracy: (!sparse.is_empty())
            .then(|| 100.0 * sparse.iter().sum::<f64>() / sparse.len() as f64),
        values_full_found: values.clone().count(),
        values_kept: values.filter(|&(_, &kept)| kept).count(),
        forced_steps,
        forced_agreed: forced.map(|f| f.agreed).sum(),
        forced_mean_kl: (forced_steps > 0).then(|| kl_sum / forced_steps as f64),
        verified_same: any.then(|| verified.iter().filter(|v| v.same_as_full).count()),
        verified_correct: any.then(|| {
            right
                .iter()
                .filter(|r| r.verified.get(bi).is_some_and(|v| v.score == 1.0))
                .count()
        }),
        verified: verified.iter().map(|v| v.stats).sum(),
    }
}

/// Greedy decode from the prefill's first token at `pos`: up to `max_new` tokens (the
/// first included), stopping at an end-of-sequence token or the context's end; `on_step`
/// sees each decode step's logits.
fn greedy<T: KvElem>(
    model: &Model,
    kv: &mut Replay<T>,
    first: u32,
    mut pos: usize,
    max_new: usize,
    context: usize,
    on_step: &mut dyn FnMut(&[f32]),
) -> Result<Vec<u32>> {
    let stop = &model.cfg.eos_token_ids;
    let mut sampler = Sampler::new(SamplingParams::default());
    let mut ids = vec![first];
    while ids.len() < max_new && pos < context && !stop.contains(ids.last().expect("non-empty")) {
        let logits = model.forward(&ids[ids.len() - 1..], pos, kv)?;
        on_step(&logits);
        ids.push(sampler.sample(&logits));
        pos += 1;
    }
    Ok(ids)
}

/// `greedy`, verified: rounds of up to `draft_len` sparse drafts (`kv` as it is set)
/// checked by full attention, until the same stop. Returns the tokens and the rounds.
fn verified<T: KvElem>(
    model: &Model,
    kv: &mut Replay<T>,
    first: u32,
    pos: usize,
    max_new: usize,
    context: usize,
    draft_len: usize,
) -> Result<(Vec<u32>, VerifyStats)> {
    let stop = |t: u32| model.cfg.eos_token_ids.contains(&t);
    let mut v = Verifier::new(
        first,
        pos,
        draft_len,
        Sampler::new(SamplingParams::default()),
    )?;
    let mut ids = vec![first];
    let mut steps = CacheSteps { model, kv };
    let emit = &mut |t, _: &[f32]| {
        ids.push(t);
        Ok(())
    };
    v.decode(&mut steps, max_new.saturating_sub(1), context, &stop, emit)?;
    Ok((ids, v.stats))
}

/// Feeds full attention's tokens `ids` (from the prefill's first, at `pos` on) through
/// `kv` as it is set (rewound to the prompt, sparse at `budget`), and compares each step's
/// logits with full attention's at the same step (`full_logits[steps, vocab]`, step `i`
/// the one that chose `ids[i + 1]`).
fn teacher_forced<T: KvElem>(
    model: &Model,
    kv: &mut Replay<T>,
    budget: usize,
    ids: &[u32],
    pos: usize,
    full_logits: &[Vec<f32>],
) -> Result<Forced> {
    let (mut disagreed, mut kl_sum, mut max_kl) = (Vec::new(), 0.0, 0.0f64);
    for (i, full) in full_logits.iter().enumerate() {
        let logits = model.forward(&ids[i..i + 1], pos + i, kv)?;
        if sampler::argmax(&logits) != sampler::argmax(full) {
            disagreed.push(i);
        }
        let kl = crate::agreement::kl(full, &logits);
        (kl_sum, max_kl) = (kl_sum + kl, max_kl.max(kl));
    }
    let steps = full_logits.len();
    Ok(Forced {
        budget,
        steps,
        agreed: steps - disagreed.len(),
        disagreed,
        mean_kl: kl_sum / steps.max(1) as f64,
        max_kl,
    })
}

impl fmt::Display for EvalReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "RULER retrieval, {:?} seeds, weights {}, KV {}, block {}, page {}: sparse scored on the cases full attention gets right; values_kept: of the values full attention found (any case), those sparse found too; agree, mean_kl: sparse fed full attention's tokens (every case), the steps where it chose full attention's next token, and KL(full || sparse) per step",
            self.seed_set, self.dtype, self.kv_dtype, self.block_size, self.page_size
        )?;
        let verified = self.cells.iter().any(|c| c.verified_same.is_some());
        if verified {
            writeln!(f, "verified (--sparse-verify): same: cases whose tokens are full attention's; ok: full-correct cases it got right; kept: drafts full attention kept; tok/full: tokens per full-attention pass")?;
        }
        write!(
            f,
            "{:<16} {:>7} {:>11} {:>5} {:>8} {:>7} {:>9} {:>10} {:>6} {:>11} {:>11} {:>8}",
            "task",
            "context",
            "budget",
            "cases",
            "full_acc",
            "full_ok",
            "sparse_ok",
            "sparse_acc",
            "drop",
            "values_kept",
            "agree",
            "mean_kl"
        )?;
        if verified {
            write!(
                f,
                " {:>9} {:>7} {:>6} {:>8}",
                "ver_same", "ver_ok", "kept", "tok/full"
            )?;
        }
        writeln!(f)?;
        for c in &self.cells {
            let acc = c.sparse_accuracy.map_or("-".into(), |a| format!("{a:.1}"));
            let drop = c
                .sparse_accuracy
                .map_or("-".into(), |a| format!("{:.1}", 100.0 - a));
            write!(
                f,
                "{:<16} {:>7} {:>11} {:>5} {:>8.1} {:>7} {:>9} {:>10} {:>6} {:>11} {:>11} {:>8}",
                c.task,
                c.context,
                format!("{} ({})", c.budget, c.budget_spec),
                c.cases,
                c.full_accuracy,
                c.full_correct,
                c.sparse_correct,
                acc,
                drop,
                format!("{}/{}", c.values_kept, c.values_full_found),
                format!("{}/{}", c.forced_agreed, c.forced_steps),
                c.forced_mean_kl.map_or("-".into(), |k| format!("{k:.4}"))
            )?;
            if let (Some(same), Some(ok)) = (c.verified_same, c.verified_correct) {
                write!(
                    f,
                    " {:>9} {:>7} {:>5.1}% {:>8.2}",
                    format!("{same}/{}", c.cases),
                    format!("{ok}/{}", c.full_correct),
                    100.0 * c.verified.acceptance(),
                    c.verified.tokens_per_round()
                )?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded(budget: Option<usize>, found: &[bool]) -> Decoded {
        Decoded {
            budget,
            answer: String::new(),
            score: ruler::score_found(found),
            found: found.to_vec(),
        }
    }

    fn report(full: &[bool], sparse: &[&[bool]]) -> CaseReport {
        CaseReport {
            task: "niah_multiquery",
            context: 8192,
            index: 0,
            seed: 0,
            prompt_tokens: 8000,
            answers: vec!["1".into(); full.len()],
            depths: Vec::new(),
            full: decoded(None, full),
            sparse: sparse.iter().map(|f| decoded(Some(512), f)).collect(),
            forced: [(10, 10, 0.0), (10, 9, 0.5)]
                .map(|(steps, agreed, mean_kl)| Forced {
                    budget: 512,
                    steps,
                    agreed,
                    disagreed: (agreed..steps).collect(),
                    mean_kl,
                    max_kl: 2.0 * mean_kl,
                })
                .to_vec(),
            verified: Vec::new(),
        }
    }

    /// Whole cases are scored where full attention found every value; values are counted
    /// on every case where it found one, and only the values it found.
    #[test]
    fn values_kept_counts_the_values_full_attention_found() {
        let (t, f) = (true, false);
        let cases = [
            // Full right, sparse loses one value of four (and finds none extra).
            report(&[t, t, t, t], &[&[t, f, t, t], &[t, t, t, t]]),
            // Full finds two; sparse keeps one of them and finds one full did not.
            report(&[t, f, t, f], &[&[t, t, f, f], &[f, f, f, f]]),
            // Full finds nothing: no sparse decodes, nothing counted.
            report(&[f, f, f, f], &[]),
        ];
        let of: Vec<&CaseReport> = cases.iter().collect();
        let c = cell("all", 8192, BudgetSpec::Fraction(8), 1024, 0, &of);
        assert_eq!((c.cases, c.full_correct, c.sparse_correct), (3, 1, 0));
        assert_eq!(c.sparse_accuracy, Some(75.0));
        assert_eq!((c.values_kept, c.values_full_found), (4, 6));
        let c = cell("all", 8192, BudgetSpec::Fraction(8), 1024, 1, &of);
        assert_eq!((c.full_correct, c.sparse_correct), (1, 1));
        assert_eq!((c.values_kept, c.values_full_found), (4, 6));
    }

    /// The teacher-forced counts cover every case, full attention right or not, and the
    /// cell's KL is the mean per step, not per case.
    #[test]
    fn forced_agreement_counts_every_case() {
        let (t, f) = (true, false);
        let mut cases = [
            report(&[t], &[&[t], &[t]]),
            report(&[f], &[]),
            report(&[f], &[]),
        ];
        cases[2].forced[1].steps = 30;
        cases[2].forced[1].mean_kl = 0.1;
        let of: Vec<&CaseReport> = cases.iter().collect();
        let c = cell("all", 8192, BudgetSpec::Fraction(8), 1024, 0, &of);
        assert_eq!((c.forced_steps, c.forced_agreed), (30, 30));
        assert_eq!(c.forced_mean_kl, Some(0.0));
        let c = cell("all", 8192, BudgetSpec::Fraction(16), 512, 1, &of);
        assert_eq!((c.forced_steps, c.forced_agreed), (50, 27));
        let want = (0.5 * 10.0 * 2.0 + 0.1 * 30.0) / 50.0;
        assert!((c.forced_mean_kl.unwrap() - want).abs() < 1e-12);
        assert_eq!(
            cell("all", 8192, BudgetSpec::Fraction(8), 1024, 0, &[]).forced_mean_kl,
            None
        );
    }

    #[test]
    fn budgets_parse_as_fractions_or_tokens() {
        assert_eq!(budget_spec("1/8"), Ok(BudgetSpec::Fraction(8)));
        assert_eq!(budget_spec(" 512 "), Ok(BudgetSpec::Tokens(512)));
        for bad in ["1/0", "2/8", "0", "1/", "/8", "x", "", "-5", "1/2000"] {
            assert!(budget_spec(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(BudgetSpec::Fraction(8).tokens(4096, 16), 512);
        assert_eq!(BudgetSpec::Fraction(16).tokens(2000, 16), 112);
        assert_eq!(BudgetSpec::Tokens(500).tokens(4096, 16), 496);
    }
}
