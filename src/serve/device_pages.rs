//! The serving path on an `OffloadDevice` with the CUDA model: the GPU (`CudaOffloadDevice`
//! beside a `CudaExec` on the same compute stream), or, in tests, the CPU device in bf16
//! beside the kernel emulator. Both tiers' KV pages are the device's allocations; a transfer
//! job is a copy per layer, K and V, on a copy stream followed by an event, polled without
//! blocking; the forward is `CudaModel::forward_batch` over the device pages.
//!
//! ```text
//! Engine ─▶ DeviceRunner ─▶ CudaModel::forward_batch ─▶ PagePool<bf16> = DevicePages (device tier)
//!        ─▶ DeviceTransfers ─▶ OffloadDevice::copy on Offload(0) (store) / Prefetch (load)
//! ```
//!
//! Ordering (proven by the stream-ordering checker, `crate::device::order`): a store reads
//! pages of a preempted sequence, which earlier steps' compute wrote, and a load writes
//! pages that a step still in flight may have used before they were freed: either job's
//! copy stream waits for an event recorded on the compute stream first. The scheduler
//! makes loaded pages resident, and frees a store's pages, only once the job's event has
//! completed (the host saw it), so compute queued afterwards is ordered after the copies.

use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{bail, Result};
use half::bf16;

use super::engine::{Engine, EngineConfig};
use super::residency::Tier;
use super::runner::{batch_seqs, BatchRunner};
use super::scheduler::ScheduledSeq;
use super::transfer::{Completion, JobId, JobKind, Loc, TransferBackend, TransferJob};
use crate::device::cuda::exec::{CudaExec, Exec};
use crate::device::cuda::model::CudaModel;
use crate::device::cuda::offload_dev::CudaOffloadDevice;
use crate::device::cuda::weights::CudaWeights;
use crate::device::order::Access;
use crate::kv::{KvCache, LayerSlot};
use crate::model::{BatchSeq, Model, PagePool};
use crate::offload::checked::Checked;
use crate::offload::device::{EventId, MemId, OffloadDevice, Space, Span, StreamRole};

/// K and V memory of one layer in one tier: `[blocks, block_size, kv_dim]` each.
#[derive(Clone, Copy)]
struct Pair {
    k: MemId,
    v: MemId,
}

/// Both tiers' KV pages on `D`, with the transfer jobs in flight.
pub struct DevicePages<D: OffloadDevice<Elem = bf16>> {
    d: Checked<D>,
    block_size: usize,
    page: usize,     // elements of one block of one layer, K or V: block_size · kv_dim
    gpu: Vec<Pair>,  // [num_layers], device
    host: Vec<Pair>, // [num_layers], host (pinned on CUDA)
    num_gpu_blocks: usize,
    pending: Vec<(JobId, EventId)>, // submit order
    free_events: Vec<EventId>,
    compute_done: EventId, // recorded on the compute stream before each store
}

impl<D: OffloadDevice<Elem = bf16>> DevicePages<D> {
    /// `check_order`: under the stream-ordering checker (`crate::device::order`).
    pub fn new(
        d: D,
        num_layers: usize,
        kv_dim: usize,
        (block_size, num_gpu_blocks, num_cpu_blocks): (usize, usize, usize),
        check_order: bool,
    ) -> Result<Self> {
        let mut d = Checked::new(d, check_order);
        let page = block_size * kv_dim;
        let mut tier = |space, blocks: usize| -> Result<Vec<Pair>> {
            (0..num_layers)
                .map(|_| {
                    Ok(Pair {
                        k: d.alloc(space, blocks * page)?,
                        v: d.alloc(space, blocks * page)?,
                    })
                })
                .collect()
        };
        let gpu = tier(Space::Device, num_gpu_blocks)?;
        let host = tier(Space::Host, num_cpu_blocks)?;
        let compute_done = d.new_event()?;
        Ok(Self {
            d,
            block_size,
            page,
            gpu,
            host,
            num_gpu_blocks,
            pending: Vec::new(),
            free_events: Vec::new(),
            compute_done,
        })
    }

    /// Where one block of `layer` is, K or V.
    fn span(&self, loc: Loc, layer: usize, v: bool) -> Result<Span> {
        let (pair, idx) = match loc {
            Loc::Gpu(p) => (self.gpu[layer], p as usize),
            Loc::Host(Tier::Cpu, s) => (self.host[layer], s as usize),
            Loc::Host(Tier::Ssd, _) | Loc::Disk { .. } => {
                bail!("{loc:?}: the disk tier is not available on this device's serving path")
            }
        };
        Ok(Span {
            mem: if v { pair.v } else { pair.k },
            off: idx * self.page,
            len: self.page,
        })
    }

    /// Declares one forward over `seqs` on the compute stream: each reads the pages of its
    /// blocks before the one holding `pos0` and writes that block and the later ones, in
    /// every layer, K and V (what the batched forward's kernels touch).
    fn declare_forward(&mut self, seqs: &[BatchSeq]) -> Result<()> {
        if !self.d.is_checked() {
            return Ok(());
        }
        for seq in seqs {
            let first_written = seq.pos0 / self.block_size;
            for (i, &page) in seq.pages.iter().enumerate() {
                let access = if i < first_written {
                    Access::Read
                } else {
                    Access::Write
                };
                for layer in 0..self.gpu.len() {
                    let acc = [false, true]
                        .map(|v| self.span(Loc::Gpu(page), layer, v).map(|sp| (access, sp)));
                    let [k, v] = acc;
                    let acc = [k?, v?];
                    self.d
                        .declare(StreamRole::Compute, "forward", layer, &acc)?;
                }
            }
        }
        Ok(())
    }

    fn submit(&mut self, job: &TransferJob) -> Result<()> {
        // Validate every copy before queuing any, so a bad job moves nothing.
        let mut copies = Vec::new();
        for c in &job.copies {
            for layer in 0..self.gpu.len() {
                for v in [false, true] {
                    copies.push((
                        layer,
                        self.span(c.src, layer, v)?,
                        self.span(c.dst, layer, v)?,
                    ));
                }
            }
        }
        let (stream, name) = match job.kind {
            JobKind::Store => (StreamRole::Offload(0), "kv_store"),
            JobKind::Load => (StreamRole::Prefetch, "kv_load"),
        };
        // A store reads pages that earlier steps wrote; a load writes pages that a step
        // still running may be using (freed by a sequence that finished or was preempted
        // for recomputation, and a step that samples nothing never makes the host wait
        // for it): both wait for the compute queued so far.
        self.d.record(StreamRole::Compute, self.compute_done)?;
        self.d.wait(stream, self.compute_done, "pages-computed")?;
        for (layer, src, dst) in copies {
            self.d.copy(stream, name, layer, src, dst)?;
        }
        let ev = match self.free_events.pop() {
            Some(e) => e,
            None => self.d.new_event()?,
        };
        self.d.record(stream, ev)?;
        self.pending.push((job.id, ev));
        Ok(())
    }

    fn poll(&mut self) -> Result<Vec<Completion>> {
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            let (job, ev) = self.pending[i];
            if self.d.query(ev)? {
                self.pending.remove(i);
                self.free_events.push(ev);
                done.push(Completion { job, ok: true });
            } else {
                i += 1;
            }
        }
        Ok(done)
    }
}

// SAFETY: the forward writes and reads only rows of pages in its block tables, which belong
// to device-resident blocks of the scheduled sequences: loads into them completed (their
// events observed) before the blocks turned resident, and stores read only blocks of
// preempted sequences, after an event recorded on the compute stream.
unsafe impl<D: OffloadDevice<Elem = bf16>> KvCache<bf16> for DevicePages<D> {
    fn reset(&mut self) -> Result<()> {
        Ok(())
    }

    fn capacity(&self) -> usize {
        self.num_gpu_blocks * self.block_size
    }

    fn begin_step(&mut self, _pos0: usize, _tokens: usize) -> Result<()> {
        Ok(())
    }

    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot<bf16>> {
        let p = self.gpu[layer];
        Ok(LayerSlot {
            k: self.d.ptr(p.k),
            v: self.d.ptr(p.v),
            rows: self.capacity(),
        })
    }

    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }
}

impl<D: OffloadDevice<Elem = bf16>> PagePool<bf16> for DevicePages<D> {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_pages(&self) -> usize {
        self.num_gpu_blocks
    }
}

type Shared<D> = Arc<Mutex<DevicePages<D>>>;

fn lock<D: OffloadDevice<Elem = bf16>>(p: &Shared<D>) -> MutexGuard<'_, DevicePages<D>> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// The CUDA model's batched forward over the device tier's pages.
pub struct DeviceRunner<D: OffloadDevice<Elem = bf16>> {
    model: CudaModel,
    pages: Shared<D>,
}

impl<D: OffloadDevice<Elem = bf16> + Send> BatchRunner for DeviceRunner<D> {
    fn forward(&mut self, calls: &[ScheduledSeq]) -> Result<Vec<Option<Vec<f32>>>> {
        let mut pages = lock(&self.pages);
        let seqs = batch_seqs(calls);
        pages.declare_forward(&seqs)?;
        self.model.forward_batch(&seqs, &mut *pages)
    }
}

/// Transfer jobs as copies on the device's copy streams.
pub struct DeviceTransfers<D: OffloadDevice<Elem = bf16>> {
    pages: Shared<D>,
}

impl<D: OffloadDevice<Elem = bf16> + Send> TransferBackend for DeviceTransfers<D> {
    fn submit(&mut self, job: TransferJob) -> Result<()> {
        lock(&self.pages).submit(&job) // refuses disk locations before queuing anything
    }

    fn poll(&mut self) -> Result<Vec<Completion>> {
        lock(&self.pages).poll()
    }

    fn wait(&mut self) -> Result<Vec<Completion>> {
        let mut p = lock(&self.pages);
        if p.pending.is_empty() {
            return Ok(Vec::new());
        }
        p.d.sync_all()?;
        p.poll()
    }

    fn in_flight(&self) -> usize {
        lock(&self.pages).pending.len()
    }
}

/// The runner and the transfer backend of one device, sharing its pages.
pub fn device_parts<D: OffloadDevice<Elem = bf16> + Send + 'static>(
    model: CudaModel,
    pages: DevicePages<D>,
) -> (Box<dyn BatchRunner>, Box<dyn TransferBackend>) {
    let pages = Arc::new(Mutex::new(pages));
    let runner = DeviceRunner {
        model,
        pages: Arc::clone(&pages),
    };
    (Box::new(runner), Box::new(DeviceTransfers { pages }))
}

/// A serving engine with the CUDA model on `exec` and the KV pages on `d` (which must
/// share `exec`'s compute stream): the GPU (`gpu_engine`), or the kernel emulator in tests
/// (`crate::gpucheck::emu::emulator_serve_engine`).
pub fn cuda_engine<D: OffloadDevice<Elem = bf16> + Send + 'static>(
    model: &Model,
    cfg: &EngineConfig,
    exec: Arc<dyn Exec>,
    d: D,
) -> Result<Engine> {
    let (c, s) = (&model.cfg, &cfg.sched);
    s.validate()?;
    // No sequence outgrows the device tier, which bounds the RoPE tables and scratch.
    let max_pos = c
        .max_position_embeddings
        .min(s.num_gpu_blocks * s.block_size);
    let w = CudaWeights::from_model(&*exec, model)?;
    let gpu = CudaModel::new(exec, c.clone(), w, max_pos)?;
    let sizes = (s.block_size, s.num_gpu_blocks, s.max_cpu_offload_blocks);
    let check = cfg.check_order || cfg.sanitize;
    let pages = DevicePages::new(d, c.num_layers, c.kv_dim(), sizes, check)?;
    let (runner, backend) = device_parts(gpu, pages);
    Engine::on_device(c.clone(), cfg, runner, backend)
}

/// The serving engine on GPU 0: the model's compute stream shared by the KV pages'
/// device, whose copy streams carry the transfer jobs.
pub fn gpu_engine(model: &Model, cfg: &EngineConfig) -> Result<Engine> {
    if cfg.link_gbps > 0.0 || cfg.sanitize {
        bail!("--sim-link-gbps and --sanitize apply to the CPU device only");
    }
    crate::device::check_available(crate::device::DeviceKind::Cuda)?;
    let dev = Arc::new(crate::device::cuda::context::CudaDevice::new(0)?);
    let compute = dev.new_stream()?;
    let exec: Arc<dyn Exec> = Arc::new(CudaExec::new(dev.clone(), compute.clone())?);
    let d = CudaOffloadDevice::new(dev, compute, 1)?;
    cuda_engine(model, cfg, exec, d)
}
