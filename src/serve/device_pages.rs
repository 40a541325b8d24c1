//! The serving path's KV memory, on any `OffloadDevice`: both tiers' pages are the device's
//! allocations, every copy between them is a copy on one of its streams ordered by events,
//! and everything runs under the stream-ordering checker (`crate::device::order`). One page
//! pool for every device: the CPU device in f32 beside the CPU model (`strata serve`
//! without a GPU), the GPU in bf16 beside the CUDA model, the CPU device in bf16 beside the
//! kernel emulator (tests). The disk tier (`super::disk::backend`) stages through host
//! memory of the same device.
//!
//! ```text
//! Engine ─▶ DeviceRunner ─▶ forward_batch (CPU or CUDA model) ─▶ DevicePages (device tier)
//!        ─▶ DeviceTransfers ─▶ copies on Offload(0) (store) / Prefetch (load)
//!        ─▶ DiskBackend     ─▶ copies on Staging (pages ↔ host staging) + IO threads
//! ```
//!
//! Ordering (proven by the checker, and by `scripts/mutate-order.py`): a store reads pages
//! of a preempted sequence, which earlier steps' compute wrote, and a load writes pages
//! that a step still in flight may have used before they were freed: either job's copy
//! stream waits for an event recorded on the compute stream first. The scheduler makes
//! loaded pages resident, and frees a store's pages, only once the job's event has
//! completed (the host saw it), so compute queued afterwards is ordered after the copies.

use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{bail, Result};

use super::block_manager::GpuPages;
use super::residency::Tier;
use super::transfer::{Completion, JobId, JobKind, Loc, TransferBackend, TransferJob};
use crate::device::order::Access;
use crate::kv::{KvCache, LayerSlot, RecurrentStates};
use crate::model::{BatchSeq, PagePool};
use crate::offload::checked::Checked;
use crate::offload::device::{EventId, MemId, OffloadDevice, Space, Span, StreamRole};

/// K and V memory of one layer in one tier: `[blocks, block_size, kv_dim]` each.
#[derive(Clone, Copy)]
struct Pair {
    k: MemId,
    v: MemId,
}

/// Where a whole block (every layer, K and V) is, for a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Pages of the device tier (a window page for the sliding-window layers when there
    /// is a window pool; without one, those layers are not copied).
    Gpu(GpuPages),
    /// A slot of the host tier.
    Host(u32),
    /// Block `index` of a host staging allocation laid out `[blocks][layers][K | V][block_size,
    /// kv_dim]` (the disk tier's slot payload, element for element).
    Staging { mem: MemId, index: usize },
}

/// Both tiers' KV pages on `D`, with the host tier's transfer jobs in flight.
pub struct DevicePages<D: OffloadDevice> {
    d: Checked<D>,
    block_size: usize,
    page: usize,     // elements of one block of one layer, K or V: block_size · kv_dim
    gpu: Vec<Pair>,  // [num_layers], device: [num_gpu_blocks | window pages + 1, page] each
    host: Vec<Pair>, // [num_layers], host (pinned on CUDA)
    num_gpu_blocks: usize,
    window: Option<WindowLayers>,
    num_cpu_blocks: usize,
    pending: Vec<(JobId, EventId)>, // host-tier jobs, in submit order
    free_events: Vec<EventId>,
    compute_done: EventId, // recorded on the compute stream before each job's copies
    /// Per layer: its index among the layers that keep KV (`None`: a state layer, which
    /// has no pages in any tier and no place in a block's staging payload).
    kv_index: Vec<Option<usize>>,
    /// A state-layer model's recurrent states, by sequence id: kept in CPU memory for as
    /// long as the sequence lives, whichever tier its blocks are in (docs/serving.md,
    /// "State layers").
    states: RecurrentStates,
}

/// The sliding-window layers' own device pool (`BlockManager::with_window_pool`): which
/// layers use it, and its pages; page `pages` is the null page block tables name for
/// blocks before a window (allocated, never written, never read: the kernels skip keys
/// before a query's window).
#[derive(Debug, Clone)]
pub struct WindowLayers {
    pub layers: Vec<bool>, // [num_layers]
    pub pages: usize,
}

/// Pages of layer `l`'s device pool: the window pool's (its null page included) for a
/// window-pool layer, else the full pool's `num_gpu_blocks`.
pub fn layer_pages(window: Option<&WindowLayers>, l: usize, num_gpu_blocks: usize) -> usize {
    match window {
        Some(w) if w.layers[l] => w.pages + 1,
        _ => num_gpu_blocks,
    }
}

impl<D: OffloadDevice> DevicePages<D> {
    /// `check_order`: under the stream-ordering checker (`crate::device::order`).
    /// `window`: the sliding-window layers' own pool, if any.
    /// `keeps_kv`: per layer, whether it keeps KV (`ModelConfig::keeps_kv`; a state layer
    /// gets no pages).
    pub fn new(
        d: D,
        keeps_kv: &[bool],
        kv_dim: usize,
        (block_size, num_gpu_blocks, num_cpu_blocks): (usize, usize, usize),
        window: Option<WindowLayers>,
        check_order: bool,
    ) -> Result<Self> {
        let num_layers = keeps_kv.len();
        let kv_index: Vec<Option<usize>> = keeps_kv
            .iter()
            .scan(0, |n, &keeps| {
                let i = keeps.then_some(*n);
                *n += keeps as usize;
                Some(i)
            })
            .collect();
        if let Some(w) = &window {
            if w.layers.len() != num_layers {
                bail!(
                    "window layers name {} of {num_layers} layers",
                    w.layers.len()
                );
            }
        }
        let mut d = Checked::new(d, check_order);
        let page = block_size * kv_dim;
        let kv = |l: usize| kv_index[l].is_some();
        let device_blocks = |l: usize| match kv(l) {
            true => layer_pages(window.as_ref(), l, num_gpu_blocks),
            false => 0,
        };
        let mut tier = |space, blocks: &dyn Fn(usize) -> usize| -> Result<Vec<Pair>> {
            (0..num_layers)
                .map(|l| {
                    Ok(Pair {
                        k: d.alloc(space, blocks(l) * page)?,
                        v: d.alloc(space, blocks(l) * page)?,
                    })
                })
                .collect()
        };
        let gpu = tier(Space::Device, &device_blocks)?;
        let host = tier(Space::Host, &|l| if kv(l) { num_cpu_blocks } else { 0 })?;
        let compute_done = d.new_event()?;
        Ok(Self {
            d,
            block_size,
            page,
            gpu,
            host,
            num_gpu_blocks,
            num_cpu_blocks,
            window,
            pending: Vec::new(),
            free_events: Vec::new(),
            compute_done,
            kv_index,
            states: RecurrentStates::default(),
        })
    }

    /// Keeps recurrent states for `cfg`'s state layers (a model with some). Before any
    /// forward.
    pub fn with_states(mut self, cfg: &crate::model::ModelConfig) -> Result<Self> {
        self.states = RecurrentStates::in_memory(cfg, self.d.state_memory()?);
        Ok(self)
    }

    /// Drops sequence slot `slot`'s recurrent state (it finished or was cancelled).
    pub fn release_state(&mut self, slot: usize) {
        self.states.release(slot);
    }

    /// Bytes of the recurrent states held (every live sequence's).
    pub fn state_bytes(&self) -> usize {
        self.states.bytes()
    }

    pub fn num_layers(&self) -> usize {
        self.gpu.len()
    }

    /// Elements of one block across every layer that keeps KV, K and V: `[kv layers][K |
    /// V][block_size, kv_dim]`.
    pub fn block_elems(&self) -> usize {
        2 * self.kv_index.iter().flatten().count() * self.page
    }

    /// Bytes of one block across every layer, K and V.
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * std::mem::size_of::<D::Elem>()
    }

    pub fn num_cpu_blocks(&self) -> usize {
        self.num_cpu_blocks
    }

    /// Whether layer `l` keeps its pages in the window pool.
    fn in_window_pool(&self, l: usize) -> bool {
        self.window.as_ref().is_some_and(|w| w.layers[l])
    }

    /// Pages of layer `l`'s device pool (none for a state layer).
    fn device_pages(&self, l: usize) -> usize {
        match self.kv_index[l] {
            Some(_) => layer_pages(self.window.as_ref(), l, self.num_gpu_blocks),
            None => 0,
        }
    }

    /// Layer `layer`'s K (`v` false) or V of device page `page`, checked against the
    /// layer's pool.
    fn device_span(&self, layer: usize, page: u32, v: bool) -> Result<Span> {
        let blocks = self.device_pages(layer);
        if page as usize >= blocks {
            bail!("page {page} is outside layer {layer}'s pool of {blocks} blocks");
        }
        let pair = self.gpu[layer];
        Ok(Span {
            mem: if v { pair.v } else { pair.k },
            off: page as usize * self.page,
            len: self.page,
        })
    }

    /// Layer `layer`'s device page of a block on the device: its window page in a
    /// window-pool layer (`None` when the block has none: the layer is not copied).
    fn device_page(&self, pages: GpuPages, layer: usize) -> Option<u32> {
        if self.in_window_pool(layer) {
            pages.win
        } else {
            Some(pages.page)
        }
    }

    /// Layer `layer`'s K (`v` false) or V of a block at `place`, checked against the tier;
    /// `None` for a window-pool layer of a block without a window page, and for a state
    /// layer.
    fn span(&self, place: Place, layer: usize, v: bool) -> Result<Option<Span>> {
        let Some(kv_layer) = self.kv_index[layer] else {
            return Ok(None); // a state layer: no KV in any tier
        };
        let (pair, idx, blocks) = match place {
            Place::Gpu(pages) => {
                return match self.device_page(pages, layer) {
                    Some(p) => self.device_span(layer, p, v).map(Some),
                    None => Ok(None),
                }
            }
            Place::Host(s) => (self.host[layer], s as usize, self.num_cpu_blocks),
            Place::Staging { mem, index } => {
                let off = index * self.block_elems() + (2 * kv_layer + usize::from(v)) * self.page;
                return Ok(Some(Span {
                    mem,
                    off,
                    len: self.page,
                }));
            }
        };
        if idx >= blocks {
            bail!("{place:?} is outside its tier of {blocks} blocks");
        }
        Ok(Some(Span {
            mem: if v { pair.v } else { pair.k },
            off: idx * self.page,
            len: self.page,
        }))
    }

    /// The device tier or host tier block a job's end names.
    fn place(loc: Loc) -> Result<Place> {
        Ok(match loc {
            Loc::Gpu(p) => Place::Gpu(p),
            Loc::Host(Tier::Cpu, s) => Place::Host(s),
            Loc::Host(Tier::Ssd, _) | Loc::Disk { .. } => {
                bail!("{loc:?} is the disk tier's (serve::disk::backend), not the host tier's")
            }
        })
    }

    /// The copies of whole blocks `(src, dst)`, every layer, K and V (a window-pool layer
    /// only where the device end has a window page), checked before any is queued (so a
    /// bad job moves nothing).
    fn block_copies(&self, blocks: &[(Place, Place)]) -> Result<Vec<(usize, Span, Span)>> {
        let mut copies = Vec::with_capacity(blocks.len() * 2 * self.gpu.len());
        for &(src, dst) in blocks {
            for layer in 0..self.gpu.len() {
                for v in [false, true] {
                    if let (Some(s), Some(d)) =
                        (self.span(src, layer, v)?, self.span(dst, layer, v)?)
                    {
                        copies.push((layer, s, d));
                    }
                }
            }
        }
        Ok(copies)
    }

    /// Queues copies of whole blocks on `stream` after the compute queued so far (their
    /// pages were written by earlier steps, or may still be used by a step in flight), and
    /// returns the event recorded after them.
    pub fn copy_blocks(
        &mut self,
        stream: StreamRole,
        name: &'static str,
        blocks: &[(Place, Place)],
    ) -> Result<EventId> {
        let copies = self.block_copies(blocks)?;
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
        Ok(ev)
    }

    /// Whether the copies before `ev` have run (never blocks); once they have, the host
    /// knows it and `ev` goes back to the pool.
    pub fn finished(&mut self, ev: EventId) -> Result<bool> {
        let done = self.d.query(ev)?;
        if done {
            self.free_events.push(ev);
        }
        Ok(done)
    }

    /// Blocks until every stream has run everything queued.
    pub fn sync_all(&mut self) -> Result<()> {
        self.d.sync_all()
    }

    /// `elems` elements of host memory on the device (pinned on CUDA), and their address.
    pub fn alloc_host(&mut self, elems: usize) -> Result<(MemId, *mut u8)> {
        let mem = self.d.alloc(Space::Host, elems)?;
        Ok((mem, self.d.host_ptr(mem)?))
    }

    /// Declares that the host itself reads or writes staging block `index` of `mem` now
    /// (the disk tier's IO threads, between dispatch and completion).
    pub fn host_access(
        &mut self,
        name: &'static str,
        access: Access,
        (mem, index): (MemId, usize),
    ) -> Result<()> {
        let n = self.block_elems();
        let span = Span {
            mem,
            off: index * n,
            len: n,
        };
        self.d.host_access(name, access, span)
    }

    /// Declares one forward over `seqs` on the compute stream: each reads the pages of its
    /// blocks before the one holding `pos0` and writes that block and the later ones, in
    /// every layer, K and V (what the batched forward's kernels touch; a window-pool layer
    /// its window table's pages, the null page not at all).
    pub fn declare_forward(&mut self, seqs: &[BatchSeq]) -> Result<()> {
        if !self.d.is_checked() {
            return Ok(());
        }
        let null = self.window.as_ref().map(|w| w.pages as u32);
        for seq in seqs {
            let first_written = seq.pos0 / self.block_size;
            for layer in (0..self.gpu.len()).filter(|&l| self.kv_index[l].is_some()) {
                let table = if self.in_window_pool(layer) {
                    seq.window_pages
                } else {
                    seq.pages
                };
                for (i, &page) in table.iter().enumerate() {
                    if self.in_window_pool(layer) && Some(page) == null {
                        continue;
                    }
                    let access = if i < first_written {
                        Access::Read
                    } else {
                        Access::Write
                    };
                    let k = self.device_span(layer, page, false)?;
                    let v = self.device_span(layer, page, true)?;
                    let acc = [(access, k), (access, v)];
                    self.d
                        .declare(StreamRole::Compute, "forward", layer, &acc)?;
                }
            }
        }
        Ok(())
    }

    fn submit(&mut self, job: &TransferJob) -> Result<()> {
        let blocks = job
            .copies
            .iter()
            .map(|c| Ok((Self::place(c.src)?, Self::place(c.dst)?)))
            .collect::<Result<Vec<_>>>()?;
        let (stream, name) = match job.kind {
            JobKind::Store => (StreamRole::Offload(0), "kv_store"),
            JobKind::Load => (StreamRole::Prefetch, "kv_load"),
        };
        let ev = self.copy_blocks(stream, name, &blocks)?;
        self.pending.push((job.id, ev));
        Ok(())
    }

    fn poll(&mut self) -> Result<Vec<Completion>> {
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            let (job, ev) = self.pending[i];
            if self.finished(ev)? {
                self.pending.remove(i);
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
// events observed) before the blocks turned resident, and every copy reading or writing
// device pages waits for an event recorded on the compute stream (the checker proves it).
unsafe impl<D: OffloadDevice> KvCache<D::Elem> for DevicePages<D> {
    fn reset(&mut self) -> Result<()> {
        Ok(())
    }

    fn capacity(&self) -> usize {
        self.num_gpu_blocks * self.block_size
    }

    fn begin_step(&mut self, _pos0: usize, _tokens: usize) -> Result<()> {
        Ok(())
    }

    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot<D::Elem>> {
        let p = self.gpu[layer];
        Ok(LayerSlot {
            k: self.d.ptr(p.k),
            v: self.d.ptr(p.v),
            rows: self.device_pages(layer) * self.block_size,
            ring: false,
        })
    }

    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }

    fn layer_state(&mut self, layer: usize, slot: usize) -> Result<crate::kv::StateSlot> {
        self.states.layer(layer, slot)
    }

    fn begin_state(&mut self, slot: usize, pos0: usize, tokens: usize) -> Result<()> {
        self.states.begin_step(slot, pos0, tokens)
    }
}

impl<D: OffloadDevice> PagePool<D::Elem> for DevicePages<D> {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_pages(&self) -> usize {
        self.num_gpu_blocks
    }

    fn num_window_pages(&self) -> Option<usize> {
        self.window.as_ref().map(|w| w.pages + 1)
    }
}

/// The pages shared by the runner and the transfer backends (all on the engine thread).
pub type SharedPages<D> = Arc<Mutex<DevicePages<D>>>;

pub fn lock<D: OffloadDevice>(p: &SharedPages<D>) -> MutexGuard<'_, DevicePages<D>> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// The host tier's transfer jobs, as copies on the device's copy streams.
pub struct DeviceTransfers<D: OffloadDevice> {
    pub pages: SharedPages<D>,
}

impl<D: OffloadDevice + Send> TransferBackend for DeviceTransfers<D> {
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
        p.sync_all()?;
        p.poll()
    }

    fn in_flight(&self) -> usize {
        lock(&self.pages).pending.len()
    }
}
