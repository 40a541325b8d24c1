//! The scheduler: owns requests and block metadata, decides each step's forward calls,
//! and creates transfer jobs. It never touches KV memory.
//!
//! Policy (see docs/serving.md): phase 1 extends running requests, preempting the
//! lowest-priority one when pages run out (offload its exclusive blocks, else recompute;
//! when the host tier is full, the least recently preempted host-resident requests are
//! first demoted to the disk tier to make room); phase 2 admits waiting requests only if nothing was preempted this round, loading
//! offloaded blocks back before allocating anything new.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Range;

use anyhow::{bail, ensure, Context, Result};

use super::block_key::{BlockKey, KeySeed};
use super::block_manager::{BlockManager, Hold, LogicalId, PageId, SlotId};
use super::residency::{Residency, Tier};
use super::transfer::{BlockCopy, JobId, JobKind, Loc, TransferJob};
use crate::model::WantLogits;

pub type SeqId = u64;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    /// Host-tier capacity in blocks; 0 disables offload (preemption recomputes).
    pub max_cpu_offload_blocks: usize,
    /// Disk-tier capacity in blocks; 0 = no disk tier. When the host tier has no room for
    /// a victim, the coldest host-resident blocks are demoted to disk to make room (or,
    /// when that cannot help, the victim's blocks go to disk); full prefix blocks are
    /// written through to disk.
    pub max_disk_offload_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Prompt tokens per forward call at most, a multiple of `block_size`. Chunks end at
    /// multiples of it (the first is shorter after a prefix hit that ends mid-chunk).
    pub prefill_chunk: usize,
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<()> {
        ensure!(self.block_size > 0, "--block-size must be > 0");
        ensure!(self.num_gpu_blocks > 0, "--num-gpu-blocks must be > 0");
        ensure!(self.max_num_seqs > 0, "--max-num-seqs must be > 0");
        ensure!(
            self.prefill_chunk > 0 && self.prefill_chunk.is_multiple_of(self.block_size),
            "prefill chunk ({}) must be a positive multiple of the block size ({})",
            self.prefill_chunk,
            self.block_size
        );
        ensure!(
            self.max_num_batched_tokens >= self.prefill_chunk,
            "--max-num-batched-tokens ({}) must be at least the prefill chunk ({})",
            self.max_num_batched_tokens,
            self.prefill_chunk
        );
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Running,
    /// Preempted with its blocks offloaded (or being offloaded).
    Preempted,
    Finished,
    /// Cancelled while a transfer over its blocks was in flight: out of every queue, its
    /// blocks are released (and the sequence forgotten) when that job completes.
    Aborted,
}

#[derive(Debug, Clone)]
pub struct Sequence {
    pub id: SeqId,
    /// Prompt then output.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    pub stop_ids: Vec<u32>,
    pub status: SeqStatus,
    /// Logical blocks, in position order.
    pub block_ids: Vec<LogicalId>,
    /// Positions whose KV is in the blocks.
    pub num_computed: usize,
    /// Chained keys of the leading blocks registered in (or found in) the prefix cache.
    hashes: Vec<BlockKey>,
    /// With a window pool: the blocks before this one are held `Hold::BlockOnly` (its
    /// window has moved past them), the rest `Hold::Windowed`.
    win_from: usize,
    job: Option<JobId>,
    /// Every prompt row's logits are wanted (prompt log-probabilities): the prompt is
    /// computed in full, never taken from the prefix cache, as vLLM does.
    prompt_rows: bool,
}

impl Sequence {
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Positions of the next forward call: up to the next multiple of `chunk`, within the
    /// prompt while it is not all computed, then within the known tokens (a recomputation
    /// replays its generated tokens in chunks too), so decode is one token. Exact whatever
    /// the cut: every row's result depends on its own token, position and KV alone
    /// (docs/serving.md "Determinism").
    pub fn next_chunk(&self, chunk: usize) -> Range<usize> {
        let s = self.num_computed;
        let end = if s < self.prompt_len {
            self.prompt_len
        } else {
            self.tokens.len()
        };
        s..((s / chunk + 1) * chunk).min(end)
    }
}

/// One forward call of the step.
#[derive(Debug, Clone)]
pub struct ScheduledSeq {
    pub seq: SeqId,
    pub pos0: usize,
    pub tokens: Vec<u32>,
    /// Physical pages of the sequence's blocks, covering `0..pos0 + tokens.len()`.
    pub block_table: Vec<PageId>,
    /// With a window pool, the sliding-window layers' pages of the same blocks: the null
    /// window page for blocks before the call's first window (never read); empty without.
    pub window_table: Vec<PageId>,
    /// Whether the call computes the last known token (so its logits give a new one);
    /// replayed calls of a recomputation do not sample.
    pub sample: bool,
    /// A prompt chunk of a sequence that wants every prompt row's logits.
    pub prompt_rows: bool,
}

impl ScheduledSeq {
    /// Which rows' logits the call needs.
    pub fn want_logits(&self) -> WantLogits {
        match (self.prompt_rows, self.sample) {
            (true, _) => WantLogits::Every,
            (false, true) => WantLogits::Last,
            (false, false) => WantLogits::No,
        }
    }
}

#[derive(Debug, Default)]
pub struct Schedule {
    pub batch: Vec<ScheduledSeq>,
    pub jobs: Vec<TransferJob>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedStats {
    pub preemptions: usize,
    pub blocks_stored: usize,
    pub blocks_loaded: usize,
    pub recomputations: usize,
    pub failed_jobs: usize,
    pub prefix_hit_blocks: usize,
    /// Tokens of the requests that looked up the prefix cache (vLLM's prefix-cache
    /// "queries"; a recomputed request looks up again).
    pub prefix_queried_tokens: usize,
    /// Of `blocks_stored` / `blocks_loaded`, those to / from the disk tier.
    /// (`blocks_stored_disk` counts every block written to disk for a request: spilled
    /// from the GPU, or demoted from the host tier.)
    pub blocks_stored_disk: usize,
    pub blocks_loaded_disk: usize,
    /// Of `blocks_stored_disk`, those demoted host tier → disk to make room for a victim.
    pub blocks_demoted: usize,
    /// Demotions that failed: the demoted request recomputed.
    pub demotion_failures: usize,
    /// Disk loads that failed (IO error or integrity check): the request recomputed.
    pub disk_load_failures: usize,
    /// Prefix-cache hits served from persisted disk copies (of `prefix_hit_blocks`).
    pub prefix_blocks_from_disk: usize,
    /// Prefix blocks written through to disk.
    pub prefix_blocks_persisted: usize,
    /// With a window pool: blocks a running sequence's window moved past (its hold on
    /// their window pages released; a page goes once no holder's window reaches it).
    pub window_releases: usize,
}

/// Who a job works for: a sequence (its store on preemption, its load on resume), or the
/// prefix cache (a write-through of registered blocks, which it pins meanwhile).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobOwner {
    Seq(SeqId),
    WriteThrough,
}

struct JobMeta {
    owner: JobOwner,
    kind: JobKind,
    tier: Tier,
    /// A store from the host tier to disk (not from the GPU).
    demotion: bool,
    blocks: Vec<LogicalId>,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    pub bm: BlockManager,
    seqs: BTreeMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    /// Sorted by id: arrival order is priority, the last is the first victim.
    running: Vec<SeqId>,
    jobs: HashMap<JobId, JobMeta>,
    next_seq: SeqId,
    next_job: JobId,
    pub stats: SchedStats,
    /// Blocks registered in the prefix cache since the last schedule: write-through
    /// candidates for the disk tier.
    to_persist: Vec<LogicalId>,
    /// Requests with blocks in (or moving to) the host tier, least recently preempted
    /// first: the order in which they are demoted to disk when the host tier is full
    /// (the most recently preempted request resumes first, so it stays in host memory).
    host_lru: VecDeque<SeqId>,
    /// What prefix-cache keys are chained to (the model, KV element, block size).
    key_seed: KeySeed,
    /// With a window pool: the widest sliding window of the model, in tokens.
    window: Option<usize>,
    /// Whether blocks are registered in and taken from the prefix cache: not for a model
    /// with state layers, whose recurrent state after a prefix is not in any block.
    prefix_reuse: bool,
}

/// Releases the blocks of a holder whose window has moved past the first `win_from`.
fn release_all(bm: &mut BlockManager, ids: Vec<LogicalId>, win_from: usize) -> Result<()> {
    for (i, id) in ids.into_iter().enumerate() {
        let hold = if i < win_from {
            Hold::BlockOnly
        } else {
            Hold::Windowed
        };
        bm.release(id, hold)?;
    }
    Ok(())
}

/// Window pages enough for `cfg.max_num_seqs` sequences each attending a window of
/// `window` tokens from its next call's first query (a prefill chunk's rows reach
/// `window − 1` positions back from the chunk's start), one more block each for a window
/// straddling block boundaries, and never more than the full pool.
pub fn window_pool_pages(cfg: &SchedulerConfig, window: usize) -> usize {
    let per_seq = (window - 1 + cfg.prefill_chunk).div_ceil(cfg.block_size) + 1;
    cfg.max_num_seqs
        .saturating_mul(per_seq)
        .min(cfg.num_gpu_blocks)
}

enum Preempted {
    Offloaded,
    Recomputed,
}

impl Scheduler {
    /// A scheduler whose prefix-cache keys have the anonymous seed: for one model in one
    /// process (tests, benches); `with_key_seed` when keys outlive it (the disk tier).
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
        Self::with_key_seed(cfg, KeySeed::default())
    }

    pub fn with_key_seed(cfg: SchedulerConfig, key_seed: KeySeed) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            key_seed,
            bm: BlockManager::with_disk(
                cfg.num_gpu_blocks,
                cfg.max_cpu_offload_blocks,
                cfg.max_disk_offload_blocks,
            ),
            cfg,
            seqs: BTreeMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            jobs: HashMap::new(),
            next_seq: 0,
            next_job: 0,
            stats: SchedStats::default(),
            to_persist: Vec::new(),
            host_lru: VecDeque::new(),
            window: None,
            prefix_reuse: true,
        })
    }

    /// No prefix caching: for a model with state layers. A sequence's state after a
    /// prefix is one per sequence and position, not in its blocks, so a cached block
    /// could not spare recomputing the prefix (vLLM and SGLang snapshot states at block
    /// boundaries for that; strata does not yet). Blocks are then never registered, so
    /// no KV event announces a block this worker could not reuse.
    pub fn without_prefix_reuse(&mut self) {
        self.prefix_reuse = false;
    }

    /// Gives the model's sliding-window layers a page pool of their own (`pages` pages,
    /// `window_pool_pages`): a block's windowed-layer page is freed once no holder's
    /// window (of `window` tokens, the model's widest) reaches it. Before any request.
    pub fn use_window_pool(&mut self, window: usize, pages: usize) -> Result<()> {
        ensure!(window > 0, "a sliding window of 0 tokens");
        ensure!(
            self.seqs.is_empty(),
            "the window pool is set before any request"
        );
        let bm = std::mem::replace(&mut self.bm, BlockManager::new(0, 0));
        self.bm = bm.with_window_pool(pages, window);
        self.window = Some(window);
        Ok(())
    }

    /// The first block a windowed layer reads for a query at `pos` (0 without a pool).
    fn first_window_block(&self, pos: usize) -> usize {
        crate::kv::first_window_block(self.window, pos, self.cfg.block_size)
    }

    /// Drops every cached block from the GPU (`BlockManager::reset_prefix_cache`) when no
    /// block is held (by a sequence, or pinned by a job); false otherwise.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let reset = self.bm.reset_prefix_cache();
        if reset {
            self.to_persist.clear(); // their blocks are gone
        }
        reset
    }

    /// What its prefix-cache keys are chained to.
    pub fn key_seed(&self) -> &KeySeed {
        &self.key_seed
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues a request; it joins the batch at a later step.
    pub fn add(
        &mut self,
        prompt: Vec<u32>,
        max_tokens: usize,
        stop_ids: Vec<u32>,
    ) -> Result<SeqId> {
        ensure!(!prompt.is_empty(), "empty prompt: nothing to generate from");
        // Saturating: a huge max_tokens must be refused, not wrap into a small total.
        let total = prompt.len().saturating_add(max_tokens);
        let cap = self.cfg.num_gpu_blocks.saturating_mul(self.cfg.block_size);
        ensure!(
            total <= cap,
            "request needs {total} tokens of KV but the GPU pool holds {cap} ({} blocks of {})",
            self.cfg.num_gpu_blocks,
            self.cfg.block_size
        );
        let id = self.next_seq;
        self.next_seq += 1;
        let prompt_len = prompt.len();
        self.seqs.insert(
            id,
            Sequence {
                id,
                tokens: prompt,
                prompt_len,
                max_tokens,
                stop_ids,
                status: SeqStatus::Waiting,
                block_ids: Vec::new(),
                num_computed: 0,
                hashes: Vec::new(),
                win_from: 0,
                job: None,
                prompt_rows: false,
            },
        );
        if max_tokens == 0 {
            self.seqs.get_mut(&id).expect("inserted").status = SeqStatus::Finished;
        } else {
            self.waiting.push_back(id);
        }
        Ok(id)
    }

    pub fn seq(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    /// Forgets a finished sequence.
    pub fn remove_finished(&mut self, id: SeqId) -> Option<Sequence> {
        match self.seqs.get(&id) {
            Some(s) if s.status == SeqStatus::Finished => self.seqs.remove(&id),
            _ => None,
        }
    }

    /// Whether steps still have work: queued requests, or transfers to collect (an aborted
    /// request's blocks are released only when its job completes).
    pub fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || !self.jobs.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Waiting requests, preempted ones included.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Cancels a request in any state and forgets it: it leaves the queues now, and its
    /// blocks (GPU pages, host slots) are released now or, when a transfer over them is in
    /// flight, as soon as that job completes (a page under a copy cannot be reused early).
    pub fn abort(&mut self, id: SeqId) -> Result<()> {
        let seq = self
            .seqs
            .get_mut(&id)
            .with_context(|| format!("abort of unknown sequence {id}"))?;
        seq.status = SeqStatus::Aborted;
        let in_flight = seq.job.is_some();
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
        if !in_flight {
            self.drop_aborted(id)?;
        }
        Ok(())
    }

    fn drop_aborted(&mut self, id: SeqId) -> Result<()> {
        self.host_lru.retain(|&s| s != id);
        let seq = self.seqs.remove(&id).expect("aborted sequences exist");
        release_all(&mut self.bm, seq.block_ids, seq.win_from)
    }

    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len()
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size)
    }

    /// Decides the next step: forward calls over resident pages only, and new jobs.
    pub fn schedule(&mut self) -> Result<Schedule> {
        let mut out = Schedule::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut preempted = false;
        let mut stalled = false;
        self.write_through(&mut out);

        // Phase 1: running requests, in priority order.
        for sid in self.running.clone() {
            if !self.running.contains(&sid) {
                continue; // preempted as a victim this round
            }
            let range = self.seqs[&sid].next_chunk(self.cfg.prefill_chunk);
            if range.len() > budget {
                continue;
            }
            let need = self
                .blocks_for(range.end)
                .saturating_sub(self.seqs[&sid].block_ids.len());
            let mut got = false;
            loop {
                if self.bm.available_pages() >= need {
                    let ids = self.bm.allocate(need)?;
                    self.seqs
                        .get_mut(&sid)
                        .expect("running")
                        .block_ids
                        .extend(ids);
                    got = true;
                    break;
                }
                // Pages under in-flight stores come free soon: wait rather than preempt more.
                if self.bm.pages_after_stores() >= need {
                    stalled = true;
                    break;
                }
                let victim = *self.running.last().expect("sid is running");
                // Its blocks are being written through (pinned): they can be offloaded
                // once that finishes, so wait rather than recompute.
                if self.only_pinned_blocks(victim)? {
                    stalled = true;
                    break;
                }
                // The host tier is full: demote colder requests to disk and wait for the
                // room rather than send this (soonest resumed) victim to the lowest tier.
                if self.demote_for(victim, &mut out)? {
                    stalled = true;
                    break;
                }
                preempted = true;
                let how = self.preempt(victim, &mut out)?;
                if victim == sid || matches!(how, Preempted::Offloaded) {
                    break;
                }
            }
            if got {
                budget -= range.len();
                out.batch.push(self.scheduled(sid, range)?);
            } else if preempted {
                break; // the round ends at a preemption
            }
        }

        // Phase 2: waiting requests, only if nothing was preempted or stalled.
        if !preempted && !stalled {
            self.admit(&mut out, &mut budget)?;
        }

        // Nothing to run and nothing in flight: break a wait-for cycle among waiting
        // requests holding pages by recomputing the lowest-priority holder.
        if out.batch.is_empty()
            && out.jobs.is_empty()
            && self.jobs.is_empty()
            && self.running.is_empty()
        {
            while let Some(&victim) = self.waiting.iter().rev().find(|&&id| {
                let s = &self.seqs[&id];
                s.job.is_none() && !s.block_ids.is_empty()
            }) {
                self.recompute(victim)?; // keeps its place in the queue
                self.admit(&mut out, &mut budget)?;
                if !out.batch.is_empty() || !out.jobs.is_empty() {
                    break;
                }
            }
        }
        Ok(out)
    }

    fn admit(&mut self, out: &mut Schedule, budget: &mut usize) -> Result<()> {
        let chunk = self.cfg.prefill_chunk;
        while let Some(&sid) = self.waiting.front() {
            if self.running.len() >= self.cfg.max_num_seqs {
                break;
            }
            let seq = &self.seqs[&sid];
            if seq.job.is_some() {
                break; // a store or load is in flight: defer
            }
            let fresh = seq.block_ids.is_empty();
            if fresh && self.prefix_in_progress(sid) {
                // A running request is computing this request's first shared block right
                // now: wait a round and reuse it from the prefix cache instead of
                // computing it twice (otherwise requests admitted together never share).
                break;
            }
            if fresh {
                self.prefix_lookup(sid)?;
            }
            // Old blocks first: load back what is offloaded, and defer.
            let seq = &self.seqs[&sid];
            let mut offloaded = Vec::new();
            for &id in &seq.block_ids {
                match self.bm.state(id)? {
                    Residency::Gpu => {}
                    Residency::Cpu | Residency::Ssd => offloaded.push(id),
                    s => bail!("waiting sequence {sid} has block {id} in {s:?} with no job"),
                }
            }
            if !offloaded.is_empty() {
                // Load only when the next chunk's new blocks will fit too, so a loaded
                // request never sits on pages it cannot use.
                let need = self
                    .blocks_for(seq.next_chunk(chunk).end)
                    .saturating_sub(seq.block_ids.len());
                if self.bm.can_load_and_allocate(&offloaded, need) {
                    // One tier per job (a backend serves one tier); the rest next round.
                    let tier = match self.bm.state(offloaded[0])? {
                        Residency::Ssd => Tier::Ssd,
                        _ => Tier::Cpu,
                    };
                    let mut group = Vec::new();
                    for id in offloaded {
                        if (self.bm.state(id)? == Residency::Ssd) == (tier == Tier::Ssd) {
                            group.push(id);
                        }
                    }
                    if tier == Tier::Cpu {
                        self.host_lru.retain(|&s| s != sid); // in use again
                    }
                    let moves = self.bm.start_load(&group)?;
                    let copies = moves
                        .iter()
                        .map(|&(block, slot, pages)| BlockCopy {
                            block,
                            src: self.tier_loc(tier, block, slot),
                            dst: Loc::Gpu(pages),
                        })
                        .collect();
                    let job = self.new_job(sid, JobKind::Load, tier, group, copies);
                    out.jobs.push(job);
                }
                break;
            }
            // All old blocks resident: now (and only now) allocate new ones.
            let range = seq.next_chunk(chunk);
            let need = self
                .blocks_for(range.end)
                .saturating_sub(seq.block_ids.len());
            if range.len() > *budget || self.bm.available_pages() < need {
                if fresh {
                    self.undo_lookup(sid)?; // hold nothing while waiting
                }
                break;
            }
            let ids = self.bm.allocate(need)?;
            let seq = self.seqs.get_mut(&sid).expect("waiting");
            seq.block_ids.extend(ids);
            seq.status = SeqStatus::Running;
            self.waiting.pop_front();
            let at = self.running.partition_point(|&r| r < sid);
            self.running.insert(at, sid);
            *budget -= range.len();
            out.batch.push(self.scheduled(sid, range)?);
        }
        Ok(())
    }

    /// Whether the first block of `sid` is not cached yet but is being computed by a
    /// running request (which has registered nothing yet), so waiting a round pays.
    fn prefix_in_progress(&self, sid: SeqId) -> bool {
        let bs = self.cfg.block_size;
        let seq = &self.seqs[&sid];
        if seq.tokens.len() <= bs || seq.prompt_rows || !self.prefix_reuse {
            return false; // no block to share (a lookup leaves a token), or it takes none
        }
        let first = BlockKey::chained(&self.key_seed, None, &seq.tokens[..bs]);
        if self.bm.lookup(first).is_some() || self.bm.is_persisted(first) {
            return false; // cached already: the lookup will take it
        }
        self.running.iter().any(|r| {
            let other = &self.seqs[r];
            other.hashes.is_empty()
                && other.tokens.len() > bs
                && other.tokens[..bs] == seq.tokens[..bs]
        })
    }

    /// Asks for the logits of every prompt row of a request not yet started (prompt
    /// log-probabilities): its prompt is then computed in full, bypassing the prefix cache.
    pub fn want_prompt_rows(&mut self, id: SeqId) -> Result<()> {
        let seq = self
            .seqs
            .get_mut(&id)
            .with_context(|| format!("unknown sequence {id}"))?;
        ensure!(
            seq.num_computed == 0 && seq.block_ids.is_empty(),
            "sequence {id} has started"
        );
        seq.prompt_rows = true;
        Ok(())
    }

    /// Takes references to the longest run of cached blocks the sequence's tokens start
    /// with, always leaving at least one token to compute.
    fn prefix_lookup(&mut self, sid: SeqId) -> Result<()> {
        let bs = self.cfg.block_size;
        let seq = &self.seqs[&sid];
        let limit = if seq.prompt_rows || !self.prefix_reuse {
            0 // every prompt row must be computed
        } else {
            (seq.tokens.len() - 1) / bs
        };
        // A hit is a GPU-resident block, or a persisted disk copy (loaded on admission) that
        // no block of its hash is copying right now.
        let mut found = Vec::new(); // (hash, Some(GPU block) | None for a disk copy)
        let mut prev = None;
        for b in 0..limit {
            let h = BlockKey::chained(
                &self.key_seed,
                prev.as_ref(),
                &seq.tokens[b * bs..(b + 1) * bs],
            );
            match self.bm.lookup(h) {
                Some(id) => found.push((h, Some(id))),
                None if self.bm.persisted_hit(h) => found.push((h, None)),
                None => break,
            }
            prev = Some(h);
        }
        // With a window pool, only as far as every block the next query's window reaches
        // still has its windowed layers' KV (vLLM's sliding-window hit rule).
        let window_kept = |n: usize| {
            found[self.first_window_block(n * bs)..n]
                .iter()
                .all(|(_, id)| id.is_none_or(|id| self.bm.has_window(id)))
        };
        let mut n = found.len();
        while n > 0 && !window_kept(n) {
            n -= 1;
        }
        found.truncate(n);
        let win_from = self.first_window_block(n * bs);
        self.stats.prefix_queried_tokens += seq.tokens.len();
        let mut hits = Vec::with_capacity(n);
        let mut hashes: Vec<BlockKey> = Vec::with_capacity(n);
        for (b, (h, on_gpu)) in found.into_iter().enumerate() {
            let hold = if b < win_from {
                Hold::BlockOnly
            } else {
                Hold::Windowed
            };
            let id = match on_gpu {
                Some(id) => {
                    self.bm.acquire(id, hold)?;
                    id
                }
                None => self
                    .bm
                    .acquire_persisted(
                        h,
                        hashes.last().copied(),
                        &seq.tokens[b * bs..(b + 1) * bs],
                        hold,
                    )
                    .context("a persisted prefix block vanished during the lookup")?,
            };
            hits.push(id);
            hashes.push(h);
        }
        self.stats.prefix_hit_blocks += hits.len();
        let seq = self.seqs.get_mut(&sid).expect("exists");
        seq.num_computed = hits.len() * bs;
        seq.block_ids = hits;
        seq.hashes = hashes;
        seq.win_from = win_from;
        Ok(())
    }

    fn undo_lookup(&mut self, sid: SeqId) -> Result<()> {
        let seq = self.seqs.get_mut(&sid).expect("exists");
        let ids = std::mem::take(&mut seq.block_ids);
        seq.num_computed = 0;
        seq.hashes.clear();
        let win_from = std::mem::take(&mut seq.win_from);
        self.stats.prefix_hit_blocks -= ids.len();
        self.stats.prefix_queried_tokens -= seq.tokens.len();
        release_all(&mut self.bm, ids, win_from)
    }

    fn scheduled(&self, sid: SeqId, range: Range<usize>) -> Result<ScheduledSeq> {
        let seq = &self.seqs[&sid];
        let n = self.blocks_for(range.end);
        let first_win = self.first_window_block(range.start);
        let null = self.bm.null_window_page();
        let mut block_table = Vec::with_capacity(n);
        let mut window_table = Vec::with_capacity(if null.is_some() { n } else { 0 });
        for (i, &id) in seq.block_ids[..n].iter().enumerate() {
            let pages = self
                .bm
                .resolve(id)
                .with_context(|| format!("sequence {sid} scheduled with a non-resident block"))?;
            block_table.push(pages.page);
            if let Some(null) = null {
                let win = if i < first_win { Some(null) } else { pages.win };
                window_table.push(win.with_context(|| {
                    format!("sequence {sid}: block {id} in its window has no window page")
                })?);
            }
        }
        Ok(ScheduledSeq {
            seq: sid,
            pos0: range.start,
            sample: range.end == seq.tokens.len(),
            prompt_rows: seq.prompt_rows && range.start < seq.prompt_len,
            tokens: seq.tokens[range].to_vec(),
            block_table,
            window_table,
        })
    }

    fn new_job(
        &mut self,
        seq: SeqId,
        kind: JobKind,
        tier: Tier,
        blocks: Vec<LogicalId>,
        copies: Vec<BlockCopy>,
    ) -> TransferJob {
        self.seqs.get_mut(&seq).expect("exists").job = Some(self.next_job);
        self.add_job(JobOwner::Seq(seq), kind, tier, blocks, copies)
    }

    fn add_job(
        &mut self,
        owner: JobOwner,
        kind: JobKind,
        tier: Tier,
        blocks: Vec<LogicalId>,
        copies: Vec<BlockCopy>,
    ) -> TransferJob {
        let id = self.next_job;
        self.next_job += 1;
        let demotion = copies.iter().any(|c| matches!(c.src, Loc::Host(..)));
        self.jobs.insert(
            id,
            JobMeta {
                owner,
                kind,
                tier,
                demotion,
                blocks,
            },
        );
        TransferJob { id, kind, copies }
    }

    /// The lower-tier end of a copy for `block` in `slot` of `tier`.
    fn tier_loc(&self, tier: Tier, block: LogicalId, slot: SlotId) -> Loc {
        match tier {
            Tier::Cpu => Loc::Host(Tier::Cpu, slot),
            Tier::Ssd => Loc::Disk {
                slot,
                key: self.disk_key(block),
            },
        }
    }

    /// The key a block's disk slot header carries: its content hash for a prefix block (so
    /// a later process can check it), else its logical id, tagged so the two never collide
    /// by construction of the tag bit alone.
    fn disk_key(&self, block: LogicalId) -> u64 {
        match self.bm.block(block).ok().and_then(|b| b.hash) {
            Some(h) => h.wire(),
            None => (1 << 63) | block as u64,
        }
    }

    /// Writes newly registered prefix blocks through to the disk tier (one job), pinning
    /// them until it completes, so a restarted process can reuse them.
    fn write_through(&mut self, out: &mut Schedule) {
        if self.cfg.max_disk_offload_blocks == 0 {
            self.to_persist.clear();
            return;
        }
        let mut blocks = Vec::new();
        let mut copies = Vec::new();
        for id in std::mem::take(&mut self.to_persist) {
            if let Some((pages, slot, hash)) = self.bm.start_persist(id) {
                blocks.push(id);
                copies.push(BlockCopy {
                    block: id,
                    src: Loc::Gpu(pages),
                    dst: Loc::Disk {
                        slot,
                        key: hash.wire(),
                    },
                });
            }
        }
        if !blocks.is_empty() {
            let job = self.add_job(
                JobOwner::WriteThrough,
                JobKind::Store,
                Tier::Ssd,
                blocks,
                copies,
            );
            out.jobs.push(job);
        }
    }

    /// A sequence's GPU blocks that no one else holds: what a preemption can offload.
    fn exclusive_blocks(&self, sid: SeqId) -> Result<Vec<LogicalId>> {
        let mut exclusive = Vec::new();
        for &id in &self.seqs[&sid].block_ids {
            let b = self.bm.block(id)?;
            if b.refs == 1 && b.state == Residency::Gpu {
                exclusive.push(id);
            }
        }
        Ok(exclusive)
    }

    /// Makes room in the full host tier for `victim`'s exclusive blocks by demoting the
    /// least recently preempted host-resident requests to disk (one job each). Returns
    /// true when the victim should wait for demotions (started now or in flight) instead
    /// of being preempted now; false when no demotion is needed or none can help (then
    /// the victim goes to disk itself, or recomputes, as without demotion).
    fn demote_for(&mut self, victim: SeqId, out: &mut Schedule) -> Result<bool> {
        if self.cfg.max_cpu_offload_blocks == 0 || self.cfg.max_disk_offload_blocks == 0 {
            return Ok(false);
        }
        let n = self.exclusive_blocks(victim)?.len();
        let room = self.bm.free_slots() + self.bm.slots_being_demoted();
        if n == 0 || self.bm.free_slots() >= n || n > self.bm.num_slots() {
            eprintln!(
                "DEMOTE no-need n={n} free={} num={}",
                self.bm.free_slots(),
                self.bm.num_slots()
            );
            return Ok(false);
        }
        if room >= n {
            return Ok(true); // in-flight demotions will make the room
        }
        let mut chosen = Vec::new(); // (request, its host-resident blocks)
        let mut got = room;
        for &sid in &self.host_lru {
            if got >= n {
                break;
            }
            let seq = &self.seqs[&sid];
            if seq.job.is_some() {
                continue; // its store to the host tier is still in flight
            }
            let mut blocks = Vec::new();
            for &id in &seq.block_ids {
                if self.bm.state(id)? == Residency::Cpu {
                    blocks.push(id);
                }
            }
            got += blocks.len();
            chosen.push((sid, blocks));
        }
        let to_disk: usize = chosen.iter().map(|(_, b)| b.len()).sum();
        if got < n || self.bm.disk_room() < to_disk {
            eprintln!(
                "DEMOTE cannot got={got} n={n} room={} to_disk={to_disk} lru={}",
                self.bm.disk_room(),
                self.host_lru.len()
            );
            return Ok(false);
        }
        eprintln!("DEMOTE yes");
        for (sid, blocks) in chosen {
            self.host_lru.retain(|&s| s != sid);
            let moves = self.bm.start_demote(&blocks)?;
            let copies = moves
                .iter()
                .map(|&(block, slot, disk)| BlockCopy {
                    block,
                    src: Loc::Host(Tier::Cpu, slot),
                    dst: self.tier_loc(Tier::Ssd, block, disk),
                })
                .collect();
            let job = self.new_job(sid, JobKind::Store, Tier::Ssd, blocks, copies);
            out.jobs.push(job);
        }
        Ok(true)
    }

    /// Preempts a running victim: offload its exclusive resident blocks to the host tier
    /// when it has room for all of them, else to the disk tier when that has room, else
    /// recompute. Shared (prefix) blocks stay on the GPU.
    fn preempt(&mut self, victim: SeqId, out: &mut Schedule) -> Result<Preempted> {
        self.stats.preemptions += 1;
        self.running.retain(|&r| r != victim);
        let exclusive = self.exclusive_blocks(victim)?;
        let n = exclusive.len();
        let tier = if n == 0 {
            None
        } else if self.cfg.max_cpu_offload_blocks > 0 && self.bm.free_slots() >= n {
            Some(Tier::Cpu)
        } else if self.cfg.max_disk_offload_blocks > 0 && self.bm.disk_room() >= n {
            Some(Tier::Ssd)
        } else {
            None
        };
        if let Some(tier) = tier {
            let moves = self.bm.start_store(&exclusive, tier)?;
            let copies = moves
                .iter()
                .map(|&(block, pages, slot)| BlockCopy {
                    block,
                    src: Loc::Gpu(pages),
                    dst: self.tier_loc(tier, block, slot),
                })
                .collect();
            let job = self.new_job(victim, JobKind::Store, tier, exclusive, copies);
            out.jobs.push(job);
            if tier == Tier::Cpu {
                self.host_lru.push_back(victim);
            }
            self.seqs.get_mut(&victim).expect("exists").status = SeqStatus::Preempted;
            self.waiting.push_front(victim);
            return Ok(Preempted::Offloaded);
        }
        self.recompute(victim)?;
        self.waiting.push_front(victim);
        Ok(Preempted::Recomputed)
    }

    /// Whether none of the sequence's GPU blocks is exclusive now, but some would be once
    /// their write-through to disk completes.
    fn only_pinned_blocks(&self, sid: SeqId) -> Result<bool> {
        let mut pinned = false;
        for &id in &self.seqs[&sid].block_ids {
            let b = self.bm.block(id)?;
            if b.state != Residency::Gpu {
                continue;
            }
            match (b.refs, self.bm.is_pinned(id)) {
                (1, _) => return Ok(false),
                (2, true) => pinned = true,
                _ => {}
            }
        }
        Ok(pinned)
    }

    /// Drops a sequence's KV: release its blocks and start it over (its tokens are kept).
    fn recompute(&mut self, sid: SeqId) -> Result<()> {
        self.stats.recomputations += 1;
        self.host_lru.retain(|&s| s != sid);
        let seq = self.seqs.get_mut(&sid).expect("exists");
        let ids = std::mem::take(&mut seq.block_ids);
        seq.num_computed = 0;
        seq.hashes.clear();
        seq.status = SeqStatus::Waiting;
        let win_from = std::mem::take(&mut seq.win_from);
        release_all(&mut self.bm, ids, win_from)
    }

    /// A job finished: update metadata. A failed store leaves the blocks on the GPU; a
    /// failed load releases the reserved pages and the request falls back to recomputation;
    /// a failed write-through just frees its disk slots.
    pub fn on_job_done(&mut self, job: JobId, ok: bool) -> Result<()> {
        let meta = self
            .jobs
            .remove(&job)
            .with_context(|| format!("completion for unknown job {job}"))?;
        let n = meta.blocks.len();
        let JobOwner::Seq(seq) = meta.owner else {
            for &id in &meta.blocks {
                self.bm.finish_persist(id, ok)?;
            }
            if ok {
                self.stats.prefix_blocks_persisted += n;
            } else {
                self.stats.failed_jobs += 1;
            }
            return Ok(());
        };
        let from_persisted = meta
            .blocks
            .iter()
            .filter(|&&id| self.bm.loads_persisted_copy(id))
            .count();
        for &id in &meta.blocks {
            match meta.kind {
                JobKind::Store => self.bm.finish_store(id, ok)?,
                JobKind::Load => self.bm.finish_load(id, ok)?,
            }
        }
        if ok {
            self.stats.prefix_blocks_from_disk += from_persisted;
        }
        let disk = meta.tier == Tier::Ssd;
        match (meta.kind, ok) {
            (JobKind::Store, true) if meta.demotion => {
                self.stats.blocks_stored_disk += n;
                self.stats.blocks_demoted += n;
            }
            (JobKind::Store, true) => {
                self.stats.blocks_stored += n;
                self.stats.blocks_stored_disk += if disk { n } else { 0 };
            }
            (JobKind::Load, true) => {
                self.stats.blocks_loaded += n;
                self.stats.blocks_loaded_disk += if disk { n } else { 0 };
            }
            (kind, false) => {
                self.stats.failed_jobs += 1;
                if disk && kind == JobKind::Load {
                    self.stats.disk_load_failures += 1;
                }
                if meta.demotion {
                    self.stats.demotion_failures += 1;
                }
            }
        }
        let s = self.seqs.get_mut(&seq).expect("exists");
        s.job = None;
        if s.status == SeqStatus::Aborted {
            return self.drop_aborted(seq);
        }
        if !ok && meta.kind == JobKind::Store && meta.tier == Tier::Cpu {
            self.host_lru.retain(|&s| s != seq); // its blocks stayed on the GPU
        }
        // A failed load, or a failed demotion (whose host slots the full host tier needs
        // back): drop the KV and recompute. The request stays in the waiting queue.
        if !ok && (meta.kind == JobKind::Load || meta.demotion) {
            self.recompute(seq)?;
        }
        Ok(())
    }

    /// A forward call finished; `sampled` is the new token when the call sampled.
    /// Returns true when the sequence finished (its blocks are released then).
    pub fn on_forward_done(&mut self, call: &ScheduledSeq, sampled: Option<u32>) -> Result<bool> {
        let bs = self.cfg.block_size;
        ensure!(
            self.seqs.get(&call.seq).map(|s| s.num_computed) == Some(call.pos0),
            "sequence {} unknown or computed out of order",
            call.seq
        );
        let first_win = self.first_window_block(call.pos0 + call.tokens.len());
        let seq = self.seqs.get_mut(&call.seq).expect("checked above");
        seq.num_computed += call.tokens.len();
        // Register every newly completed block, prompt or generated, in the prefix cache.
        let full = seq.num_computed / bs;
        while self.prefix_reuse && seq.hashes.len() < full {
            let b = seq.hashes.len();
            let parent = seq.hashes.last().copied();
            let tokens = &seq.tokens[b * bs..(b + 1) * bs];
            let h = BlockKey::chained(&self.key_seed, parent.as_ref(), tokens);
            self.bm.register(seq.block_ids[b], h, parent, tokens)?;
            seq.hashes.push(h);
            self.to_persist.push(seq.block_ids[b]);
        }
        // Blocks the next call's window no longer reaches: their windowed layers' KV may go.
        while seq.win_from < first_win.min(seq.block_ids.len()) {
            self.bm.release_window(seq.block_ids[seq.win_from])?;
            seq.win_from += 1;
            self.stats.window_releases += 1;
        }
        let Some(tok) = sampled else {
            return Ok(false);
        };
        seq.tokens.push(tok);
        let n_out = seq.tokens.len() - seq.prompt_len;
        if n_out < seq.max_tokens && !seq.stop_ids.contains(&tok) {
            return Ok(false);
        }
        seq.status = SeqStatus::Finished;
        let win_from = std::mem::take(&mut seq.win_from);
        release_all(&mut self.bm, std::mem::take(&mut seq.block_ids), win_from)?;
        self.running.retain(|&r| r != call.seq);
        Ok(true)
    }

    /// Invariants for tests: block bookkeeping against the sequences, every running
    /// sequence fully resident, every queued sequence in exactly one queue.
    pub fn check(&self) -> Result<(), String> {
        let holders: Vec<&[LogicalId]> = self.seqs.values().map(|s| &s.block_ids[..]).collect();
        self.bm.check(&holders)?;
        for &sid in &self.running {
            let s = &self.seqs[&sid];
            if s.status != SeqStatus::Running || self.waiting.contains(&sid) {
                return Err(format!("sequence {sid} running with status {:?}", s.status));
            }
            for &id in &s.block_ids {
                if self.bm.resolve(id).is_err() {
                    return Err(format!(
                        "running sequence {sid} has non-resident block {id}"
                    ));
                }
            }
        }
        for (&sid, s) in &self.seqs {
            // Exactly the blocks before its next query's window are held block-only.
            let first_win = self
                .first_window_block(s.num_computed)
                .min(s.block_ids.len());
            if s.status != SeqStatus::Finished && s.win_from != first_win {
                return Err(format!(
                    "sequence {sid} holds the window of blocks from {}, its window starts at {first_win}",
                    s.win_from
                ));
            }
        }
        self.check_window_holds()?;
        self.check_host_lru()?;
        for (&sid, s) in &self.seqs {
            let queued = self.waiting.iter().filter(|&&w| w == sid).count()
                + self.running.iter().filter(|&&r| r == sid).count();
            let want = usize::from(!matches!(
                s.status,
                SeqStatus::Finished | SeqStatus::Aborted
            ));
            if queued != want {
                return Err(format!(
                    "sequence {sid} ({:?}) queued {queued} times",
                    s.status
                ));
            }
            if s.status != SeqStatus::Finished
                && s.block_ids.len() < s.num_computed.div_ceil(self.cfg.block_size)
            {
                return Err(format!(
                    "sequence {sid} has fewer blocks than computed tokens"
                ));
            }
        }
        Ok(())
    }

    /// Every block's window references are its holders whose window reaches it (and a
    /// write-through's pin); none without a window pool but every hold.
    fn check_window_holds(&self) -> Result<(), String> {
        let mut want: HashMap<LogicalId, u32> = HashMap::new();
        for s in self.seqs.values() {
            if self.window.is_none() && s.win_from > 0 {
                return Err(format!("sequence {}: window holds without a pool", s.id));
            }
            for &id in s.block_ids.iter().skip(s.win_from) {
                *want.entry(id).or_default() += 1;
            }
        }
        for s in self.seqs.values() {
            for &id in &s.block_ids {
                let b = self.bm.block(id).map_err(|e| e.to_string())?;
                let w = want.get(&id).copied().unwrap_or(0) + u32::from(self.bm.is_pinned(id));
                if b.win_refs != w {
                    return Err(format!(
                        "block {id}: {} window refs, {w} holders",
                        b.win_refs
                    ));
                }
            }
        }
        Ok(())
    }

    /// The demotion order names exactly the requests with blocks in (or moving to) the
    /// host tier, once each: none is stranded in host memory, none demoted twice.
    fn check_host_lru(&self) -> Result<(), String> {
        for (i, sid) in self.host_lru.iter().enumerate() {
            if self.host_lru.iter().skip(i + 1).any(|s| s == sid) {
                return Err(format!("sequence {sid} is twice in the host LRU"));
            }
        }
        for (&sid, s) in &self.seqs {
            let mut in_host = false;
            for &id in &s.block_ids {
                let st = self.bm.state(id).map_err(|e| e.to_string())?;
                in_host |= matches!(st, Residency::Cpu | Residency::MovingToCpu);
            }
            if in_host != self.host_lru.contains(&sid) {
                return Err(format!(
                    "sequence {sid}: host-resident {in_host}, in the host LRU {}",
                    !in_host
                ));
            }
        }
        if let Some(sid) = self.host_lru.iter().find(|s| !self.seqs.contains_key(s)) {
            return Err(format!("forgotten sequence {sid} is in the host LRU"));
        }
        Ok(())
    }
}
