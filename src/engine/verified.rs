//! Sparse decode verified by full attention (self-speculative decoding with a sparse-KV
//! draft, as TriForce and MagicDec do; docs/offload.md, "Verified sparse decode"). A
//! round: `K` sparse decode steps draft tokens; the cache forgets their rows; one
//! full-attention step over the last kept token and the drafts gives full attention's
//! distribution after each of them. Drafts are kept by the speculative-sampling rule
//! (Leviathan et al.; Chen et al.): `d` drawn from the draft's distribution `q` is kept
//! with probability `min(1, p(d) / q(d))`, `p` full attention's; the first rejected is
//! replaced by a draw from `max(0, p − q)` normalized, and a round whose drafts are all
//! kept ends with a draw from full attention's next distribution. Every emitted token is
//! then distributed as full attention's sampling would be. Greedy, `p` and `q` are their
//! argmax alone: a draft is kept exactly when it is full attention's choice, and the
//! output is full attention's token for token, its log-probs bit for bit (each comes from
//! the verify step's logits, bitwise a one-token full step's: the kernels are
//! batch-invariant).

use std::time::Instant;

use anyhow::Result;

use super::sampler::Sampler;
use super::{logprob, GenerateOptions, GenerationOutput};
use crate::device::KvElem;
use crate::kv::KvCache;
use crate::model::Model;

/// Longest draft: the verify step computes `K + 1` query rows, and past a few tokens the
/// chance that every draft survives is small.
pub const MAX_DRAFT: usize = 32;

/// What a round asks of the model and its cache.
pub trait VerifiedSteps {
    /// A step of `tokens` at `pos0..` as the cache runs it (the prompt; one draft token
    /// under sparse decode): the last token's logits.
    fn forward(&mut self, tokens: &[u32], pos0: usize) -> Result<Vec<f32>>;
    /// A step attending every stored position over `tokens` at `pos0..`, even one token:
    /// every token's logits, in order.
    fn verify(&mut self, tokens: &[u32], pos0: usize) -> Result<Vec<Vec<f32>>>;
    /// Forgets positions `len..`.
    fn truncate(&mut self, len: usize) -> Result<()>;
}

/// What the drafts came to over one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct VerifyStats {
    /// Verify steps (one per round).
    pub rounds: usize,
    /// Tokens sparse decode drafted.
    pub drafted: usize,
    /// Drafts full attention agreed with (kept). A kept draft that is a stop id counts as
    /// its round's own token instead, so every round emits `accepted` + 1 tokens.
    pub accepted: usize,
}

impl VerifyStats {
    /// Share of the drafts kept.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }

    /// Tokens emitted per round, i.e. per full-attention pass.
    pub fn tokens_per_round(&self) -> f64 {
        (self.rounds + self.accepted) as f64 / self.rounds.max(1) as f64
    }
}

impl std::iter::Sum for VerifyStats {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), |a, b| Self {
            rounds: a.rounds + b.rounds,
            drafted: a.drafted + b.drafted,
            accepted: a.accepted + b.accepted,
        })
    }
}

/// One request of a model (the CPU model, `&Model`; the CUDA model, `&mut CudaModel`) on a
/// sparse cache (the offload engine with sparse decode), verified: `run_verified` over
/// the cache's steps.
pub fn generate_verified<T, M: RowsModel<T>>(
    model: M,
    kv: &mut dyn KvCache<T>,
    capacity: usize,
    prompt: &[u32],
    opts: &GenerateOptions,
    draft_len: usize,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationOutput> {
    kv.reset()?;
    let mut steps = CacheSteps { model, kv };
    run_verified(capacity, prompt, opts, draft_len, &mut steps, on_token)
}

/// What a round needs of a model over a cache of `T`: a step's last logits, and every
/// row's logits, each bitwise what a one-token step at its position gives.
pub trait RowsModel<T> {
    fn forward(&mut self, tokens: &[u32], pos0: usize, kv: &mut dyn KvCache<T>)
        -> Result<Vec<f32>>;
    fn forward_rows(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<T>,
    ) -> Result<Vec<Vec<f32>>>;
}

impl<T: KvElem> RowsModel<T> for &Model {
    fn forward(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<T>,
    ) -> Result<Vec<f32>> {
        Model::forward(self, tokens, pos0, kv)
    }

    fn forward_rows(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<T>,
    ) -> Result<Vec<Vec<f32>>> {
        Model::forward_rows(self, tokens, pos0, kv)
    }
}

/// The CUDA model in a verified round (`engine::verified`): its verify step runs every
/// row as a one-token step would (`crate::model::cuda::CudaModel::forward_rows`).
impl RowsModel<half::bf16> for &mut crate::model::cuda::CudaModel {
    fn forward(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<half::bf16>,
    ) -> Result<Vec<f32>> {
        crate::model::cuda::CudaModel::forward(self, tokens, pos0, kv)
    }

    fn forward_rows(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<half::bf16>,
    ) -> Result<Vec<Vec<f32>>> {
        crate::model::cuda::CudaModel::forward_rows(self, tokens, pos0, kv)
    }
}

/// A model's steps over a sparse cache: the verify step attends every stored position.
pub struct CacheSteps<'a, M, T> {
    pub model: M,
    pub kv: &'a mut dyn KvCache<T>,
}

impl<M: RowsModel<T>, T> VerifiedSteps for CacheSteps<'_, M, T> {
    fn forward(&mut self, tokens: &[u32], pos0: usize) -> Result<Vec<f32>> {
        self.model.forward(tokens, pos0, self.kv)
    }

    fn verify(&mut self, tokens: &[u32], pos0: usize) -> Result<Vec<Vec<f32>>> {
        self.kv.attend_all_next_step();
        self.model.forward_rows(tokens, pos0, self.kv)
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        self.kv.truncate(len)
    }
}

/// Prefill, then verified rounds of up to `draft_len` sparse drafts, sampled as
/// `opts.sampling` says; stops as `run_loop` does (at `max_tokens`, a stop id, or
/// `capacity` tokens in the context). Greedy, it emits the same tokens and log-probs as a
/// full-attention run; sampled, tokens distributed as that run's.
pub fn run_verified(
    capacity: usize,
    prompt: &[u32],
    opts: &GenerateOptions,
    draft_len: usize,
    m: &mut dyn VerifiedSteps,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationOutput> {
    opts.sampling.validate()?;
    check_draft_len(draft_len)?;
    let mut out = GenerationOutput {
        prompt_tokens: prompt.len(),
        verified: Some(VerifyStats::default()),
        ..Default::default()
    };
    if opts.max_tokens == 0 {
        return Ok(out);
    }
    let mut sampler = Sampler::new(opts.sampling.clone());
    let t0 = Instant::now();
    let logits = m.forward(prompt, 0)?;
    let first = sampler.sample(&logits);
    out.logprobs.push(logprob(&logits, first));
    out.prefill_secs = t0.elapsed().as_secs_f64();
    out.token_ids.push(first);
    on_token(first)?;
    let t1 = Instant::now();
    let mut v = Verifier::new(first, prompt.len(), draft_len, sampler)?;
    let stop = |t: u32| opts.stop_ids.contains(&t);
    v.decode(m, opts.max_tokens - 1, capacity, &stop, &mut |t, logits| {
        out.logprobs.push(logprob(logits, t));
        out.token_ids.push(t);
        on_token(t)
    })?;
    out.decode_steps = out.token_ids.len() - 1;
    out.decode_secs = t1.elapsed().as_secs_f64();
    out.verified = Some(v.stats);
    Ok(out)
}

/// Errors unless `1 ..= MAX_DRAFT` drafts per round.
pub fn check_draft_len(draft_len: usize) -> Result<()> {
    if !(1..=MAX_DRAFT).contains(&draft_len) {
        return Err(crate::errors::usage(format!(
            "--sparse-verify drafts 1 to {MAX_DRAFT} tokens per round, got {draft_len}"
        )));
    }
    Ok(())
}

/// Verified decoding on from a stored context: `next` is the last token chosen, at
/// position `pos`, its KV not stored yet.
pub struct Verifier {
    pub next: u32,
    pub pos: usize,
    pub stats: VerifyStats,
    draft_len: usize,
    /// Draws the drafts, the acceptances and the replacements, from one seeded stream.
    sampler: Sampler,
}

impl Verifier {
    pub fn new(next: u32, pos: usize, draft_len: usize, sampler: Sampler) -> Result<Self> {
        check_draft_len(draft_len)?;
        Ok(Self {
            next,
            pos,
            stats: VerifyStats::default(),
            draft_len,
            sampler,
        })
    }

    /// Rounds until `max_new` more tokens are emitted, a stop id is, or the context
    /// reaches `capacity` tokens (`run_loop`'s rule); returns how many were emitted.
    pub fn decode(
        &mut self,
        m: &mut dyn VerifiedSteps,
        max_new: usize,
        capacity: usize,
        stop: &dyn Fn(u32) -> bool,
        emit: &mut dyn FnMut(u32, &[f32]) -> Result<()>,
    ) -> Result<usize> {
        let mut made = 0;
        while made < max_new && !stop(self.next) && self.pos < capacity {
            let room = (max_new - made).min(capacity - self.pos);
            made += self.round(m, room, stop, emit)?;
        }
        Ok(made)
    }

    /// One round: drafts, the verify step, the rewind past the rejected drafts. Emits
    /// (`emit`: the token and the verify step's logits it was chosen from) between one and
    /// `room` tokens, none after a stop id; returns how many. The verify step writes
    /// positions `pos..pos + emitted`, at most `room` of them.
    pub fn round(
        &mut self,
        m: &mut dyn VerifiedSteps,
        room: usize,
        stop: &dyn Fn(u32) -> bool,
        emit: &mut dyn FnMut(u32, &[f32]) -> Result<()>,
    ) -> Result<usize> {
        let pos = self.pos;
        let mut input = vec![self.next];
        let mut drafts = Vec::new(); // each draft's distribution, `q`
        while input.len() <= self.draft_len.min(room.max(1) - 1) {
            let at = pos + input.len() - 1;
            let q = self
                .sampler
                .distribution(&m.forward(&input[input.len() - 1..], at)?);
            let d = self.sampler.draw(&q);
            input.push(d);
            drafts.push(q);
            if stop(d) {
                break; // nothing after a stop is wanted
            }
        }
        m.truncate(pos)?;
        let rows = m.verify(&input, pos)?;
        self.stats.rounds += 1;
        self.stats.drafted += drafts.len();
        // Inputs whose rows stay: `next` and the drafts kept.
        let mut kept = 0;
        for (i, logits) in rows.iter().enumerate() {
            let p = self.sampler.distribution(logits);
            let (t, accepted) = match (input.get(i + 1), drafts.get(i)) {
                (Some(&d), Some(q)) => {
                    // `d` was drawn from `q`, so `q(d) > 0`.
                    if self.sampler.uniform() < prob(&p, d) / prob(q, d) {
                        (d, true)
                    } else {
                        (self.sampler.draw(&residual(&p, q)), false)
                    }
                }
                _ => (self.sampler.draw(&p), false), // after every draft: a bonus
            };
            emit(t, logits)?;
            (kept, self.next) = (i + 1, t);
            if !accepted || stop(t) {
                break;
            }
            self.stats.accepted += 1;
        }
        self.pos += kept;
        m.truncate(self.pos)?;
        Ok(kept)
    }
}

/// `dist`'s probability of `t` (0 outside its support).
fn prob(dist: &[(u32, f32)], t: u32) -> f32 {
    dist.iter().find(|&&(x, _)| x == t).map_or(0.0, |&(_, p)| p)
}

/// `max(0, p − q)` over `p`'s support (unnormalized; `Sampler::draw` scales by its sum),
/// what a rejected draft is replaced from; `p` itself if nothing is left (p ≤ q
/// everywhere, only possible through rounding, since a rejection needs p(d) < q(d)).
fn residual(p: &[(u32, f32)], q: &[(u32, f32)]) -> Vec<(u32, f32)> {
    // A map, not `prob` per token: with no top-k cut both hold the whole vocabulary.
    let q: std::collections::HashMap<u32, f32> = q.iter().copied().collect();
    let r: Vec<(u32, f32)> = p
        .iter()
        .map(|&(t, pt)| (t, (pt - q.get(&t).copied().unwrap_or(0.0)).max(0.0)))
        .filter(|&(_, w)| w > 0.0)
        .collect();
    if r.is_empty() {
        p.to_vec()
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::SamplingParams;

    /// A toy model: the next token after `t` at `pos` is `rule(t, pos)`, as logits; the
    /// drafts follow `draft_rule` instead. Records what it is asked.
    struct Toy {
        vocab: usize,
        stored: usize,
        full: fn(u32, usize) -> u32,
        draft: fn(u32, usize) -> u32,
        verified: usize,
    }

    impl Toy {
        /// Full attention follows `full_rule`, the drafts `draft`.
        fn new(draft: fn(u32, usize) -> u32) -> Self {
            Self {
                vocab: 11,
                stored: 0,
                full: full_rule,
                draft,
                verified: 0,
            }
        }

        fn logits(&self, t: u32) -> Vec<f32> {
            let mut l = vec![0.0; self.vocab];
            l[t as usize] = 1.0;
            l
        }
    }

    impl VerifiedSteps for Toy {
        fn forward(&mut self, tokens: &[u32], pos0: usize) -> Result<Vec<f32>> {
            assert_eq!(pos0, self.stored, "a step continues the stored context");
            self.stored += tokens.len();
            let (t, p) = (*tokens.last().unwrap(), pos0 + tokens.len() - 1);
            let rule = if tokens.len() == 1 {
                self.draft
            } else {
                self.full
            };
            Ok(self.logits(rule(t, p)))
        }
        fn verify(&mut self, tokens: &[u32], pos0: usize) -> Result<Vec<Vec<f32>>> {
            assert_eq!(pos0, self.stored, "verify continues the stored context");
            self.stored += tokens.len();
            self.verified += 1;
            Ok((0..tokens.len())
                .map(|i| self.logits((self.full)(tokens[i], pos0 + i)))
                .collect())
        }
        fn truncate(&mut self, len: usize) -> Result<()> {
            assert!(len <= self.stored);
            self.stored = len;
            Ok(())
        }
    }

    fn opts(max_tokens: usize, stop_ids: Vec<u32>) -> GenerateOptions {
        GenerateOptions {
            max_tokens,
            sampling: SamplingParams::default(),
            stop_ids,
        }
    }

    /// The greedy run of `full` alone.
    fn plain(
        full: fn(u32, usize) -> u32,
        prompt: &[u32],
        o: &GenerateOptions,
        cap: usize,
    ) -> Vec<u32> {
        let mut pos = prompt.len();
        let mut next = full(*prompt.last().unwrap(), pos - 1);
        let mut out = vec![next];
        while out.len() < o.max_tokens && !o.stop_ids.contains(&next) && pos < cap {
            next = full(next, pos);
            pos += 1;
            out.push(next);
        }
        out
    }

    fn full_rule(t: u32, pos: usize) -> u32 {
        ((t as usize * 7 + pos * 3) % 11) as u32
    }

    #[test]
    fn verified_output_is_full_attentions_whatever_the_drafts() {
        let prompt = [1, 2, 3];
        // Drafts always right, never right, right at most positions.
        let drafts: [fn(u32, usize) -> u32; 3] = [
            full_rule,
            |t, p| (full_rule(t, p) + 1) % 11,
            |t, p| if p % 3 == 0 { 0 } else { full_rule(t, p) },
        ];
        for draft in drafts {
            for k in [1, 2, 4, 7] {
                for (max_tokens, cap, stops) in [
                    (20, 100, vec![]),
                    (20, 12, vec![]),
                    (30, 100, vec![5]),
                    (1, 100, vec![]),
                ] {
                    let o = opts(max_tokens, stops);
                    let mut toy = Toy::new(draft);
                    let out = run_verified(cap, &prompt, &o, k, &mut toy, &mut |_| Ok(())).unwrap();
                    let want = plain(full_rule, &prompt, &o, cap);
                    assert_eq!(out.token_ids, want, "k {k}, max {max_tokens}, cap {cap}");
                    let s = out.verified.unwrap();
                    assert_eq!(s.rounds, toy.verified);
                    // Each round emits its accepted drafts and one token of its own.
                    assert_eq!(out.token_ids.len(), 1 + s.rounds + s.accepted);
                    assert!(toy.stored <= cap);
                }
            }
        }
    }

    #[test]
    fn drafts_full_attention_agrees_with_are_all_kept() {
        let o = opts(41, vec![]);
        let mut toy = Toy::new(full_rule);
        let out = run_verified(1000, &[4], &o, 4, &mut toy, &mut |_| Ok(())).unwrap();
        // 40 decoded tokens in rounds of 4 drafts + a bonus.
        assert_eq!(
            out.verified.unwrap(),
            VerifyStats {
                rounds: 8,
                drafted: 32,
                accepted: 32
            }
        );
    }

    #[test]
    fn draft_lengths_out_of_range_are_refused() {
        let mut toy = Toy::new(full_rule);
        let o = opts(4, vec![]);
        for k in [0, MAX_DRAFT + 1] {
            let err = run_verified(100, &[1], &o, k, &mut toy, &mut |_| Ok(())).unwrap_err();
            assert!(err.to_string().contains("drafts 1 to 32"), "{err}");
        }
    }

    /// Full attention's and the drafts' next-token logits, whatever the context.
    struct Fixed {
        stored: usize,
        full: Vec<f32>,
        draft: Vec<f32>,
    }

    impl VerifiedSteps for Fixed {
        fn forward(&mut self, tokens: &[u32], pos0: usize) -> Result<Vec<f32>> {
            let draft = tokens.len() == 1 && pos0 > 0;
            self.stored = pos0 + tokens.len();
            Ok(if draft { &self.draft } else { &self.full }.clone())
        }
        fn verify(&mut self, tokens: &[u32], pos0: usize) -> Result<Vec<Vec<f32>>> {
            self.stored = pos0 + tokens.len();
            Ok(vec![self.full.clone(); tokens.len()])
        }
        fn truncate(&mut self, len: usize) -> Result<()> {
            assert!(len <= self.stored);
            self.stored = len;
            Ok(())
        }
    }

    /// Sampled, every emitted token is distributed as full attention's sampling: the
    /// frequencies over many seeds match the softmax of full attention's logits (computed
    /// here by hand), not the drafts', though drafts are both kept and rejected.
    #[test]
    fn sampled_tokens_follow_full_attentions_distribution() {
        let full = vec![2.0, 1.0, 0.5, 0.0, -1.0];
        let draft = vec![0.0, 0.5, 2.0, 1.0, 0.0];
        let softmax = |l: &[f32], t: f32| -> Vec<f64> {
            let e: Vec<f64> = l.iter().map(|&x| ((x / t) as f64).exp()).collect();
            let s: f64 = e.iter().sum();
            e.iter().map(|x| x / s).collect()
        };
        // (temperature, top_k, the distribution full attention samples from)
        // Top-3 at 0.7: the drafts' top 3 (2, 3, 1) share two tokens with full attention's.
        let mut top3 = softmax(&full[..3], 0.7);
        top3.extend([0.0; 2]);
        for (temperature, top_k, want) in [(1.0, 0, softmax(&full, 1.0)), (0.7, 3, top3)] {
            let mut counts = [0usize; 5];
            let mut stats = VerifyStats::default();
            for seed in 0..4000 {
                let o = GenerateOptions {
                    max_tokens: 6,
                    sampling: SamplingParams {
                        temperature,
                        top_k,
                        top_p: 1.0,
                        seed,
                    },
                    stop_ids: vec![],
                };
                let mut m = Fixed {
                    stored: 0,
                    full: full.clone(),
                    draft: draft.clone(),
                };
                let out = run_verified(100, &[0, 1], &o, 3, &mut m, &mut |_| Ok(())).unwrap();
                for &t in &out.token_ids[1..] {
                    counts[t as usize] += 1;
                }
                let s = out.verified.unwrap();
                stats.accepted += s.accepted;
                stats.drafted += s.drafted;
            }
            let n: usize = counts.iter().sum();
            for (t, (&c, &p)) in counts.iter().zip(&want).enumerate() {
                let f = c as f64 / n as f64;
                // 20,000 draws: a standard error under 0.0035.
                assert!((f - p).abs() < 0.015, "T {temperature}, top-k {top_k}: token {t} drawn {f:.4}, full attention {p:.4}: {counts:?}");
            }
            assert!(
                0 < stats.accepted && stats.accepted < stats.drafted,
                "both kept and rejected drafts: {stats:?}"
            );
        }
        // The drafts alone would be far from it.
        let q = softmax(&draft, 1.0);
        assert!((q[2] - softmax(&full, 1.0)[2]).abs() > 0.3);
    }
}
