//! The disk tier's transfer backend, and the tiered backend that routes each job to the
//! host tier's backend or this one.
//!
//! Blocks move through a small pool of **staging** blocks in host memory of the pages'
//! device (pinned on CUDA), with the device's own copies on its `Staging` stream, so the
//! tier works on every device and under the stream-ordering checker:
//!
//! - a block **stored** (a spill from a device page, or a demotion from a host-tier slot):
//!   page → staging copy after the compute queued so far, then an event; once the engine
//!   thread sees the event complete, an IO thread checksums the staging block and writes
//!   its slot, and the staging block is free again;
//! - a block **loaded**: an IO thread reads and verifies its slot into a staging block;
//!   then the engine thread queues the staging → page copy (after the compute queued so
//!   far: the page may have just been freed by a step in flight) and an event; once that
//!   completes the staging block is free.
//!
//! The engine thread only submits and polls: it never waits on disk IO. A job is all or
//! nothing: one failed block (IO error, integrity check) fails the whole job — reported
//! once none of its copies is still in flight — and the scheduler's rollback (store:
//! blocks stay where they were; load: recompute) applies. A job larger than the staging
//! pool streams through it block by block.
//!
//! Staging block layout: `[layers][K | V][block_size, kv_heads, head_dim]` in the device's
//! KV element, which is also a slot's payload, byte for byte (the fingerprint names the
//! element type and byte order).

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Result};

use super::pool::IoPool;
use super::store::DiskStore;
use crate::device::order::Access;
use crate::offload::device::{EventId, MemId, OffloadDevice, StreamRole};
use crate::serve::device_pages::{lock, Place, SharedPages};
use crate::serve::residency::Tier;
use crate::serve::transfer::{Completion, JobId, JobKind, Loc, TransferBackend, TransferJob};

/// Staging blocks per IO thread: one being copied while another is on disk.
const STAGING_PER_THREAD: usize = 2;

/// One block of a disk job: its memory end, its disk slot and the key the slot carries.
#[derive(Debug, Clone, Copy)]
struct Block {
    mem: Place,
    slot: u32,
    key: u64,
}

struct Job {
    kind: JobKind,
    blocks: Vec<Block>,
    /// Blocks started so far (in order).
    started: usize,
    /// Blocks started and not finished.
    in_flight: usize,
    ok: bool,
}

/// An IO thread's report on one block.
struct IoDone {
    job: JobId,
    block: usize,
    staging: usize,
    ok: bool,
}

/// A staging copy in flight: `out` (page → staging, before the write) or in.
struct Copying {
    job: JobId,
    block: usize,
    staging: usize,
    ev: EventId,
    out: bool,
}

/// A staging block's host address, handed to an IO thread.
struct HostBlock(*mut u8, usize);

// SAFETY: the address lies in a host allocation of the pages' device, which lives as long
// as the pages, which outlive the IO pool (`DiskBackend` drops the pool first); the block
// is the IO thread's alone between its dispatch and its report (the checker's host access).
unsafe impl Send for HostBlock {}

impl HostBlock {
    /// # Safety
    /// As for `Send`: the block is this thread's alone until it reports.
    unsafe fn bytes(&self) -> &[u8] {
        std::slice::from_raw_parts(self.0, self.1)
    }

    /// # Safety
    /// As for `bytes`.
    unsafe fn bytes_mut(&mut self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.0, self.1)
    }
}

pub struct DiskBackend<D: OffloadDevice> {
    // Field order is drop order: the pool (whose tasks use staging memory) first.
    pool: IoPool,
    store: Arc<DiskStore>,
    pages: SharedPages<D>,
    staging: MemId, // [staging blocks][layers][K | V][block_size, kv_dim], host memory
    staging_base: *mut u8,
    free_staging: Vec<usize>,
    block_bytes: usize,
    done_tx: Sender<IoDone>,
    done_rx: Receiver<IoDone>,
    jobs: HashMap<JobId, Job>,
    /// Jobs with blocks not yet started, in submit order.
    queue: VecDeque<JobId>,
    copying: Vec<Copying>,
}

// SAFETY: `staging_base` points into the pages' host memory (see `HostBlock`); the backend
// moves to the engine thread as a whole.
unsafe impl<D: OffloadDevice + Send> Send for DiskBackend<D> {}

impl<D: OffloadDevice> DiskBackend<D> {
    pub fn new(pages: SharedPages<D>, store: Arc<DiskStore>, io_threads: usize) -> Result<Self> {
        let (staging, staging_base, block_bytes, n) = {
            let mut p = lock(&pages);
            ensure!(
                store.layout().payload_bytes == p.block_bytes(),
                "disk slots hold {} bytes, a block is {}",
                store.layout().payload_bytes,
                p.block_bytes()
            );
            let n = STAGING_PER_THREAD * io_threads.max(1);
            let elems = n * p.block_elems();
            let (mem, base) = p.alloc_host(elems)?;
            (mem, base, p.block_bytes(), n)
        };
        let (done_tx, done_rx) = channel();
        Ok(Self {
            pool: IoPool::new(io_threads)?,
            store,
            pages,
            staging,
            staging_base,
            free_staging: (0..n).rev().collect(),
            block_bytes,
            done_tx,
            done_rx,
            jobs: HashMap::new(),
            queue: VecDeque::new(),
            copying: Vec::new(),
        })
    }

    /// Staging blocks (host memory of the device), for the plan line.
    pub fn staging_blocks(&self) -> usize {
        self.free_staging.len() + self.busy_staging()
    }

    fn busy_staging(&self) -> usize {
        self.jobs.values().map(|j| j.in_flight).sum()
    }

    /// Checks a job's copies before anything starts. Loads go to device pages only;
    /// stores come from device pages (spills) or host-tier slots (demotions).
    fn plan(job: &TransferJob) -> Result<Vec<Block>> {
        job.copies
            .iter()
            .map(|c| {
                let (mem, disk) = match job.kind {
                    JobKind::Store => (c.src, c.dst),
                    JobKind::Load => (c.dst, c.src),
                };
                match (job.kind, mem, disk) {
                    (_, Loc::Gpu(p), Loc::Disk { slot, key }) => Ok(Block {
                        mem: Place::Gpu(p),
                        slot,
                        key,
                    }),
                    (JobKind::Store, Loc::Host(Tier::Cpu, h), Loc::Disk { slot, key }) => {
                        Ok(Block {
                            mem: Place::Host(h),
                            slot,
                            key,
                        })
                    }
                    _ => bail!("disk job {} has a bad copy {c:?}", job.id),
                }
            })
            .collect()
    }

    fn host_block(&self, staging: usize) -> HostBlock {
        HostBlock(
            self.staging_base.wrapping_add(staging * self.block_bytes),
            self.block_bytes,
        )
    }

    fn place(&self, staging: usize) -> Place {
        Place::Staging {
            mem: self.staging,
            index: staging,
        }
    }

    /// Starts blocks of queued jobs while staging blocks are free.
    fn start_blocks(&mut self) -> Result<()> {
        while let (Some(&id), false) = (self.queue.front(), self.free_staging.is_empty()) {
            let job = self.jobs.get_mut(&id).expect("queued job");
            if job.started == job.blocks.len() || !job.ok {
                self.queue.pop_front(); // nothing left to start (a failed job starts no more)
                continue;
            }
            let (i, b, kind) = (job.started, job.blocks[job.started], job.kind);
            job.started += 1;
            job.in_flight += 1;
            let staging = self.free_staging.pop().expect("checked");
            match kind {
                JobKind::Store => {
                    let blocks = [(b.mem, self.place(staging))];
                    let ev = lock(&self.pages).copy_blocks(
                        StreamRole::Staging,
                        "disk_stage_out",
                        &blocks,
                    )?;
                    self.copying.push(Copying {
                        job: id,
                        block: i,
                        staging,
                        ev,
                        out: true,
                    });
                }
                JobKind::Load => {
                    lock(&self.pages).host_access(
                        "disk_read",
                        Access::Write,
                        (self.staging, staging),
                    )?;
                    let (mut dst, store, tx) = (
                        self.host_block(staging),
                        Arc::clone(&self.store),
                        self.done_tx.clone(),
                    );
                    self.pool.spawn(move || {
                        let ok = store.slot_buffer().is_ok_and(|mut buf| {
                            if store.read_slot(b.slot, b.key, &mut buf).is_err() {
                                return false;
                            }
                            // SAFETY: the staging block is this task's until it reports.
                            unsafe { dst.bytes_mut() }.copy_from_slice(store.payload(&buf));
                            true
                        });
                        let _ = tx.send(IoDone {
                            job: id,
                            block: i,
                            staging,
                            ok,
                        });
                    });
                }
            }
        }
        Ok(())
    }

    /// A block's staging copy or IO finished: `ok` false fails its job.
    fn block_done(&mut self, job: JobId, staging: usize, ok: bool) {
        self.free_staging.push(staging);
        let j = self.jobs.get_mut(&job).expect("job in flight");
        j.in_flight -= 1;
        j.ok &= ok;
    }

    /// An IO thread reported a block.
    fn io_done(&mut self, d: IoDone) -> Result<()> {
        let kind = self.jobs[&d.job].kind;
        match (kind, d.ok && self.jobs[&d.job].ok) {
            (JobKind::Load, true) => {
                // The slot's bytes are in staging: copy them to the page.
                let page = self.jobs[&d.job].blocks[d.block].mem;
                let blocks = [(self.place(d.staging), page)];
                let ev =
                    lock(&self.pages).copy_blocks(StreamRole::Staging, "disk_stage_in", &blocks)?;
                self.copying.push(Copying {
                    job: d.job,
                    block: d.block,
                    staging: d.staging,
                    ev,
                    out: false,
                });
            }
            _ => self.block_done(d.job, d.staging, d.ok),
        }
        Ok(())
    }

    /// Staging copies whose event completed: a store's block goes to an IO thread, a
    /// load's block is done.
    fn copies_done(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.copying.len() {
            if !lock(&self.pages).finished(self.copying[i].ev)? {
                i += 1;
                continue;
            }
            let c = self.copying.swap_remove(i);
            if !c.out {
                self.block_done(c.job, c.staging, true);
                continue;
            }
            lock(&self.pages).host_access("disk_write", Access::Read, (self.staging, c.staging))?;
            let b = self.jobs[&c.job].blocks[c.block];
            let (src, store, tx) = (
                self.host_block(c.staging),
                Arc::clone(&self.store),
                self.done_tx.clone(),
            );
            let (job, block, staging) = (c.job, c.block, c.staging);
            self.pool.spawn(move || {
                let ok = store.slot_buffer().is_ok_and(|mut buf| {
                    // SAFETY: the staging block is this task's until it reports.
                    store
                        .payload_mut(&mut buf)
                        .copy_from_slice(unsafe { src.bytes() });
                    store.write_slot(b.slot, b.key, &mut buf).is_ok()
                });
                let _ = tx.send(IoDone {
                    job,
                    block,
                    staging,
                    ok,
                });
            });
        }
        Ok(())
    }

    /// Moves everything along without blocking; returns the jobs that finished.
    fn progress(&mut self) -> Result<Vec<Completion>> {
        while let Ok(d) = self.done_rx.try_recv() {
            self.io_done(d)?;
        }
        self.copies_done()?;
        self.start_blocks()?;
        let finished: Vec<JobId> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.in_flight == 0 && (j.started == j.blocks.len() || !j.ok))
            .map(|(&id, _)| id)
            .collect();
        Ok(finished
            .into_iter()
            .map(|id| {
                let j = self.jobs.remove(&id).expect("listed");
                self.queue.retain(|&q| q != id);
                Completion { job: id, ok: j.ok }
            })
            .collect())
    }
}

impl<D: OffloadDevice + Send> TransferBackend for DiskBackend<D> {
    fn submit(&mut self, job: TransferJob) -> Result<()> {
        let blocks = Self::plan(&job)?;
        self.jobs.insert(
            job.id,
            Job {
                kind: job.kind,
                blocks,
                started: 0,
                in_flight: 0,
                ok: true,
            },
        );
        self.queue.push_back(job.id);
        self.start_blocks()
    }

    fn poll(&mut self) -> Result<Vec<Completion>> {
        self.progress()
    }

    fn wait(&mut self) -> Result<Vec<Completion>> {
        loop {
            let out = self.progress()?;
            if !out.is_empty() || self.jobs.is_empty() {
                return Ok(out);
            }
            if !self.copying.is_empty() {
                lock(&self.pages).sync_all()?; // the copies are the next step
                continue;
            }
            match self.done_rx.recv_timeout(Duration::from_millis(50)) {
                Ok(d) => self.io_done(d)?,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => bail!("disk IO threads are gone"),
            }
        }
    }

    fn in_flight(&self) -> usize {
        self.jobs.len()
    }
}

/// Routes each job to the host tier's backend or the disk backend, and merges their
/// completions.
pub struct TieredBackend {
    pub host: Box<dyn TransferBackend>,
    pub disk: Box<dyn TransferBackend>,
}

impl TransferBackend for TieredBackend {
    fn submit(&mut self, job: TransferJob) -> Result<()> {
        if job.touches_disk() {
            self.disk.submit(job)
        } else {
            self.host.submit(job)
        }
    }

    fn poll(&mut self) -> Result<Vec<Completion>> {
        let mut out = self.host.poll()?;
        out.extend(self.disk.poll()?);
        Ok(out)
    }

    fn wait(&mut self) -> Result<Vec<Completion>> {
        loop {
            let out = self.poll()?;
            if !out.is_empty() || self.in_flight() == 0 {
                return Ok(out);
            }
            match (self.host.in_flight() > 0, self.disk.in_flight() > 0) {
                (true, false) => return self.host.wait(),
                (false, true) => return self.disk.wait(),
                _ => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }

    fn in_flight(&self) -> usize {
        self.host.in_flight() + self.disk.in_flight()
    }
}
