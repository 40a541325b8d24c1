//! Transfer jobs: the scheduler creates them, the worker side executes them.
//!
//! A job is a list of (logical block, source, destination) copies in one direction.
//! Backends report completions by job; the scheduler updates metadata only then.

use std::collections::VecDeque;

use anyhow::Result;
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::block_manager::{DiskSlotId, GpuPages, LogicalId, SlotId};
use super::residency::Tier;

pub type JobId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    /// GPU → lower tier (on preemption).
    Store,
    /// Lower tier → GPU (on resume).
    Load,
}

/// One end of a block copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loc {
    /// The device tier: the block's page and, with a window pool, its window page (`None`:
    /// its sliding-window layers are not copied).
    Gpu(GpuPages),
    Host(Tier, SlotId),
    /// A disk-tier slot and the key its header carries (the block's content hash for
    /// prefix blocks), checked on every read.
    Disk {
        slot: DiskSlotId,
        key: u64,
    },
}

impl Loc {
    pub fn is_disk(&self) -> bool {
        matches!(self, Loc::Disk { .. })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub block: LogicalId,
    pub src: Loc,
    pub dst: Loc,
}

impl TransferJob {
    /// Whether the job moves data to or from the disk tier.
    pub fn touches_disk(&self) -> bool {
        self.copies
            .iter()
            .any(|c| c.src.is_disk() || c.dst.is_disk())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferJob {
    pub id: JobId,
    pub kind: JobKind,
    pub copies: Vec<BlockCopy>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub job: JobId,
    pub ok: bool,
}

/// The worker side's data mover. `submit` starts a job and returns at once; `poll`
/// reports the jobs finished since the last call, in any order.
pub trait TransferBackend: Send {
    /// Starts `job`. An error means it never started (the caller rolls it back).
    fn submit(&mut self, job: TransferJob) -> Result<()>;
    /// Jobs finished since the last poll or wait.
    fn poll(&mut self) -> Result<Vec<Completion>>;
    /// Blocks until at least one job finishes (returns at once if none is in flight).
    fn wait(&mut self) -> Result<Vec<Completion>>;
    /// Jobs submitted and not yet reported.
    fn in_flight(&self) -> usize;
}

/// A backend that moves no data and completes jobs late and in random order: each poll
/// finishes each pending job with probability `p_done`; `p_fail` of jobs fail.
/// For testing the scheduler's bookkeeping alone.
pub struct SimBackend {
    pending: Vec<JobId>,
    rng: StdRng,
    pub p_done: f64,
    pub p_fail: f64,
}

impl SimBackend {
    pub fn new(seed: u64, p_done: f64, p_fail: f64) -> Self {
        Self {
            pending: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
            p_done,
            p_fail,
        }
    }
}

impl TransferBackend for SimBackend {
    fn submit(&mut self, job: TransferJob) -> Result<()> {
        self.pending.push(job.id);
        Ok(())
    }

    fn poll(&mut self) -> Result<Vec<Completion>> {
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            if self.rng.random_bool(self.p_done) {
                let job = self.pending.swap_remove(i); // random order
                let ok = !self.rng.random_bool(self.p_fail);
                done.push(Completion { job, ok });
            } else {
                i += 1;
            }
        }
        Ok(done)
    }

    fn wait(&mut self) -> Result<Vec<Completion>> {
        if self.pending.is_empty() {
            return Ok(Vec::new());
        }
        loop {
            let done = self.poll()?;
            if !done.is_empty() {
                return Ok(done);
            }
        }
    }

    fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

/// Wraps a real backend: holds back its completions and reports them late, in random
/// order, and turns some into failures (after the copy really ran, so a failed store's
/// source and a failed load's destination have both been touched).
pub struct ChaosBackend<B> {
    inner: B,
    held: VecDeque<Completion>,
    rng: StdRng,
    p_release: f64,
    p_fail: f64,
}

impl<B: TransferBackend> ChaosBackend<B> {
    pub fn new(inner: B, seed: u64, p_release: f64, p_fail: f64) -> Self {
        Self {
            inner,
            held: VecDeque::new(),
            rng: StdRng::seed_from_u64(seed),
            p_release,
            p_fail,
        }
    }

    fn release(&mut self) -> Vec<Completion> {
        let mut out = Vec::new();
        let mut keep = VecDeque::new();
        while let Some(mut c) = self.held.pop_front() {
            if self.rng.random_bool(self.p_release) {
                if c.ok && self.rng.random_bool(self.p_fail) {
                    c.ok = false;
                }
                out.push(c);
            } else {
                keep.push_back(c);
            }
        }
        // Shuffle what stays so release order is not submission order.
        let mut v: Vec<_> = keep.into();
        for i in (1..v.len()).rev() {
            v.swap(i, self.rng.random_range(0..=i));
        }
        self.held = v.into();
        out
    }
}

impl<B: TransferBackend> TransferBackend for ChaosBackend<B> {
    fn submit(&mut self, job: TransferJob) -> Result<()> {
        self.inner.submit(job)
    }

    fn poll(&mut self) -> Result<Vec<Completion>> {
        let done = self.inner.poll()?;
        self.held.extend(done);
        Ok(self.release())
    }

    fn wait(&mut self) -> Result<Vec<Completion>> {
        loop {
            if self.in_flight() == 0 {
                return Ok(Vec::new());
            }
            let done = if self.inner.in_flight() > 0 {
                self.inner.wait()?
            } else {
                Vec::new()
            };
            self.held.extend(done);
            let out = self.release();
            if !out.is_empty() {
                return Ok(out);
            }
        }
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.held.len()
    }
}

impl TransferBackend for Box<dyn TransferBackend> {
    fn submit(&mut self, job: TransferJob) -> Result<()> {
        (**self).submit(job)
    }
    fn poll(&mut self) -> Result<Vec<Completion>> {
        (**self).poll()
    }
    fn wait(&mut self) -> Result<Vec<Completion>> {
        (**self).wait()
    }
    fn in_flight(&self) -> usize {
        (**self).in_flight()
    }
}
