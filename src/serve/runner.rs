//! The worker side: owns the paged KV memory, runs forward calls over resident pages, and
//! executes transfer jobs on a dedicated transfer stream (an event per job).

use std::sync::Arc;

use anyhow::{bail, ensure, Result};

use super::block_manager::PageId;
use super::residency::Tier;
use super::scheduler::ScheduledSeq;
use super::transfer::{Completion, JobId, Loc, TransferBackend, TransferJob};
use crate::device::cpu::stream::{Buffer, CpuDevice, Event, MemSpace, Stream};
use crate::kv::{KvView, LayerKv, LayerWork, Work};
use crate::model::Model;

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

    /// Bytes of KV memory per block across all layers (K and V).
    pub fn block_bytes(&self) -> usize {
        2 * self.num_layers * self.page_len() * 4
    }
}

/// A single sequence's view of the paged cache for one forward call: each layer gathers
/// the sequence's pages into a contiguous scratch K/V for the attention op, then scatters
/// the new tokens' K/V back into their pages. Runs inline on the caller's thread.
struct SeqKv<'a> {
    cache: &'a PagedKvCache,
    pages: &'a [PageId],
    scratch_k: &'a mut Vec<f32>, // [pos0 + tokens, kv_heads, head_dim]
    scratch_v: &'a mut Vec<f32>,
}

impl SeqKv<'_> {
    /// Copies positions `range` between the pages and the scratch (`to_pages` = scatter).
    fn copy(&mut self, layer: usize, range: std::ops::Range<usize>, to_pages: bool) {
        let (bs, row) = (self.cache.block_size, self.cache.row);
        let pairs = [
            (&self.cache.gpu_k[layer], &mut *self.scratch_k),
            (&self.cache.gpu_v[layer], &mut *self.scratch_v),
        ];
        for (buf, scratch) in pairs {
            let mut p = range.start;
            while p < range.end {
                let end = ((p / bs + 1) * bs).min(range.end);
                let at = self.pages[p / bs] as usize * bs * row + (p % bs) * row;
                let n = (end - p) * row;
                // SAFETY: these pages belong to a GPU-resident block of this sequence:
                // no transfer reads or writes them (loads into them completed before the
                // block turned resident; stores only read blocks of preempted sequences),
                // and this thread is the only compute.
                unsafe {
                    if to_pages {
                        buf.slice_mut()[at..at + n].copy_from_slice(&scratch[p * row..end * row]);
                    } else {
                        scratch[p * row..end * row].copy_from_slice(&buf.slice()[at..at + n]);
                    }
                }
                p = end;
            }
        }
    }
}

impl KvView for SeqKv<'_> {
    fn run(&mut self, _name: &'static str, work: Work) -> Result<()> {
        work();
        Ok(())
    }

    fn begin_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(()) // every page is resident before the call is scheduled
    }

    fn run_layer(
        &mut self,
        layer: usize,
        pos0: usize,
        tokens: usize,
        work: LayerWork,
    ) -> Result<()> {
        let end = pos0 + tokens;
        ensure!(
            end <= self.pages.len() * self.cache.block_size,
            "block table covers {} positions, {end} needed",
            self.pages.len() * self.cache.block_size
        );
        let n = end * self.cache.row;
        self.scratch_k.resize(n, 0.0);
        self.scratch_v.resize(n, 0.0);
        self.copy(layer, 0..pos0, false);
        work(LayerKv {
            k: &mut self.scratch_k[..n],
            v: &mut self.scratch_v[..n],
        });
        self.copy(layer, pos0..end, true);
        Ok(())
    }

    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Runs the model over the paged cache, one forward call per scheduled sequence: each
/// sequence's result is then independent of what else is batched.
pub struct ModelRunner {
    model: Arc<Model>,
    cache: Arc<PagedKvCache>,
    scratch_k: Vec<f32>,
    scratch_v: Vec<f32>,
}

impl ModelRunner {
    pub fn new(model: Arc<Model>, cache: Arc<PagedKvCache>) -> Self {
        Self {
            model,
            cache,
            scratch_k: Vec::new(),
            scratch_v: Vec::new(),
        }
    }

    /// The logits `[vocab]` of the call's last token.
    pub fn forward(&mut self, call: &ScheduledSeq) -> Result<Vec<f32>> {
        let mut kv = SeqKv {
            cache: &self.cache,
            pages: &call.block_table,
            scratch_k: &mut self.scratch_k,
            scratch_v: &mut self.scratch_v,
        };
        self.model.forward(&call.tokens, call.pos0, &mut kv)
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
