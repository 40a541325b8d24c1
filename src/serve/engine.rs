//! The serving engine: continuous batching over the paged cache. One step is: collect
//! transfer completions, schedule, start the new jobs, run the forward calls.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use super::cache_events::CacheEvent;
use super::disk::store::{DiskStats, SlotIo};
use super::disk::{DiskTier, DiskTierConfig};
use super::runner::BatchRunner;
use super::scheduler::{SchedStats, ScheduledSeq, Scheduler, SchedulerConfig, SeqId, Sequence};
use super::setup::{self, Hooks};
use super::transfer::TransferBackend;
use crate::device::KvDtype;
use crate::engine::logprobs::{token_logprob, TokenLogprob};
use crate::engine::{Sampler, SamplingParams};
use crate::model::{Model, ModelConfig};

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub sched: SchedulerConfig,
    /// Simulated host↔device link speed in GB/s for transfers; 0 = unthrottled.
    pub link_gbps: f64,
    /// Random delays on every copy (to expose ordering bugs); also turns the
    /// stream-ordering checker on.
    pub sanitize: bool,
    /// Prove every cross-stream access of the KV pages ordered (`crate::device::order`).
    pub check_order: bool,
    /// The disk tier's directory; its capacity is `sched.max_disk_offload_blocks`.
    pub disk: Option<DiskTierConfig>,
    /// The KV pages' element (CUDA: bf16 only). Every tier carries it unchanged; the disk
    /// tier's fingerprint names it, so a store of one element is never read as another.
    pub kv_dtype: KvDtype,
}

#[derive(Debug, Clone, Default)]
pub struct RequestParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Run to `max_tokens` even past an end-of-sequence token (for benchmarks).
    pub ignore_eos: bool,
    /// Record each sampled token's log-probability with this many alternatives
    /// (`crate::engine::logprobs`); `None`: none.
    pub logprobs: Option<usize>,
    /// Record each prompt token's log-probability (the first's excepted: nothing
    /// predicts it) with this many alternatives; the prompt then bypasses the prefix cache.
    pub prompt_logprobs: Option<usize>,
}

/// The log-probabilities recorded for a request since they were last taken
/// (`Engine::take_logprobs`).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct NewLogprobs {
    /// The prompt's tokens from the second on: given once, when the prompt is computed.
    pub prompt: Option<Vec<TokenLogprob>>,
    /// The tokens sampled since the last call, in order.
    pub sampled: Vec<TokenLogprob>,
}

/// What a request asked to record, and what is recorded and not yet taken.
struct LogprobLedger {
    sampled_top: Option<usize>,
    prompt_top: Option<usize>,
    /// Prompt position `i + 1`'s entry at `i`; complete at `prompt_len - 1` entries.
    prompt: Vec<TokenLogprob>,
    prompt_taken: bool,
    sampled: Vec<TokenLogprob>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct EngineStats {
    pub sched: SchedStats,
    pub steps: usize,
    /// Batched forward passes (at most one a step).
    pub forward_calls: usize,
    /// Tokens computed by forward calls, replays included.
    pub computed_tokens: usize,
    pub generated_tokens: usize,
    pub prompt_tokens: usize,
    /// The disk store's counters (zero without a disk tier).
    pub disk: DiskStats,
    /// Persisted prefix blocks taken over from an earlier process at start.
    pub restored_prefix_blocks: usize,
    /// Bytes of the recurrent states held for live sequences (state-layer models): back
    /// to 0 once every request has finished or been cancelled.
    pub recurrent_state_bytes: usize,
}

pub struct Engine {
    model: ModelConfig,
    sched: Scheduler,
    runner: Box<dyn BatchRunner>,
    backend: Box<dyn TransferBackend>,
    samplers: HashMap<SeqId, Sampler>,
    /// Log-probability of every sampled token, per request: a bitwise fingerprint of the
    /// logits that token equality alone would not give.
    logprobs: HashMap<SeqId, Vec<f32>>,
    /// The log-probabilities requests asked for (`RequestParams::logprobs`).
    ledgers: HashMap<SeqId, LogprobLedger>,
    streams: HashMap<SeqId, Sender<u32>>,
    stats: EngineStats,
    idle_rounds: usize,
    disk: Option<DiskTier>,
}

impl Engine {
    /// The CPU model over pages on the CPU device (`super::setup` builds every engine).
    pub fn new(model: Arc<Model>, cfg: EngineConfig) -> Result<Self> {
        setup::cpu_engine(&model, &cfg, Hooks::default())
    }

    /// As `new`, with the transfer backend wrapped by `wrap` (tests inject late and
    /// failed completions).
    pub fn with_backend(
        model: Arc<Model>,
        cfg: EngineConfig,
        wrap: impl FnOnce(Box<dyn TransferBackend>) -> Box<dyn TransferBackend>,
    ) -> Result<Self> {
        let hooks = Hooks {
            wrap_backend: Some(Box::new(wrap)),
            wrap_io: None,
        };
        setup::cpu_engine(&model, &cfg, hooks)
    }

    /// As `new`, with the disk store's IO wrapped by `wrap_io` (tests inject disk faults).
    pub fn with_disk_io(
        model: Arc<Model>,
        cfg: EngineConfig,
        wrap_io: impl FnOnce(Box<dyn SlotIo>) -> Box<dyn SlotIo>,
    ) -> Result<Self> {
        let hooks = Hooks {
            wrap_backend: None,
            wrap_io: Some(Box::new(wrap_io)),
        };
        setup::cpu_engine(&model, &cfg, hooks)
    }

    /// The parts `super::setup` built: the scheduler, the forward over the pages and the
    /// transfer backend, the disk tier if any.
    pub(super) fn assemble(
        model: ModelConfig,
        sched: Scheduler,
        (runner, backend): (Box<dyn BatchRunner>, Box<dyn TransferBackend>),
        disk: Option<DiskTier>,
        stats: EngineStats,
    ) -> Self {
        Self {
            model,
            sched,
            runner,
            backend,
            samplers: HashMap::new(),
            logprobs: HashMap::new(),
            ledgers: HashMap::new(),
            streams: HashMap::new(),
            stats,
            idle_rounds: 0,
            disk,
        }
    }

    /// The disk tier's one-line plan (`None` without a disk tier).
    pub fn disk_plan(&self) -> Option<String> {
        self.disk.as_ref().map(DiskTier::describe)
    }

    /// Waits for every transfer in flight (write-throughs included) and applies them, so
    /// no block stays pinned and the persisted index is complete.
    pub fn drain_transfers(&mut self) -> Result<()> {
        while self.backend.in_flight() > 0 {
            self.complete_jobs(true)?;
        }
        Ok(())
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            sched: self.sched.stats,
            disk: self
                .disk
                .as_ref()
                .map(|d| d.store.stats())
                .unwrap_or_default(),
            recurrent_state_bytes: self.runner.state_bytes(),
            ..self.stats
        }
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// Drops every cached block from the GPU if no request holds KV (vLLM's prefix-cache
    /// reset); false, dropping nothing, otherwise.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.sched.reset_prefix_cache()
    }

    /// Starts recording what enters and leaves the prefix cache (`take_cache_events`).
    pub fn record_cache_events(&mut self) {
        self.sched.bm.record_cache_events();
    }

    /// The prefix-cache events since the last call (none unless recording).
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.sched.bm.take_cache_events()
    }

    /// Queues a request; it joins the running batch between steps.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: &RequestParams) -> Result<SeqId> {
        params.sampling.validate()?;
        if let Some(&id) = prompt
            .iter()
            .find(|&&t| t as usize >= self.model.vocab_size)
        {
            bail!(
                "token id {id} is outside the vocabulary ({})",
                self.model.vocab_size
            );
        }
        let stop = if params.ignore_eos {
            Vec::new()
        } else {
            self.model.eos_token_ids.clone()
        };
        self.stats.prompt_tokens += prompt.len();
        let id = self.sched.add(prompt, params.max_tokens, stop)?;
        self.samplers
            .insert(id, Sampler::new(params.sampling.clone()));
        if params.logprobs.is_some() || params.prompt_logprobs.is_some() {
            if params.prompt_logprobs.is_some() {
                self.sched.want_prompt_rows(id)?;
            }
            self.ledgers.insert(
                id,
                LogprobLedger {
                    sampled_top: params.logprobs,
                    prompt_top: params.prompt_logprobs,
                    prompt: Vec::new(),
                    prompt_taken: false,
                    sampled: Vec::new(),
                },
            );
        }
        Ok(id)
    }

    /// The log-probabilities recorded for `id` since the last call (what
    /// `RequestParams::logprobs` and `prompt_logprobs` asked for).
    pub fn take_logprobs(&mut self, id: SeqId) -> NewLogprobs {
        let Some(l) = self.ledgers.get_mut(&id) else {
            return NewLogprobs::default();
        };
        let prompt_len = self.sched.seq(id).map_or(0, |s| s.prompt_len);
        let prompt_done = l.prompt_top.is_some() && l.prompt.len() + 1 >= prompt_len;
        NewLogprobs {
            prompt: (prompt_done && !std::mem::replace(&mut l.prompt_taken, true))
                .then(|| std::mem::take(&mut l.prompt)),
            sampled: std::mem::take(&mut l.sampled),
        }
    }

    /// Records the prompt log-probabilities a prompt chunk's rows give: row `j` (at
    /// position `p`) scores the prompt token at `p + 1`. A replayed chunk (recomputation)
    /// finds its positions recorded already.
    fn record_prompt_rows(&mut self, call: &ScheduledSeq, logits: &[f32]) -> Result<()> {
        let (Some(l), Some(seq)) = (self.ledgers.get_mut(&call.seq), self.sched.seq(call.seq))
        else {
            return Ok(());
        };
        let Some(top) = l.prompt_top else {
            return Ok(());
        };
        let vocab = self.model.vocab_size;
        let t = self
            .samplers
            .get(&call.seq)
            .context("request without a sampler")?
            .temperature();
        for (j, row) in logits.chunks_exact(vocab).enumerate() {
            let next = call.pos0 + j + 1;
            if next == l.prompt.len() + 1 && next < seq.prompt_len {
                l.prompt.push(token_logprob(row, seq.tokens[next], top, t));
            }
        }
        Ok(())
    }

    /// Queues a request and returns a receiver of its tokens as they are produced; the
    /// channel closes when the request finishes. Drive it with `step`.
    pub fn submit(
        &mut self,
        prompt: Vec<u32>,
        params: &RequestParams,
    ) -> Result<(SeqId, Receiver<u32>)> {
        let id = self.add_request(prompt, params)?;
        let (tx, rx) = channel();
        self.streams.insert(id, tx);
        Ok((id, rx))
    }

    pub fn has_unfinished(&self) -> bool {
        self.sched.has_unfinished()
    }

    /// Cancels a request (queued, running, preempted or finished) and forgets it. Its GPU
    /// pages and host slots are free after this call, or after the step that collects
    /// the transfer in flight over them.
    pub fn abort(&mut self, id: SeqId) -> Result<()> {
        self.sched.abort(id)?;
        self.forget(id);
        self.runner.release(id);
        Ok(())
    }

    /// Forgets a finished request and returns its sequence (prompt and output tokens).
    pub fn take_finished(&mut self, id: SeqId) -> Option<Sequence> {
        let seq = self.sched.remove_finished(id)?;
        self.forget(id);
        Some(seq)
    }

    fn forget(&mut self, id: SeqId) {
        self.samplers.remove(&id);
        self.streams.remove(&id);
        self.logprobs.remove(&id);
        self.ledgers.remove(&id);
    }

    fn complete_jobs(&mut self, wait: bool) -> Result<()> {
        let done = if wait {
            self.backend.wait()?
        } else {
            self.backend.poll()?
        };
        for c in done {
            self.sched.on_job_done(c.job, c.ok)?;
        }
        if let Some(d) = &self.disk {
            if let Some(persisted) = self.sched.bm.take_persisted_changes() {
                d.save_index_async(persisted);
            }
        }
        Ok(())
    }

    /// One engine step. Returns the requests that finished in it.
    pub fn step(&mut self) -> Result<Vec<SeqId>> {
        self.stats.steps += 1;
        self.complete_jobs(false)?;
        let plan = self.sched.schedule()?;
        for job in plan.jobs {
            let id = job.id;
            if let Err(e) = self.backend.submit(job) {
                // Never started: roll back as a failure.
                crate::log!("warning: transfer job {id} failed to start: {e:#}");
                self.sched.on_job_done(id, false)?;
            }
        }
        let mut finished = Vec::new();
        // One forward over every scheduled sequence (weights read once a step).
        let all_logits = if plan.batch.is_empty() {
            Vec::new()
        } else {
            self.stats.forward_calls += 1;
            self.runner.forward(&plan.batch)?
        };
        let vocab = self.model.vocab_size;
        for (call, logits) in plan.batch.iter().zip(all_logits) {
            self.stats.computed_tokens += call.tokens.len();
            let logits = logits.unwrap_or_default(); // [rows, vocab]: `call.want_logits()`
            if call.prompt_rows {
                self.record_prompt_rows(call, &logits)?;
            }
            let tok = if call.sample {
                let logits = logits
                    .get(logits.len().saturating_sub(vocab)..)
                    .filter(|l| l.len() == vocab)
                    .context("a sampling call without its last row's logits")?;
                let s = self
                    .samplers
                    .get_mut(&call.seq)
                    .context("request without a sampler")?;
                let t = s.sample(logits);
                self.logprobs
                    .entry(call.seq)
                    .or_default()
                    .push(crate::engine::logprob(logits, t));
                if let Some(l) = self.ledgers.get_mut(&call.seq) {
                    if let Some(top) = l.sampled_top {
                        l.sampled
                            .push(token_logprob(logits, t, top, s.temperature()));
                    }
                }
                Some(t)
            } else {
                None
            };
            let done = self.sched.on_forward_done(call, tok)?;
            if let Some(t) = tok {
                self.stats.generated_tokens += 1;
                if let Some(tx) = self.streams.get(&call.seq) {
                    let _ = tx.send(t); // a dropped receiver just stops listening
                }
            }
            if done {
                finished.push(call.seq);
                self.samplers.remove(&call.seq);
                self.streams.remove(&call.seq);
                self.runner.release(call.seq);
            }
        }
        if plan.batch.is_empty() {
            if self.backend.in_flight() > 0 {
                self.complete_jobs(true)?; // only transfers can make progress
            } else if self.sched.has_unfinished() && self.sched.jobs_in_flight() == 0 {
                // A round that only preempted is normal; several empty rounds in a row are not.
                self.idle_rounds += 1;
                if self.idle_rounds > 3 {
                    bail!("scheduler stalled: nothing runnable and no transfer in flight");
                }
            }
        } else {
            self.idle_rounds = 0;
        }
        Ok(finished)
    }

    /// Runs a batch of requests to completion and returns each one's new tokens, in order.
    pub fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        params: &[RequestParams],
    ) -> Result<Vec<Vec<u32>>> {
        Ok(self
            .generate_with_logprobs(prompts, params)?
            .into_iter()
            .map(|(t, _)| t)
            .collect())
    }

    /// As `generate`, with the log-probability of each new token.
    pub fn generate_with_logprobs(
        &mut self,
        prompts: &[Vec<u32>],
        params: &[RequestParams],
    ) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
        let ids = self.run_all(prompts, params, &mut |_, _| Ok(()))?;
        ids.iter()
            .map(|&id| {
                let s = self
                    .sched
                    .remove_finished(id)
                    .context("request did not finish")?;
                Ok((
                    s.output().to_vec(),
                    self.logprobs.remove(&id).unwrap_or_default(),
                ))
            })
            .collect()
    }

    /// As `generate`, with the log-probabilities each request recorded
    /// (`RequestParams::logprobs`, `prompt_logprobs`), taken after every step as the
    /// server takes them.
    pub fn generate_recorded(
        &mut self,
        prompts: &[Vec<u32>],
        params: &[RequestParams],
    ) -> Result<Vec<(Vec<u32>, NewLogprobs)>> {
        let mut got = vec![NewLogprobs::default(); prompts.len()];
        let ids = self.run_all(prompts, params, &mut |e, ids| {
            for (g, &id) in got.iter_mut().zip(ids) {
                let new = e.take_logprobs(id);
                if let Some(p) = new.prompt {
                    if g.prompt.replace(p).is_some() {
                        bail!("request {id}'s prompt log-probabilities given twice");
                    }
                }
                g.sampled.extend(new.sampled);
            }
            Ok(())
        })?;
        ids.iter()
            .zip(got)
            .map(|(&id, lp)| {
                let s = self.take_finished(id).context("request did not finish")?;
                Ok((s.output().to_vec(), lp))
            })
            .collect()
    }

    /// Queues the requests (one `RequestParams`, or one per prompt) and steps until every
    /// one has finished, calling `after_step` with their ids after each step; waits for
    /// the transfers in flight. Their ids, in order.
    fn run_all(
        &mut self,
        prompts: &[Vec<u32>],
        params: &[RequestParams],
        after_step: &mut dyn FnMut(&mut Self, &[SeqId]) -> Result<()>,
    ) -> Result<Vec<SeqId>> {
        if params.len() != prompts.len() && params.len() != 1 {
            bail!(
                "give one RequestParams, or one per prompt ({} prompts, {} params)",
                prompts.len(),
                params.len()
            );
        }
        let ids = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| self.add_request(p.clone(), &params[i.min(params.len() - 1)]))
            .collect::<Result<Vec<_>>>()?;
        while self.has_unfinished() {
            self.step()?;
            after_step(self, &ids)?;
        }
        self.drain_transfers()?;
        Ok(ids)
    }
}

/// Wall-clock helper for benchmarks.
pub fn timed<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    let t = Instant::now();
    let v = f()?;
    Ok((v, t.elapsed().as_secs_f64()))
}
