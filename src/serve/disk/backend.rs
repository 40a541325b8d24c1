//! The disk tier's transfer backend, and the tiered backend that routes each job to the
//! host tier's backend or this one.
//!
//! A store job: device pages (or, for a demotion, host-tier slots) → host staging (device copies on a staging stream, then an
//! event) → IO threads wait for the event, checksum each block and write its slot. A load
//! job: IO threads read and verify each slot into host staging; once all passed, the
//! engine thread enqueues staging → device page copies and the job completes with their
//! event. The engine thread only submits and polls: it never waits on disk IO. A job is
//! all or nothing: one failed block (IO error, integrity check) fails the whole job, and
//! the scheduler's rollback (store: blocks stay on the GPU; load: recompute) applies.
//!
//! Staging block layout (f32): `[blocks][layers][K | V][block_size, kv_heads, head_dim]`,
//! which is also a slot's payload, byte for byte.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Result};

use super::pool::IoPool;
use super::store::DiskStore;
use crate::device::cpu::stream::{Buffer, CpuDevice, Event, MemSpace, Stream};
use crate::serve::residency::Tier;
use crate::serve::runner::PagedKvCache;
use crate::serve::transfer::{
    BlockCopy, Completion, JobId, JobKind, Loc, TransferBackend, TransferJob,
};

/// A finished IO phase of a job (all its blocks' reads or writes).
struct IoDone {
    job: JobId,
    ok: bool,
}

/// Counts a job's block IOs down; the last one reports the job.
struct Countdown {
    job: JobId,
    left: AtomicUsize,
    ok: AtomicBool,
    tx: Sender<IoDone>,
}

impl Countdown {
    fn finish(&self, ok: bool) {
        if !ok {
            self.ok.store(false, Ordering::SeqCst);
        }
        if self.left.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _ = self.tx.send(IoDone {
                job: self.job,
                ok: self.ok.load(Ordering::SeqCst),
            });
        }
    }
}

/// The memory end of a block's disk copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mem {
    /// A device page (a spill, or a load).
    Page(u32),
    /// A host-tier slot (a demotion).
    HostSlot(u32),
}

/// A load whose reads are in flight: its staging buffer and where each block goes.
struct Reading {
    staging: Buffer,
    pages: Vec<Mem>,
}

pub struct DiskBackend {
    // Field order is drop order: the pool (whose tasks wait on staging events) before the
    // stream that completes them.
    pool: IoPool,
    stream: Stream,
    store: Arc<DiskStore>,
    cache: Arc<PagedKvCache>,
    done_tx: Sender<IoDone>,
    done_rx: Receiver<IoDone>,
    reading: HashMap<JobId, Reading>,
    /// Store jobs with IO in flight.
    writing: HashMap<JobId, Buffer>,
    /// Loads whose reads passed, copying staging → pages; done with the event.
    copying: Vec<(JobId, Event, Buffer)>,
}

impl DiskBackend {
    pub fn new(
        dev: &Arc<CpuDevice>,
        cache: Arc<PagedKvCache>,
        store: Arc<DiskStore>,
        io_threads: usize,
    ) -> Result<Self> {
        let f32s = 2 * cache.num_layers * cache.page_len();
        ensure!(
            store.layout().payload_bytes == f32s * 4,
            "disk slots hold {} bytes, a block is {}",
            store.layout().payload_bytes,
            f32s * 4
        );
        let (done_tx, done_rx) = channel();
        Ok(Self {
            pool: IoPool::new(io_threads)?,
            stream: Stream::new(dev, "disk-staging"),
            store,
            cache,
            done_tx,
            done_rx,
            reading: HashMap::new(),
            writing: HashMap::new(),
            copying: Vec::new(),
        })
    }

    /// f32s of one block across layers, K and V.
    fn block_f32s(&self) -> usize {
        2 * self.cache.num_layers * self.cache.page_len()
    }

    /// Checks a job's copies before anything starts: (memory end, disk slot, key) per
    /// block. Loads go to device pages only; stores come from pages or host-tier slots.
    fn plan(&self, job: &TransferJob) -> Result<Vec<(Mem, u32, u64)>> {
        let pages = self.cache.gpu_pages(0)[0].len() / self.cache.page_len();
        let host_slots = self.cache.host_slots(0)[0].len() / self.cache.page_len();
        let slots = self.store.layout().num_slots;
        job.copies
            .iter()
            .map(|c: &BlockCopy| {
                let (page, disk) = match job.kind {
                    JobKind::Store => (c.src, c.dst),
                    JobKind::Load => (c.dst, c.src),
                };
                match (page, disk) {
                    (Loc::Gpu(p), Loc::Disk { slot, key })
                        if (p as usize) < pages && (slot as usize) < slots =>
                    {
                        Ok((Mem::Page(p), slot, key))
                    }
                    (Loc::Host(Tier::Cpu, h), Loc::Disk { slot, key })
                        if job.kind == JobKind::Store
                            && (h as usize) < host_slots
                            && (slot as usize) < slots =>
                    {
                        Ok((Mem::HostSlot(h), slot, key))
                    }
                    _ => bail!("disk job {} has a bad copy {c:?}", job.id),
                }
            })
            .collect()
    }

    /// Enqueues copies between block `i` of `staging` and `mem`, all layers.
    fn stage(&self, staging: &Buffer, i: usize, mem: Mem, to_device: bool) {
        let n = self.cache.page_len();
        for layer in 0..self.cache.num_layers {
            let (pools, index) = match mem {
                Mem::Page(p) => (self.cache.gpu_pages(layer), p),
                Mem::HostSlot(s) => (self.cache.host_slots(layer), s),
            };
            for (side, pages) in pools.into_iter().enumerate() {
                let at = i * self.block_f32s() + (2 * layer + side) * n;
                let dev_at = index as usize * n;
                if to_device {
                    self.stream
                        .copy("disk_stage_in", Some(layer), staging, at, pages, dev_at, n);
                } else {
                    self.stream
                        .copy("disk_stage_out", Some(layer), pages, dev_at, staging, at, n);
                }
            }
        }
    }

    fn countdown(&self, job: JobId, n: usize) -> Arc<Countdown> {
        Arc::new(Countdown {
            job,
            left: AtomicUsize::new(n),
            ok: AtomicBool::new(true),
            tx: self.done_tx.clone(),
        })
    }

    fn handle(&mut self, d: IoDone, out: &mut Vec<Completion>) {
        if self.writing.remove(&d.job).is_some() {
            out.push(Completion {
                job: d.job,
                ok: d.ok,
            });
            return;
        }
        let Some(r) = self.reading.remove(&d.job) else {
            return;
        };
        if !d.ok {
            out.push(Completion {
                job: d.job,
                ok: false,
            });
            return;
        }
        for (i, &page) in r.pages.iter().enumerate() {
            self.stage(&r.staging, i, page, true);
        }
        let ev = Event::new();
        self.stream.record(&ev);
        self.copying.push((d.job, ev, r.staging));
    }
}

impl TransferBackend for DiskBackend {
    fn submit(&mut self, job: TransferJob) -> Result<()> {
        let plan = self.plan(&job)?;
        let bf = self.block_f32s();
        let staging = Buffer::alloc(plan.len().max(1) * bf, MemSpace::Host)?;
        let count = self.countdown(job.id, plan.len());
        if plan.is_empty() {
            count.left.store(1, Ordering::SeqCst);
            count.finish(true);
        }
        match job.kind {
            JobKind::Store => {
                for (i, &(mem, _, _)) in plan.iter().enumerate() {
                    self.stage(&staging, i, mem, false);
                }
                let ev = Event::new();
                self.stream.record(&ev);
                for (i, (_, slot, key)) in plan.into_iter().enumerate() {
                    let (ev, staging, store, count) = (
                        ev.clone(),
                        staging.clone(),
                        Arc::clone(&self.store),
                        Arc::clone(&count),
                    );
                    self.pool.spawn(move || {
                        ev.synchronize(); // the device → staging copies are done
                        let ok = store.slot_buffer().is_ok_and(|mut buf| {
                            // SAFETY: ordered after the staging copies (event); block i of
                            // the staging buffer is only read from here on.
                            let src = unsafe { staging.range(i * bf, bf) };
                            as_bytes_into(src, store.payload_mut(&mut buf));
                            store.write_slot(slot, key, &mut buf).is_ok()
                        });
                        count.finish(ok);
                    });
                }
                self.writing.insert(job.id, staging);
            }
            JobKind::Load => {
                let pages = plan.iter().map(|&(p, _, _)| p).collect();
                for (i, (_, slot, key)) in plan.into_iter().enumerate() {
                    let (staging, store, count) =
                        (staging.clone(), Arc::clone(&self.store), Arc::clone(&count));
                    self.pool.spawn(move || {
                        let ok = store.slot_buffer().is_ok_and(|mut buf| {
                            if store.read_slot(slot, key, &mut buf).is_err() {
                                return false;
                            }
                            // SAFETY: block i of this job's staging buffer is written only
                            // here; the staging → page copies are enqueued after every read.
                            let dst = unsafe { staging.range_mut(i * bf, bf) };
                            from_bytes_into(store.payload(&buf), dst);
                            true
                        });
                        count.finish(ok);
                    });
                }
                self.reading.insert(job.id, Reading { staging, pages });
            }
        }
        Ok(())
    }

    fn poll(&mut self) -> Result<Vec<Completion>> {
        let mut out = Vec::new();
        while let Ok(d) = self.done_rx.try_recv() {
            self.handle(d, &mut out);
        }
        self.copying.retain(|(job, ev, _)| {
            let done = ev.query();
            if done {
                out.push(Completion {
                    job: *job,
                    ok: true,
                });
            }
            !done
        });
        Ok(out)
    }

    fn wait(&mut self) -> Result<Vec<Completion>> {
        loop {
            let mut out = self.poll()?;
            if !out.is_empty() || self.in_flight() == 0 {
                return Ok(out);
            }
            if let Some((_, ev, _)) = self.copying.first() {
                ev.synchronize();
                continue;
            }
            match self.done_rx.recv_timeout(Duration::from_millis(50)) {
                Ok(d) => self.handle(d, &mut out),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => bail!("disk IO threads are gone"),
            }
            if !out.is_empty() {
                return Ok(out);
            }
        }
    }

    fn in_flight(&self) -> usize {
        self.reading.len() + self.writing.len() + self.copying.len()
    }
}

/// Little-endian f32s into bytes (the slot payload format).
fn as_bytes_into(src: &[f32], dst: &mut [u8]) {
    for (d, s) in dst.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

fn from_bytes_into(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes(s.try_into().expect("4 bytes"));
    }
}

/// Routes each job to the host tier's backend or the disk backend, and merges their
/// completions.
pub struct TieredBackend {
    pub host: Box<dyn TransferBackend>,
    pub disk: DiskBackend,
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
