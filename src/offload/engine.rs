//! The offload engine, written once against `OffloadDevice`: the CPU model runs it on the
//! CPU device, the CUDA model on the GPU (or, in tests, on the CPU device in bf16 under
//! the kernel emulator). See the module docs of `super` for the memory layout, streams and
//! events, and `ring` for the slot state machine.

use anyhow::{bail, Result};

use super::checked::Checked;
use super::device::{EventId, MemId, OffloadDevice, Space, Span, StreamRole};
use super::ring::{ReleasedAfter, Ring};
use super::{MemoryPlan, OffloadConfig};
use crate::device::cpu::ops::AttnHeads;
use crate::device::cpu::stream::TraceEvent;
use crate::device::order::Access;
use crate::kv::{KvCache, LayerSlot, NewRow, Query};
use crate::model::ModelConfig;
use crate::sparse::{self, Page, SparseConfig, SparseStats};

/// D2H streams in the offload pool: consecutive layers' offloads run side by side.
pub const OFFLOAD_STREAMS: usize = 2;

/// A K buffer and its V twin, always copied together.
#[derive(Debug, Clone, Copy)]
struct KvMem {
    k: MemId,
    v: MemId,
}

/// Per-slot events.
struct SlotEvents {
    ready: EventId,        // H2D prefetch done
    compute_done: EventId, // last compute reading/writing the slot done
    offload_done: EventId, // D2H offload reading the slot done
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Idle,
    /// `tokens` new rows at `pos..`, computed in the slot with full attention, then
    /// offloaded from it: the prompt (`pos == 0`: nothing stored, nothing to prefetch), or
    /// an extension of the stored context (sparse decode's verify step, a follow-up turn),
    /// whose stored KV is prefetched in full first, as a full decode step's is.
    Prefill {
        pos: usize,
        tokens: usize,
    },
    Decode {
        pos: usize,
    },
}

pub struct OffloadEngine<D: OffloadDevice> {
    cfg: OffloadConfig,
    plan: MemoryPlan,
    d: Checked<D>,
    num_layers: usize,
    row: usize, // kv_dim: elements per token per layer, in K (and in V)
    depth: usize,
    host: KvMem, // per layer [host_blocks[l], block_size, row], from host_base[l]
    host_base: Vec<usize>,
    /// Host blocks of each layer: `num_cpu_blocks`, or a sliding-window layer's ring.
    host_blocks: Vec<usize>,
    /// Each layer's sliding window (`None`: full attention).
    window: Vec<Option<usize>>,
    /// Per layer: whether it keeps K/V (a state layer does not: nothing of it moves).
    keeps_kv: Vec<bool>,
    /// Per layer (and one past the last): how many layers before it keep K/V, so its
    /// block in the decode buffer.
    kv_before: Vec<usize>,
    /// The state layers' recurrent states: resident with the compute, never moved (a
    /// layer's state is a few MiB at most, read and rewritten whole every token: cheaper
    /// kept than copied both ways per step).
    states: crate::kv::RecurrentStates,
    ring: Vec<KvMem>, // num_kv_buffers × [slot_tokens, row]
    dbuf: KvMem,      // [num_layers, block_size, row]: each layer's partial last block
    slots: Vec<SlotEvents>,
    layer_stored: Vec<EventId>, // the layer's host blocks and decode buffer are up to date
    state: Ring,
    /// Layers of the next decode step already prefetched (during this step's tail).
    ahead: usize,
    /// Tokens whose KV is stored (host blocks + decode buffer).
    seq_len: usize,
    step: Step,
    /// The next step attends every stored position, even a one-token step under sparse
    /// decode (`KvCache::attend_all_next_step`).
    attend_all: bool,
    sparse: Option<Sparse>,
}

/// Sparse decode's state (`crate::sparse`; docs/offload.md, "Sparse decode").
struct Sparse {
    cfg: SparseConfig,
    heads: AttnHeads,
    bounds: MemId, // [num_layers, max_pages, meta_rows, row]: min, max, mask planes (device)
    max_pages: usize,
    /// Per layer: the pages its slot was prefetched with (`loaded[l][j]` at slot page `j`).
    loaded: Vec<Vec<Page>>,
    /// Per layer: the pages it ranked best at its last decode step (after a prefill: for
    /// the prompt's last token), best first: its choice and the prefetch margin below it
    /// (the next prediction).
    ranked: Vec<Vec<Page>>,
    /// `[num_heads · head_dim]` (device): the prompt's last token's query at the layer
    /// prefilling now, kept from `select_rows` until its keys' bounds exist (`end_layer`).
    last_query: MemId,
    /// Whether `last_query` holds this prefill layer's query (the model called
    /// `select_rows`).
    query_kept: bool,
    /// The layer computing now: where its new token goes, and whether its rows were
    /// selected (the model must call `select_rows` before attending).
    new_row: usize,
    selected: bool,
    moves_done: EventId, // compute: moves of prefetched pages inside the slot queued
    misses_done: EventId, // miss stream: the missed pages are in the slot
    stats: SparseStats,
}

impl<D: OffloadDevice> OffloadEngine<D> {
    pub fn new(d: D, model: &ModelConfig, cfg: OffloadConfig) -> Result<Self> {
        let mut d = Checked::new(d, cfg.check_order || cfg.sanitize);
        let plan = cfg.plan_for(model, std::mem::size_of::<D::Elem>())?;
        let row = model.kv_dim();
        let (l, bs, n) = (model.num_layers, cfg.block_size, cfg.num_kv_buffers);
        let mut pair = |space, elems| -> Result<KvMem> {
            Ok(KvMem {
                k: d.alloc(space, elems)?,
                v: d.alloc(space, elems)?,
            })
        };
        let host_blocks: Vec<usize> = (0..l)
            .map(|i| super::host_blocks(model, i, plan.num_cpu_blocks, bs))
            .collect();
        let host_base: Vec<usize> = host_blocks
            .iter()
            .scan(0, |at, &n| {
                let base = *at;
                *at += n * bs * row;
                Some(base)
            })
            .collect();
        let host = pair(Space::Host, host_blocks.iter().sum::<usize>() * bs * row)?;
        let ring = (0..n)
            .map(|_| pair(Space::Device, plan.slot_tokens * row))
            .collect::<Result<Vec<_>>>()?;
        // The decode buffer has a block for each layer that keeps KV: the layers before
        // layer `i` that do, at `kv_before[i]` (a prefix count, `[l + 1]`).
        let kv_before: Vec<usize> = std::iter::once(0)
            .chain((0..l).scan(0, |n, i| {
                *n += model.keeps_kv(i) as usize;
                Some(*n)
            }))
            .collect();
        let dbuf = pair(Space::Device, kv_before[l] * bs * row)?;
        let mut slots = Vec::new();
        for _ in 0..n {
            slots.push(SlotEvents {
                ready: d.new_event()?,
                compute_done: d.new_event()?,
                offload_done: d.new_event()?,
            });
        }
        let layer_stored = (0..l).map(|_| d.new_event()).collect::<Result<Vec<_>>>()?;
        let sparse = match cfg.sparse {
            None => None,
            Some(sc) => {
                let max_pages = plan.num_cpu_blocks * bs / sc.page_size;
                Some(Sparse {
                    cfg: sc,
                    heads: AttnHeads::causal(model.num_heads, model.num_kv_heads, model.head_dim),
                    bounds: d.alloc(Space::Device, l * max_pages * sc.meta_rows() * row)?,
                    max_pages,
                    loaded: vec![Vec::new(); l],
                    ranked: vec![Vec::new(); l],
                    last_query: d.alloc(Space::Device, model.num_heads * model.head_dim)?,
                    query_kept: false,
                    new_row: 0,
                    selected: false,
                    moves_done: d.new_event()?,
                    misses_done: d.new_event()?,
                    stats: SparseStats::default(),
                })
            }
        };
        let mut e = Self {
            depth: (n - 1).min(l),
            num_layers: l,
            row,
            host,
            host_base,
            host_blocks,
            window: (0..l).map(|i| model.window(i)).collect(),
            keeps_kv: (0..l).map(|i| model.keeps_kv(i)).collect(),
            kv_before,
            states: crate::kv::RecurrentStates::in_memory(model, d.state_memory()?),
            ring,
            dbuf,
            slots,
            layer_stored,
            state: Ring::new(n, l),
            ahead: 0,
            seq_len: 0,
            step: Step::Idle,
            attend_all: false,
            sparse,
            cfg,
            plan,
            d,
        };
        e.reset()?;
        Ok(e)
    }

    /// The device, for settings of its own that no stream's order depends on (the CPU
    /// device's simulated link speed); crate-private so nothing queues work behind the
    /// engine's back.
    pub(crate) fn device_mut(&mut self) -> &mut D {
        self.d.inner_mut()
    }

    /// Whether every cross-stream access is proven ordered (`crate::device::order`).
    pub fn order_checked(&self) -> bool {
        self.d.is_checked()
    }

    /// Declares the model's compute over `layer`'s slot `s`, queued since `begin_layer`:
    /// it reads and writes the slot's first `rows` rows, K and V (the checker's view of
    /// what the kernels, or the CPU model, touch between `begin_layer` and `end_layer`).
    fn declare_compute(&mut self, layer: usize, s: usize, rows: usize) -> Result<()> {
        let len = rows * self.row;
        let slot = self.ring[s];
        let span = |mem| (Access::Write, Span { mem, off: 0, len });
        let acc = [span(slot.k), span(slot.v)];
        self.d
            .declare(StreamRole::Compute, "layer-compute", layer, &acc)
    }

    /// Where the sequence's block `block` of layer `layer` lives in host memory (a
    /// sliding-window layer's ring wraps).
    fn host_at(&self, layer: usize, block: usize) -> usize {
        // A state layer keeps no blocks (`max(1)`: its copies are skipped in `copy_kv`).
        let n = self.host_blocks[layer].max(1);
        self.host_base[layer] + block % n * self.cfg.block_size * self.row
    }

    /// Layer `layer`'s host blocks `blocks` as runs `(first block, blocks)` contiguous in
    /// host memory: one run, unless a window's ring wraps inside.
    fn host_runs(&self, layer: usize, blocks: std::ops::Range<usize>) -> Vec<(usize, usize)> {
        let n = self.host_blocks[layer];
        let mut runs = Vec::new();
        if n == 0 {
            return runs; // a state layer keeps no blocks
        }
        let mut b = blocks.start;
        while b < blocks.end {
            let len = (blocks.end - b).min(n - b % n);
            runs.push((b, len));
            b += len;
        }
        runs
    }

    /// The first block a step at `pos` attends in layer `layer`: 0, or where a sliding
    /// window reaches back to.
    fn first_block(&self, layer: usize, pos: usize) -> usize {
        crate::kv::first_window_block(self.window[layer], pos, self.cfg.block_size)
    }

    /// Whether sparse decode selects this layer's rows (full attention layers only: a
    /// window is attended exactly).
    fn sparse_layer(&self, layer: usize) -> bool {
        self.sparse.is_some() && self.window[layer].is_none() && self.keeps_kv[layer]
    }

    /// Queues the copies of layer `layer`'s blocks `blocks` between the host and slot
    /// `s` (at their positions' rows), on `st`: host to slot if `to_slot`, else back.
    fn copy_blocks(
        &mut self,
        st: StreamRole,
        names: [&'static str; 2],
        layer: usize,
        s: usize,
        blocks: std::ops::Range<usize>,
        to_slot: bool,
    ) -> Result<()> {
        let rows = self.cfg.block_size * self.row;
        for (b, n) in self.host_runs(layer, blocks) {
            let host = (self.host, self.host_at(layer, b));
            let slot = (self.ring[s], b * rows);
            let (src, dst) = if to_slot { (host, slot) } else { (slot, host) };
            self.copy_kv(st, names, layer, src, dst, n * rows)?;
        }
        Ok(())
    }

    fn dbuf_at(&self, layer: usize) -> usize {
        self.kv_before[layer] * self.cfg.block_size * self.row
    }

    /// Sparse: layer `layer`'s bounds from page `page` on.
    fn bounds_at(&self, sp: &Sparse, layer: usize, page: usize) -> usize {
        self.meta_elems(sp, layer * sp.max_pages + page)
    }

    /// Sparse: elements of page metadata in `pages` pages.
    fn meta_elems(&self, sp: &Sparse, pages: usize) -> usize {
        pages * sp.cfg.meta_rows() * self.row
    }

    /// Sparse: elements of K (or V) in `pages` pages.
    fn page_elems(&self, sp: &Sparse, pages: usize) -> usize {
        pages * sp.cfg.page_size * self.row
    }

    /// Sparse, on the compute stream: the bounds of `tokens / page_size` pages of `keys`
    /// (device K at element `off`), the context's from position `first` (a page's first
    /// token), into layer `layer`'s bounds.
    fn queue_bounds(
        &mut self,
        layer: usize,
        (keys, off): (MemId, usize),
        first: usize,
        tokens: usize,
    ) -> Result<()> {
        if !self.sparse_layer(layer) {
            return Ok(());
        }
        let Some(sp) = &self.sparse else {
            return Ok(());
        };
        let (page, pages) = (first / sp.cfg.page_size, tokens / sp.cfg.page_size);
        if pages == 0 {
            return Ok(());
        }
        let keys = Span {
            mem: keys,
            off,
            len: self.page_elems(sp, pages),
        };
        let bounds = Span {
            mem: sp.bounds,
            off: self.bounds_at(sp, layer, page),
            len: self.meta_elems(sp, pages),
        };
        let (row, ps) = (self.row, sp.cfg.page_size);
        self.d.page_bounds(layer, keys, row, ps, bounds)
    }

    fn offload_stream(&self, layer: usize) -> StreamRole {
        StreamRole::Offload(layer % self.d.num_offload_streams())
    }

    /// Sanitizer: a copy on a copy stream is enqueued at a random moment too (the CPU device
    /// also delays the copy itself).
    fn sanitize_delay(&self, s: StreamRole) {
        if self.cfg.sanitize && s != StreamRole::Compute {
            std::thread::sleep(std::time::Duration::from_micros(rand::random_range(0..200)));
        }
    }

    /// Queues `len` elements of K and of V from `src` at `src_off` to `dst` at `dst_off`.
    #[allow(clippy::too_many_arguments)]
    fn copy_kv(
        &mut self,
        s: StreamRole,
        names: [&'static str; 2],
        layer: usize,
        (src, src_off): (KvMem, usize),
        (dst, dst_off): (KvMem, usize),
        len: usize,
    ) -> Result<()> {
        if len == 0 || !self.keeps_kv[layer] {
            return Ok(());
        }
        self.sanitize_delay(s);
        let span = |mem, off| Span { mem, off, len };
        self.d.copy(
            s,
            names[0],
            layer,
            span(src.k, src_off),
            span(dst.k, dst_off),
        )?;
        self.d.copy(
            s,
            names[1],
            layer,
            span(src.v, src_off),
            span(dst.v, dst_off),
        )
    }

    /// Queues the runs `(src offset, dst offset, elements)` of K and of V from `src` to
    /// `dst`: one submission each (sparse decode's scattered pages).
    fn copy_kv_runs(
        &mut self,
        s: StreamRole,
        names: [&'static str; 2],
        layer: usize,
        (src, dst): (KvMem, KvMem),
        runs: &[(usize, usize, usize)],
    ) -> Result<()> {
        if runs.is_empty() || !self.keeps_kv[layer] {
            return Ok(());
        }
        self.sanitize_delay(s);
        self.d.copy_runs(s, names[0], layer, (src.k, dst.k), runs)?;
        self.d.copy_runs(s, names[1], layer, (src.v, dst.v), runs)
    }

    /// Makes `s` wait for whatever the previous user of `slot` left in flight.
    fn wait_released(&mut self, s: StreamRole, slot: usize, after: ReleasedAfter) -> Result<()> {
        match after {
            ReleasedAfter::Nothing => Ok(()),
            ReleasedAfter::Compute => {
                self.d
                    .wait(s, self.slots[slot].compute_done, "slot-compute-done")
            }
            ReleasedAfter::Offload => {
                self.d
                    .wait(s, self.slots[slot].offload_done, "slot-offload-done")
            }
        }
    }

    /// A step's compute takes `layer`'s prefetched slot once the prefetch landed
    /// (`offloads`: the step's rows are copied out of it afterwards). The wait also orders
    /// this layer's decode-buffer writes after its last flush: the prefetch waited for
    /// `layer_stored` before recording `ready`.
    fn begin_prefetched(&mut self, layer: usize, offloads: bool) -> Result<usize> {
        let s = self.state.begin_decode_compute(layer, offloads)?;
        self.d
            .wait(StreamRole::Compute, self.slots[s].ready, "slot-ready")?;
        Ok(s)
    }

    /// Waits for every stream and forgets the ring's slots (what the last step's tail
    /// prefetched for a step that will not come), keeping the stored KV: the next step
    /// prefetches its first layers itself. After a full synchronize no slot has work in
    /// flight, so every slot is free with nothing to wait for.
    fn drain(&mut self) -> Result<()> {
        self.d.sync_all()?;
        self.state.reset();
        self.ahead = 0;
        Ok(())
    }

    /// Decode, on the compute stream: the decode buffer's `pos % block_size` tokens (the
    /// recent window) into slot `s` from row `base`.
    fn append_window(&mut self, layer: usize, s: usize, pos: usize, base: usize) -> Result<()> {
        let r = pos % self.cfg.block_size;
        let (dbuf, slot) = (
            (self.dbuf, self.dbuf_at(layer)),
            (self.ring[s], base * self.row),
        );
        let names = ["dbuf-to-slot-k", "dbuf-to-slot-v"];
        self.copy_kv(StreamRole::Compute, names, layer, dbuf, slot, r * self.row)
    }

    /// Decode: queues the H2D of `layer`'s full host blocks (of a step at `pos`) into its
    /// slot, for this step or, when `next_step`, for the next; sparse (unless `all`, a
    /// step attending every position): the pages predicted.
    fn prefetch_layer(
        &mut self,
        layer: usize,
        pos: usize,
        next_step: bool,
        all: bool,
    ) -> Result<()> {
        let (s, after) = self.state.begin_load(layer, next_step)?;
        let p = StreamRole::Prefetch;
        self.wait_released(p, s, after)?;
        self.d.wait(p, self.layer_stored[layer], "layer-stored")?;
        let names = ["h2d-k", "h2d-v"];
        let sparse_layer = self.sparse_layer(layer);
        let sparse = self.sparse.as_mut().filter(|_| !all && sparse_layer);
        if let Some(sp) = sparse {
            // The pages this layer ranked best last step (its query is not known yet), a
            // margin beyond its choice included: runs contiguous in host memory, one copy
            // each.
            let (candidates, count) = sp.cfg.slot_pages(pos, self.cfg.block_size);
            sp.loaded[layer] = sparse::predict(&sp.ranked[layer], candidates, count);
            let runs = sparse::fetch_runs(&sp.loaded[layer]);
            let sp = self.sparse.as_ref().expect("sparse");
            let at = |p: usize| self.page_elems(sp, p);
            let host = self.host_at(layer, 0);
            let copies: Vec<_> = runs
                .iter()
                .map(|r| (host + at(r.src), at(r.dst), at(r.pages)))
                .collect();
            self.copy_kv_runs(p, names, layer, (self.host, self.ring[s]), &copies)?;
        } else {
            // The full blocks before `pos` (a window's: only those it reaches).
            let blocks = self.first_block(layer, pos)..pos / self.cfg.block_size;
            self.copy_blocks(p, names, layer, s, blocks, true)?;
        }
        self.d.record(p, self.slots[s].ready)
    }

    /// After `layer` is queued: prefetch `depth` layers ahead, running on into the next
    /// decode step (at position `next_pos`) so the link stays busy across step boundaries.
    fn prefetch_after(&mut self, layer: usize, next_pos: usize) -> Result<()> {
        let target = layer + self.depth;
        if target < self.num_layers {
            match self.step {
                Step::Decode { pos } => self.prefetch_layer(target, pos, false, false)?,
                Step::Prefill { pos, .. } if pos > 0 => {
                    self.prefetch_layer(target, pos, false, true)?
                }
                _ => {}
            }
        } else if target - self.num_layers < self.depth && next_pos < self.capacity() {
            // The next step is taken to be a decode step (the rest are drained for).
            self.prefetch_layer(target - self.num_layers, next_pos, true, false)?;
            self.ahead += 1;
        }
        if layer + 1 == self.num_layers {
            self.seq_len = next_pos;
            self.state.advance();
        }
        Ok(())
    }

    /// NaN over the first `tokens` rows of slot `s`, queued on `st` (sanitizer).
    fn poison_slot(&mut self, st: StreamRole, s: usize, tokens: usize) -> Result<()> {
        let len = tokens * self.row;
        let slot = self.ring[s];
        for mem in [slot.k, slot.v] {
            self.d.poison(st, Span { mem, off: 0, len })?;
        }
        Ok(())
    }

    /// Prefill: the slot's new rows `pos..end` go to the host (the blocks they fill, whole:
    /// the slot holds their earlier rows too) and the decode buffer (the partial last
    /// block), on an offload stream, while the next layers compute.
    fn offload_rows(&mut self, layer: usize, s: usize, pos: usize, end: usize) -> Result<()> {
        let (bs, row) = (self.cfg.block_size, self.row);
        let o = self.offload_stream(layer);
        self.d
            .wait(o, self.slots[s].compute_done, "slot-compute-done")?;
        let (first, full) = (pos / bs * bs, end / bs * bs);
        let slot = self.ring[s];
        // The blocks the step filled (a window's: only those later steps reach).
        let blocks = (first / bs).max(self.first_block(layer, end))..full / bs;
        self.copy_blocks(o, ["d2h-k", "d2h-v"], layer, s, blocks, false)?;
        let from = pos.max(full);
        let dbuf = (self.dbuf, self.dbuf_at(layer) + from % bs * row);
        let names = ["slot-to-dbuf-k", "slot-to-dbuf-v"];
        self.copy_kv(
            o,
            names,
            layer,
            (slot, from * row),
            dbuf,
            (end - from) * row,
        )?;
        if self.cfg.sanitize {
            self.poison_slot(o, s, end)?;
        }
        self.d.record(o, self.slots[s].offload_done)?;
        self.d.record(o, self.layer_stored[layer])
    }

    /// Decode: the new token's K/V joins the decode buffer; when that fills a block, the
    /// block moves to the host on an offload stream.
    fn store_decoded(&mut self, layer: usize, s: usize, pos: usize) -> Result<()> {
        let (bs, c) = (self.cfg.block_size, StreamRole::Compute);
        let (full, r) = (pos / bs, pos % bs);
        let dbuf = (self.dbuf, self.dbuf_at(layer) + r * self.row);
        let names = ["slot-to-dbuf-k", "slot-to-dbuf-v"];
        // Sparse: the new token sits after the compacted rows, not at its position.
        let sparse_layer = self.sparse_layer(layer);
        let new_row = match self.sparse.as_mut().filter(|_| sparse_layer) {
            Some(sp) => {
                if !std::mem::take(&mut sp.selected) {
                    bail!("sparse decode: layer {layer} attended without selecting its rows (the model must call select_rows)");
                }
                sp.new_row
            }
            None => pos,
        };
        self.declare_compute(layer, s, new_row + 1)?;
        self.copy_kv(
            c,
            names,
            layer,
            (self.ring[s], new_row * self.row),
            dbuf,
            self.row,
        )?;
        if self.cfg.sanitize {
            self.poison_slot(c, s, pos + 1)?;
        }
        self.state.end_compute(layer)?;
        self.d.record(c, self.slots[s].compute_done)?;
        if r + 1 == bs {
            let o = self.offload_stream(layer);
            self.d
                .wait(o, self.slots[s].compute_done, "slot-compute-done")?;
            let (src, dst) = (
                (self.dbuf, self.dbuf_at(layer)),
                (self.host, self.host_at(layer, full)),
            );
            self.copy_kv(
                o,
                ["d2h-flush-k", "d2h-flush-v"],
                layer,
                src,
                dst,
                bs * self.row,
            )?;
            self.d.record(o, self.layer_stored[layer])?;
            // The block's pages become candidates: their bounds, from the decode buffer,
            // on the compute stream (which wrote it).
            self.queue_bounds(layer, (self.dbuf.k, self.dbuf_at(layer)), full * bs, bs)?;
        }
        Ok(())
    }

    /// Sparse: `layer`'s `candidates` pages ranked by their box bound for query `q`, best
    /// first, as many as the choice of `count` pages and the prefetch margin below it take
    /// (`prefetch_count`); none when every candidate is attended anyway.
    fn rank(
        &mut self,
        layer: usize,
        q: Query<D::Elem>,
        candidates: usize,
        count: usize,
    ) -> Result<Vec<Page>> {
        let sp = self.sparse.as_ref().expect("sparse");
        let heads = sp.heads;
        if q.len != heads.num_heads * heads.head_dim {
            bail!(
                "sparse decode: a query of {} values, one token's is {}",
                q.len,
                heads.num_heads * heads.head_dim
            );
        }
        if candidates == count {
            return Ok(Vec::new());
        }
        let bounds = Span {
            mem: sp.bounds,
            off: self.bounds_at(sp, layer, 0),
            len: self.meta_elems(sp, candidates),
        };
        let page_size = sp.cfg.page_size;
        let per_head = self
            .d
            .head_bounds(layer, q, bounds, heads, candidates, page_size)?;
        let n = sparse::prefetch_count(count) - 1;
        Ok(sparse::rank_pages(&per_head, heads, candidates, n))
    }

    /// Sparse, at the end of a prefill layer whose keys' bounds are queued: ranks its pages
    /// for the prompt's last token's query (kept by `select_rows`), so that the first
    /// decode step prefetches the pages that query prefers (consecutive tokens' queries
    /// choose much the same pages), not just the most recent ones.
    fn rank_for_first_step(&mut self, layer: usize, tokens: usize) -> Result<()> {
        let Some(sp) = &mut self.sparse else {
            return Ok(());
        };
        // (No query, no ranking: `reset`, before every prefill, left `ranked` empty.)
        if !std::mem::take(&mut sp.query_kept) {
            return Ok(());
        }
        let (candidates, count) = sp.cfg.slot_pages(tokens, self.cfg.block_size);
        let q = Query {
            ptr: self.d.ptr(sp.last_query),
            len: sp.heads.num_heads * sp.heads.head_dim,
        };
        let ranked = self.rank(layer, q, candidates, count)?;
        self.sparse.as_mut().expect("sparse").ranked[layer] = ranked;
        Ok(())
    }

    /// Sparse decode at `pos`: chooses `layer`'s pages from its query and turns the slot
    /// it was prefetched with into them, in position order (moves inside the slot on the
    /// compute stream, misses fetched on the miss stream and waited for there).
    fn select(&mut self, layer: usize, pos: usize, q: Query<D::Elem>) -> Result<NewRow> {
        let c = StreamRole::Compute;
        let s = self.state.slot_of(layer);
        let sp = self.sparse.as_ref().expect("sparse");
        let (candidates, count) = sp.cfg.slot_pages(pos, self.cfg.block_size);
        let base = count * sp.cfg.page_size; // the window's first row
        let ranked = self.rank(layer, q, candidates, count)?;
        let chosen = if candidates == count {
            (0..candidates as Page).collect()
        } else {
            sparse::choose(&ranked, candidates, count - 1)
        };
        let sp = self.sparse.as_ref().expect("sparse");
        let plan = sparse::compaction(&sp.loaded[layer], &chosen);
        let at = |p: usize| self.page_elems(sp, p);
        let moves: Vec<_> = plan
            .moves
            .iter()
            .map(|r| (at(r.src), at(r.dst), at(r.pages)))
            .collect();
        let host = self.host_at(layer, 0);
        let fetches: Vec<_> = plan
            .fetches
            .iter()
            .map(|r| (host + at(r.src), at(r.dst), at(r.pages)))
            .collect();
        let (moves_done, misses_done) = (sp.moves_done, sp.misses_done);
        let slot = self.ring[s];
        for (src, dst, len) in moves {
            self.copy_kv(c, super::trace::MOVES, layer, (slot, src), (slot, dst), len)?;
        }
        // The window after the compacted pages (the moves may have read from there).
        self.append_window(layer, s, pos, base)?;
        if !fetches.is_empty() {
            let m = StreamRole::Miss;
            // After the moves, and so after `ready`, which the prefetch recorded once this
            // layer's host blocks were stored: the misses read stored blocks.
            self.d.record(c, moves_done)?;
            self.d.wait(m, moves_done, "slot-moves-done")?;
            let names = ["h2d-miss-k", "h2d-miss-v"];
            self.copy_kv_runs(m, names, layer, (self.host, slot), &fetches)?;
            self.d.record(m, misses_done)?;
            self.d.wait(c, misses_done, "misses-fetched")?;
        }
        let sp = self.sparse.as_mut().expect("sparse");
        sp.stats.selections += usize::from(candidates > count);
        sp.stats.hit_pages += plan.hits;
        sp.stats.miss_pages += plan.misses;
        sp.stats.miss_runs += fetches.len();
        sp.loaded[layer] = chosen;
        sp.ranked[layer] = ranked;
        sp.selected = true;
        sp.new_row = base + pos % self.cfg.block_size;
        Ok(NewRow(sp.new_row))
    }
}

// SAFETY: a layer's slot is handed to the compute stream only after its prefetch (decode)
// or its previous offload (prefill) is waited for there, and nothing queued later touches
// it before the compute stream records `compute_done` in `end_layer`.
unsafe impl<D: OffloadDevice> KvCache<D::Elem> for OffloadEngine<D> {
    /// Waits for every stream and forgets the previous request; under the sanitizer,
    /// poisons all KV memory so that anything it leaked would show. After a full
    /// synchronize every recorded event has completed, so the events are reused.
    fn reset(&mut self) -> Result<()> {
        self.d.sync_all()?;
        self.state.reset();
        self.states.reset();
        self.ahead = 0;
        self.seq_len = 0;
        self.step = Step::Idle;
        self.attend_all = false;
        let num_layers = self.num_layers;
        if let Some(sp) = &mut self.sparse {
            sp.loaded.iter_mut().for_each(Vec::clear);
            sp.ranked.iter_mut().for_each(Vec::clear);
            sp.query_kept = false;
            sp.selected = false;
            sp.stats = SparseStats::default();
        }
        if let (Some(sp), true) = (&self.sparse, self.cfg.sanitize) {
            let len = self.bounds_at(sp, num_layers, 0);
            let whole = Span {
                mem: sp.bounds,
                off: 0,
                len,
            };
            self.d.poison(StreamRole::Compute, whole)?;
        }
        if self.cfg.sanitize {
            let c = StreamRole::Compute;
            let whole = |mem, len| Span { mem, off: 0, len };
            let host = self.host_blocks.iter().sum::<usize>() * self.cfg.block_size * self.row;
            let dbuf = self.dbuf_at(self.num_layers);
            for (m, len) in [(self.host, host), (self.dbuf, dbuf)] {
                self.d.poison(c, whole(m.k, len))?;
                self.d.poison(c, whole(m.v, len))?;
            }
            for s in 0..self.slots.len() {
                self.poison_slot(c, s, self.plan.slot_tokens)?;
            }
            self.d.sync_all()?;
        }
        Ok(())
    }

    /// Forgets positions `len..` (sparse decode's drafts before their verify step, and the
    /// drafts it rejected): the ring is drained, and when `len` falls in a block already
    /// flushed to the host, the decode buffer gets that block's first rows back from it.
    /// Page bounds need no care: a page is a candidate only once its block is full, and a
    /// block refilled gets its bounds again when it is stored.
    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.seq_len {
            bail!(
                "offload engine: cannot truncate to {len} tokens, {} are stored",
                self.seq_len
            );
        }
        if len == self.seq_len {
            return Ok(());
        }
        self.states.truncate(0, len)?;
        let (bs, row, c) = (self.cfg.block_size, self.row, StreamRole::Compute);
        let (block, r) = (len / bs, len % bs);
        let flushed = block < self.seq_len / bs;
        // A window's ring has overwritten blocks before its last few: a rewind must find
        // the blocks its window reaches (and the one it restores) still there.
        for layer in (0..self.num_layers).filter(|&l| self.keeps_kv[l]) {
            let written = self.seq_len / bs; // blocks flushed so far
            let oldest_kept = written.saturating_sub(self.host_blocks[layer]);
            if self.first_block(layer, len) < oldest_kept {
                bail!("offload engine: cannot rewind {} tokens to {len}: layer {layer}'s sliding-window blocks before block {oldest_kept} are overwritten", self.seq_len - len);
            }
        }
        self.drain()?;
        let kv_layers: Vec<usize> = (0..self.num_layers).filter(|&l| self.keeps_kv[l]).collect();
        for layer in kv_layers {
            if flushed {
                let src = (self.host, self.host_at(layer, block));
                let dst = (self.dbuf, self.dbuf_at(layer));
                let names = ["h2d-rewind-k", "h2d-rewind-v"];
                self.copy_kv(c, names, layer, src, dst, r * row)?;
            }
            if self.cfg.sanitize {
                // Nothing may read the forgotten rows: the host blocks' and the buffer's
                // (a window's ring: only the buffer's, its blocks wrap).
                let block_at = |b: usize| self.host_base[layer] + b * bs * row;
                let host = block_at(block) + r * row;
                let stored = match self.window[layer] {
                    None => block_at(self.seq_len.div_ceil(bs)),
                    Some(_) => host,
                };
                let dbuf = self.dbuf_at(layer) + r * row;
                for (m, off, len) in [
                    (self.host, host, stored.saturating_sub(host)),
                    (self.dbuf, dbuf, (bs - r) * row),
                ] {
                    for mem in [m.k, m.v].into_iter().filter(|_| len > 0) {
                        self.d.poison(c, Span { mem, off, len })?;
                    }
                }
            }
        }
        self.seq_len = len;
        self.step = Step::Idle;
        Ok(())
    }

    /// Tokens one request may hold: the smaller of the ring slot and the host KV.
    fn capacity(&self) -> usize {
        self.cfg
            .max_model_len
            .min(self.plan.num_cpu_blocks * self.cfg.block_size)
    }

    fn begin_step(&mut self, pos0: usize, tokens: usize) -> Result<()> {
        let cap = self.capacity();
        if pos0 + tokens > cap {
            bail!(
                "offload KV is full: {} tokens need {} blocks of {}, the engine holds {} tokens (raise --max-model-len or --num-cpu-blocks)",
                pos0 + tokens,
                (pos0 + tokens).div_ceil(self.cfg.block_size),
                self.cfg.block_size,
                cap
            );
        }
        if pos0 != self.seq_len {
            bail!("offload engine: a step must continue the stored context (got {tokens} tokens at position {pos0}, {} stored; truncate first to rewind)", self.seq_len);
        }
        let all = std::mem::take(&mut self.attend_all);
        self.step = if tokens == 1 && pos0 > 0 && !all {
            Step::Decode { pos: pos0 }
        } else {
            Step::Prefill { pos: pos0, tokens }
        };
        if pos0 > 0 {
            let all = matches!(self.step, Step::Prefill { .. });
            if all && self.ahead > 0 && self.sparse.is_some() {
                // The previous step's tail prefetched a sparse decode step's pages.
                self.drain()?;
            }
            // Layers not already prefetched during the previous step's tail.
            for layer in self.ahead..self.depth {
                self.prefetch_layer(layer, pos0, false, all)?;
            }
        }
        self.ahead = 0;
        Ok(())
    }

    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot<D::Elem>> {
        let c = StreamRole::Compute;
        let bs = self.cfg.block_size;
        let r = |pos: usize| pos % bs;
        let s = match self.step {
            Step::Prefill { pos: 0, .. } => {
                let (s, after) = self.state.begin_prefill_compute(layer)?;
                self.wait_released(c, s, after)?;
                s
            }
            Step::Prefill { pos, .. } => {
                let s = self.begin_prefetched(layer, true)?;
                self.append_window(layer, s, pos, pos - r(pos))?;
                s
            }
            Step::Decode { pos } => {
                let s = self.begin_prefetched(layer, false)?;
                // Append the partial block so the attention sees one contiguous context
                // (sparse: after the compacted pages, once `select` has moved the
                // prefetched pages there: a margin page may sit where the window goes).
                let sparse_layer = self.sparse_layer(layer);
                match self.sparse.as_mut().filter(|_| sparse_layer) {
                    None => self.append_window(layer, s, pos, pos - r(pos))?,
                    Some(sp) => sp.selected = false,
                }
                s
            }
            Step::Idle => bail!("offload engine: begin_layer outside a step"),
        };
        self.d.layer_begin(layer)?;
        Ok(LayerSlot {
            k: self.d.ptr(self.ring[s].k),
            v: self.d.ptr(self.ring[s].v),
            rows: self.plan.slot_tokens,
            ring: false,
        })
    }

    fn end_layer(&mut self, layer: usize) -> Result<()> {
        let s = self.state.slot_of(layer);
        self.d.layer_end(layer)?;
        match self.step {
            Step::Prefill { pos, tokens } => {
                let end = pos + tokens;
                self.declare_compute(layer, s, end)?;
                self.state.end_compute(layer)?;
                // Sparse: the bounds of the pages of the blocks the step filled, before the
                // slot is released.
                let bs = self.cfg.block_size;
                let (first, full) = (pos / bs * bs, end / bs * bs);
                let keys = (self.ring[s].k, first * self.row);
                self.queue_bounds(layer, keys, first, full - first)?;
                self.rank_for_first_step(layer, end)?;
                self.d
                    .record(StreamRole::Compute, self.slots[s].compute_done)?;
                self.offload_rows(layer, s, pos, end)?;
                self.prefetch_after(layer, end)
            }
            Step::Decode { pos } => {
                self.store_decoded(layer, s, pos)?;
                self.prefetch_after(layer, pos + 1)
            }
            Step::Idle => bail!("offload engine: end_layer outside a step"),
        }
    }

    fn attend_all_next_step(&mut self) {
        self.attend_all = true;
    }

    fn select_rows(&mut self, layer: usize, query: Query<D::Elem>) -> Result<Option<NewRow>> {
        if !self.sparse_layer(layer) {
            return Ok(None);
        }
        match (self.step, &mut self.sparse) {
            (Step::Decode { pos }, Some(_)) => self.select(layer, pos, query).map(Some),
            // The prompt's last token's query, scored once this layer's keys are stored.
            (Step::Prefill { .. }, Some(sp)) => {
                let dst = Span {
                    mem: sp.last_query,
                    off: 0,
                    len: sp.heads.num_heads * sp.heads.head_dim,
                };
                self.d.copy_query(query, dst)?;
                self.sparse.as_mut().expect("sparse").query_kept = true;
                Ok(None)
            }
            _ => Ok(None),
        }
    }

    fn layer_state(&mut self, layer: usize, slot: usize) -> Result<crate::kv::StateSlot> {
        self.states.layer(layer, slot)
    }

    fn begin_state(&mut self, slot: usize, pos0: usize, tokens: usize) -> Result<()> {
        self.states.begin_step(slot, pos0, tokens)
    }
}

/// What a session asks of an offload engine besides the KV seam, whatever its element type.
pub trait OffloadControl {
    fn plan(&self) -> MemoryPlan;
    /// Traces every copy and layer from now on.
    fn set_tracing(&mut self, on: bool) -> Result<()>;
    /// The ops traced so far (waits for them).
    fn take_trace(&mut self) -> Result<Vec<TraceEvent>>;
    /// Sparse decode's prefetch hits and misses since the last reset.
    fn sparse_stats(&self) -> Option<SparseStats>;
}

/// An offload engine behind the KV seam, whatever its device: what a session holds.
pub trait OffloadKv<T>: KvCache<T> + OffloadControl {}

impl<T, E: KvCache<T> + OffloadControl> OffloadKv<T> for E {}

impl<D: OffloadDevice> OffloadControl for OffloadEngine<D> {
    fn plan(&self) -> MemoryPlan {
        self.plan
    }

    fn set_tracing(&mut self, on: bool) -> Result<()> {
        self.d.set_tracing(on)
    }

    fn take_trace(&mut self) -> Result<Vec<TraceEvent>> {
        self.d.take_trace()
    }

    fn sparse_stats(&self) -> Option<SparseStats> {
        self.sparse.as_ref().map(|sp| sp.stats)
    }
}

impl<D: OffloadDevice> Drop for OffloadEngine<D> {
    fn drop(&mut self) {
        let _ = self.d.sync_all();
    }
}
