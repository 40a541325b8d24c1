//! The worker side: owns the paged KV memory, runs forward calls over resident pages, and
//! executes transfer jobs on a dedicated transfer stream (an event per job).

use std::sync::Arc;

use anyhow::{bail, ensure, Result};

use super::residency::Tier;
use super::scheduler::ScheduledSeq;
use super::transfer::{Completion, JobId, Loc, TransferBackend, TransferJob};
use crate::device::cpu::stream::{Buffer, CpuDevice, Event, MemSpace, Stream};
use crate::device::DevPtr;
use crate::kv::{KvCache, LayerSlot};
use crate::model::{BatchSeq, Model, PagePool, WantLogits};

/// The KV memory of both tiers, per layer, for K and for V.
pub struct PagedKvCache {
    pub num_layers: usize,
    pub block_size: usize,
    pub row: usize,     // kv_heads * head_dim
    gpu_k: Vec<Buffer>, // [num_layers] × [num_gpu_blocks, block_size, kv_heads, head_dim], device
    gpu_v: Vec<Buffer>,
    host_k: Vec<Buffer>, // [num_layers] × [num_cpu_blocks, block_size, kv_heads, head_dim], host
    host_v: Vec<Buffer>,
}

impl PagedKvCache {
    pub fn new(
        model: &Model,
        block_size: usize,
        num_gpu_blocks: usize,
        num_cpu_blocks: usize,
    ) -> Result<Self> {
        let c = &model.cfg;
        let row = c.num_kv_heads * c.head_dim;
        let page = block_size * row;
        let alloc = |n: usize, space| -> Result<Vec<Buffer>> {
            (0..c.num_layers)
                .map(|_| Buffer::alloc(n * page, space))
                .collect()
        };
        Ok(Self {
            num_layers: c.num_layers,
            block_size,
            row,
            gpu_k: alloc(num_gpu_blocks, MemSpace::Device)?,
            gpu_v: alloc(num_gpu_blocks, MemSpace::Device)?,
            host_k: alloc(num_cpu_blocks, MemSpace::Host)?,
            host_v: alloc(num_cpu_blocks, MemSpace::Host)?,
        })
    }

    /// f32s in one block's page of one layer, K or V: `[block_size, kv_heads, head_dim]`.
    pub fn page_len(&self) -> usize {
        self.block_size * self.row
    }

    /// The device page pools of `layer`, K then V, each
    /// `[num_gpu_blocks, block_size, kv_heads, head_dim]` (for the disk tier's staging copies).
    pub(crate) fn gpu_pages(&self, layer: usize) -> [&Buffer; 2] {
        [&self.gpu_k[layer], &self.gpu_v[layer]]
    }

    /// The host tier's slot pools of `layer`, K then V, each
    /// `[num_cpu_blocks, block_size, kv_heads, head_dim]` (for the disk tier's demotions).
    pub(crate) fn host_slots(&self, layer: usize) -> [&Buffer; 2] {
        [&self.host_k[layer], &self.host_v[layer]]
    }

    /// Bytes of KV memory per block across all layers (K and V).
    pub fn block_bytes(&self) -> usize {
        2 * self.num_layers * self.page_len() * 4
    }
}

/// The device tier's page pools as the model's batched forward sees them, through the KV
/// seam: layer `l`'s slot is its whole pool `[num_gpu_blocks, block_size, row]`.
struct GpuPages<'a>(&'a PagedKvCache);

// SAFETY: the forward writes and reads only rows of the pages in its block tables, which
// belong to GPU-resident blocks of the scheduled sequences: no transfer reads or writes
// them (loads into them completed before the blocks turned resident; stores only read
// blocks of preempted sequences), and this thread is the only compute. Transfers touch
// other pages of the same buffers concurrently, as a device's copy engine would; the
// model reaches the pool a row at a time (`kv::LayerKv`), never as one slice.
unsafe impl KvCache<f32> for GpuPages<'_> {
    fn reset(&mut self) -> Result<()> {
        Ok(())
    }

    fn capacity(&self) -> usize {
        self.num_pages() * self.0.block_size
    }

    fn begin_step(&mut self, _pos0: usize, _tokens: usize) -> Result<()> {
        Ok(())
    }

    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot<f32>> {
        let ptr = |b: &Buffer| DevPtr::from_addr(b.as_ptr() as u64);
        Ok(LayerSlot {
            k: ptr(&self.0.gpu_k[layer]),
            v: ptr(&self.0.gpu_v[layer]),
            rows: self.capacity(),
        })
    }

    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }
}

impl PagePool for GpuPages<'_> {
    fn block_size(&self) -> usize {
        self.0.block_size
    }

    fn num_pages(&self) -> usize {
        self.0
            .gpu_k
            .first()
            .map_or(0, |b| b.len() / self.0.page_len())
    }
}

/// One batched forward per engine step over every scheduled sequence's pages, on some
/// device. The kernels are batch-invariant, so each sequence's logits do not depend on the
/// batch.
pub trait BatchRunner: Send {
    /// One forward over all `calls`; the logits `[vocab]` of each call's last token, for
    /// the calls that sample (`None` for replayed calls of a recomputation).
    fn forward(&mut self, calls: &[ScheduledSeq]) -> Result<Vec<Option<Vec<f32>>>>;
}

/// The scheduled calls as the models' batched forward takes them.
pub fn batch_seqs(calls: &[ScheduledSeq]) -> Vec<BatchSeq<'_>> {
    calls
        .iter()
        .map(|c| BatchSeq {
            tokens: &c.tokens,
            pos0: c.pos0,
            pages: &c.block_table,
            logits: if c.sample {
                WantLogits::Yes
            } else {
                WantLogits::No
            },
        })
        .collect()
}

/// The CPU model over the CPU device's page pools.
pub struct ModelRunner {
    model: Arc<Model>,
    cache: Arc<PagedKvCache>,
}

impl ModelRunner {
    pub fn new(model: Arc<Model>, cache: Arc<PagedKvCache>) -> Self {
        Self { model, cache }
    }
}

impl BatchRunner for ModelRunner {
    fn forward(&mut self, calls: &[ScheduledSeq]) -> Result<Vec<Option<Vec<f32>>>> {
        self.model
            .forward_batch(&batch_seqs(calls), &mut GpuPages(&self.cache))
    }
}

/// The CPU-tier backend: every job's copies go on one transfer stream, followed by the
/// job's event; a job is complete when its event is.
pub struct CpuTransferBackend {
    cache: Arc<PagedKvCache>,
    stream: Stream,
    pending: Vec<(JobId, Event)>,
}

impl CpuTransferBackend {
    pub fn new(dev: &Arc<CpuDevice>, cache: Arc<PagedKvCache>) -> Self {
        Self {
            cache,
            stream: Stream::new(dev, "transfer"),
            pending: Vec::new(),
        }
    }

    fn locate(&self, loc: Loc, layer: usize, v: bool) -> Result<(&Buffer, usize)> {
        let c = &self.cache;
        let (buf, idx) = match loc {
            Loc::Gpu(p) => (if v { &c.gpu_v } else { &c.gpu_k }, p),
            Loc::Host(Tier::Cpu, s) => (if v { &c.host_v } else { &c.host_k }, s),
            Loc::Host(Tier::Ssd, _) | Loc::Disk { .. } => {
                bail!("{loc:?} is the disk backend's (serve::disk), not the host tier's")
            }
        };
        let buf = &buf[layer];
        let at = idx as usize * c.page_len();
        ensure!(at + c.page_len() <= buf.len(), "{loc:?} is out of range");
        Ok((buf, at))
    }
}

impl TransferBackend for CpuTransferBackend {
    fn submit(&mut self, job: TransferJob) -> Result<()> {
        // Validate every copy before enqueuing any, so a bad job moves nothing.
        let mut copies = Vec::new();
        for c in &job.copies {
            for layer in 0..self.cache.num_layers {
                for v in [false, true] {
                    let (src, so) = self.locate(c.src, layer, v)?;
                    let (dst, d) = self.locate(c.dst, layer, v)?;
                    copies.push((layer, src.clone(), so, dst.clone(), d));
                }
            }
        }
        let name = match job.kind {
            super::transfer::JobKind::Store => "kv_store",
            super::transfer::JobKind::Load => "kv_load",
        };
        for (layer, src, so, dst, d) in copies {
            self.stream
                .copy(name, Some(layer), &src, so, &dst, d, self.cache.page_len());
        }
        let ev = Event::new();
        self.stream.record(&ev);
        self.pending.push((job.id, ev));
        Ok(())
    }

    fn poll(&mut self) -> Result<Vec<Completion>> {
        let mut done = Vec::new();
        self.pending.retain(|(job, ev)| {
            let finished = ev.query();
            if finished {
                done.push(Completion {
                    job: *job,
                    ok: true,
                });
            }
            !finished
        });
        Ok(done)
    }

    fn wait(&mut self) -> Result<Vec<Completion>> {
        if let Some((_, ev)) = self.pending.first() {
            ev.synchronize(); // in-order stream: the oldest job finishes first
        }
        self.poll()
    }

    fn in_flight(&self) -> usize {
        self.pending.len()
    }
}
