//! `Replay`: sparse decode's selection on an all-resident cache, for evaluation and as the
//! tests' oracle. Every layer's KV stays in host memory; at each decode step the chosen
//! pages and the recent window are copied into a scratch slot in position order, chosen by
//! the host references of this module's parent (`page_bounds`, `head_bounds`,
//! `rank_pages`, `choose`), exactly as the offload engine chooses them, minus prefetch,
//! prediction and misses, which change which copies run but never which rows are attended
//! (`tests/sparse.rs` and `tests/cuda_sparse.rs` check the engine against it, bit for bit).
//! As in the engine, only full-attention layers select: a sliding-window layer attends its
//! window exactly, from its own rows.
//!
//! Why it exists beside the engine: one prefill can be decoded several ways. Decode only
//! writes positions at and after the prompt's end, so `rewind` to the prompt length and a
//! new budget replay the same prompt at another budget (or with full attention) without
//! prefilling again: `bench sparse-eval` prefills each case once instead of once per
//! budget, a third of the time at two budgets on a CPU.

use anyhow::{bail, Result};

use super::SparseConfig;
use crate::device::cpu::ops::AttnHeads;
use crate::device::DevPtr;
use crate::device::KvElem;
use crate::kv::{KvCache, LayerSlot, NewRow, Query};
use crate::model::ModelConfig;

pub struct Replay<T> {
    sc: SparseConfig,
    /// Full attention instead: the slot is the layer's whole KV, as a resident cache's.
    full: bool,
    /// The next step only attends every position (`KvCache::attend_all_next_step`).
    attend_all: bool,
    bs: usize,
    row: usize,
    heads: AttnHeads,
    /// Per layer: a sliding-window layer, which never selects.
    windowed: Vec<bool>,
    k: Vec<Vec<T>>, // [layers][cap · row]
    v: Vec<Vec<T>>,
    /// Per layer: page metadata of its first `meta_pages[l]` pages (`page_bounds`), kept
    /// across steps: a full page never changes until `rewind` cuts into it.
    meta: Vec<Vec<T>>,
    meta_pages: Vec<usize>,
    scratch: (Vec<T>, Vec<T>), // [cap · row] each: the compacted slot of a decode step
    pos: usize,
    decode: bool,
    new_row: usize,
}

impl<T: KvElem + Default> Replay<T> {
    /// Room for `cap` tokens, sparse with `sc` (`set_sparse` changes it).
    pub fn new(c: &ModelConfig, sc: SparseConfig, block_size: usize, cap: usize) -> Self {
        let row = c.kv_dim();
        let zeros = || vec![T::default(); cap * row];
        Self {
            sc,
            full: false,
            attend_all: false,
            bs: block_size,
            row,
            heads: AttnHeads::causal(c.num_heads, c.num_kv_heads, c.head_dim),
            windowed: (0..c.num_layers).map(|l| c.window(l).is_some()).collect(),
            k: (0..c.num_layers).map(|_| zeros()).collect(),
            v: (0..c.num_layers).map(|_| zeros()).collect(),
            meta: vec![Vec::new(); c.num_layers],
            meta_pages: vec![0; c.num_layers],
            scratch: (zeros(), zeros()),
            pos: 0,
            decode: false,
            new_row: 0,
        }
    }

    /// The next decode steps attend with `sc` (checked against the block size), or every
    /// position (`None`).
    pub fn set_sparse(&mut self, sc: Option<SparseConfig>) -> Result<()> {
        match sc {
            None => self.full = true,
            Some(sc) => {
                sc.check(self.bs)?;
                if sc.page_size != self.sc.page_size {
                    self.meta_pages.fill(0); // metadata is per page size
                }
                (self.sc, self.full) = (sc, false);
            }
        }
        Ok(())
    }

    /// Forgets every position from `len` on: the next step may be a decode step at `len`
    /// (the prompt's positions, `0..len`, stay as the prefill left them, and so does the
    /// metadata of the pages within them).
    pub fn rewind(&mut self, len: usize) -> Result<()> {
        if len > self.capacity() {
            bail!(
                "rewind to {len} beyond the cache's {} tokens",
                self.capacity()
            );
        }
        let whole = len / self.sc.page_size;
        for n in &mut self.meta_pages {
            *n = (*n).min(whole);
        }
        Ok(())
    }
}

impl<T> Replay<T> {
    /// Whether layer `l` attends selected rows this step: a sparse decode step, and a
    /// full-attention layer.
    fn selects(&self, l: usize) -> bool {
        self.decode && !self.windowed[l]
    }
}

fn ptr<T>(v: &mut [T]) -> DevPtr<T> {
    DevPtr::from_addr(v.as_mut_ptr() as u64)
}

// SAFETY: the model's compute runs on the calling thread (the CPU model, the emulator),
// so every slot row is written by nothing but the step it was handed to.
unsafe impl<T: KvElem + Default> KvCache<T> for Replay<T> {
    fn reset(&mut self) -> Result<()> {
        self.meta_pages.fill(0);
        self.attend_all = false;
        Ok(())
    }
    fn capacity(&self) -> usize {
        self.scratch.0.len() / self.row
    }
    fn begin_step(&mut self, pos0: usize, tokens: usize) -> Result<()> {
        if pos0 + tokens > self.capacity() {
            bail!(
                "KV cache full: {} tokens needed, room for {}",
                pos0 + tokens,
                self.capacity()
            );
        }
        if pos0 == 0 {
            self.meta_pages.fill(0); // a new prompt
        }
        let all = std::mem::take(&mut self.attend_all);
        (self.pos, self.decode) = (pos0, tokens == 1 && pos0 > 0 && !self.full && !all);
        Ok(())
    }
    fn begin_layer(&mut self, l: usize) -> Result<LayerSlot<T>> {
        let (k, v) = if self.selects(l) {
            (&mut self.scratch.0, &mut self.scratch.1)
        } else {
            (&mut self.k[l], &mut self.v[l])
        };
        Ok(LayerSlot {
            rows: k.len() / self.row,
            ring: false,
            k: ptr(k),
            v: ptr(v),
        })
    }
    fn end_layer(&mut self, l: usize) -> Result<()> {
        if self.selects(l) {
            let (r, p) = (self.new_row * self.row, self.pos * self.row);
            self.k[l][p..p + self.row].copy_from_slice(&self.scratch.0[r..r + self.row]);
            self.v[l][p..p + self.row].copy_from_slice(&self.scratch.1[r..r + self.row]);
        }
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.rewind(len)
    }
    fn attend_all_next_step(&mut self) {
        self.attend_all = true;
    }
    fn select_rows(&mut self, l: usize, q: Query<T>) -> Result<Option<NewRow>> {
        if !self.selects(l) {
            return Ok(None);
        }
        let (row, ps, rows) = (self.row, self.sc.page_size, self.sc.meta_rows());
        let (cands, count) = self.sc.slot_pages(self.pos, self.bs);
        // Metadata of the pages that became full since it was last computed.
        let done = self.meta_pages[l].min(cands);
        let meta = &mut self.meta[l];
        meta.resize(cands * rows * row, T::default());
        super::page_bounds(
            &self.k[l][done * ps * row..cands * ps * row],
            row,
            ps,
            &mut meta[done * rows * row..],
        );
        self.meta_pages[l] = cands;
        // SAFETY: the model's query, host memory valid for this call.
        let q = unsafe { std::slice::from_raw_parts(q.ptr.as_host_ptr(), q.len) };
        let q = &q[..self.heads.num_heads * self.heads.head_dim];
        let per_head = super::head_bounds(q, meta, self.heads, cands, ps);
        let ranked = super::rank_pages(&per_head, self.heads, cands, count - 1);
        let chosen = super::choose(&ranked, cands, count - 1);
        let mut at = 0;
        let window = (cands * ps..self.pos).map(|t| t * row);
        let pages = chosen
            .iter()
            .flat_map(|&p| (0..ps).map(move |i| (p as usize * ps + i) * row));
        for src in pages.chain(window) {
            self.scratch.0[at..at + row].copy_from_slice(&self.k[l][src..src + row]);
            self.scratch.1[at..at + row].copy_from_slice(&self.v[l][src..src + row]);
            at += row;
        }
        self.new_row = at / row;
        Ok(Some(NewRow(self.new_row)))
    }
}
