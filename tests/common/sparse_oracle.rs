//! The oracle of a small-budget sparse decode step, on any KV element (f32 for the CPU
//! model, bf16 for the CUDA model on the kernel emulator, whose device memory is host
//! memory): every layer resident, and at each decode step the chosen pages and the
//! window copied into a scratch slot in position order, chosen by the host references in
//! `strata::sparse` (no prefetch, no prediction, no misses, no kernels). The offload
//! engine must give the same bits.

use strata::device::cpu::ops::AttnHeads;
use strata::device::DevPtr;
use strata::kv::{KvCache, LayerSlot, NewRow, Query};
use strata::model::ModelConfig;
use strata::sparse::{self, KvElem, SparseConfig};

pub struct Oracle<T> {
    sc: SparseConfig,
    bs: usize,
    row: usize,
    heads: AttnHeads,
    k: Vec<Vec<T>>, // [layers][cap · row]
    v: Vec<Vec<T>>,
    scratch: (Vec<T>, Vec<T>), // [cap · row] each: the compacted slot of a decode step
    pos: usize,
    decode: bool,
    new_row: usize,
}

impl<T: KvElem + Default> Oracle<T> {
    pub fn new(c: &ModelConfig, sc: SparseConfig, block_size: usize, cap: usize) -> Self {
        let row = c.kv_dim();
        let zeros = || vec![T::default(); cap * row];
        Self {
            sc,
            bs: block_size,
            row,
            heads: AttnHeads {
                num_heads: c.num_heads,
                num_kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
            },
            k: (0..c.num_layers).map(|_| zeros()).collect(),
            v: (0..c.num_layers).map(|_| zeros()).collect(),
            scratch: (zeros(), zeros()),
            pos: 0,
            decode: false,
            new_row: 0,
        }
    }
}

fn ptr<T>(v: &mut [T]) -> DevPtr<T> {
    DevPtr::from_addr(v.as_mut_ptr() as u64)
}

// SAFETY: the model's compute runs on the calling thread (the CPU model, the emulator),
// so every slot row is written by nothing but the step it was handed to.
unsafe impl<T: KvElem + Default> KvCache<T> for Oracle<T> {
    fn reset(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
    fn capacity(&self) -> usize {
        self.scratch.0.len() / self.row
    }
    fn begin_step(&mut self, pos0: usize, tokens: usize) -> anyhow::Result<()> {
        (self.pos, self.decode) = (pos0, tokens == 1 && pos0 > 0);
        Ok(())
    }
    fn begin_layer(&mut self, l: usize) -> anyhow::Result<LayerSlot<T>> {
        let (k, v) = if self.decode {
            (&mut self.scratch.0, &mut self.scratch.1)
        } else {
            (&mut self.k[l], &mut self.v[l])
        };
        Ok(LayerSlot {
            rows: k.len() / self.row,
            k: ptr(k),
            v: ptr(v),
        })
    }
    fn end_layer(&mut self, l: usize) -> anyhow::Result<()> {
        if self.decode {
            let (r, p) = (self.new_row * self.row, self.pos * self.row);
            self.k[l][p..p + self.row].copy_from_slice(&self.scratch.0[r..r + self.row]);
            self.v[l][p..p + self.row].copy_from_slice(&self.scratch.1[r..r + self.row]);
        }
        Ok(())
    }
    fn select_rows(&mut self, l: usize, q: Query<T>) -> anyhow::Result<Option<NewRow>> {
        if !self.decode {
            return Ok(None);
        }
        let (row, ps) = (self.row, self.sc.page_size);
        let (cands, count) = self.sc.slot_pages(self.pos, self.bs);
        let mut meta = vec![T::default(); cands * self.sc.meta_rows() * row];
        sparse::page_bounds(&self.k[l][..cands * ps * row], row, ps, &mut meta);
        // SAFETY: the model's query, host memory valid for this call.
        let q = unsafe { std::slice::from_raw_parts(q.ptr.as_host_ptr(), q.len) };
        let q = &q[..self.heads.num_heads * self.heads.head_dim];
        let per_head = sparse::head_bounds(q, &meta, self.heads, cands, ps);
        let ranked = sparse::rank_pages(&per_head, self.heads, cands, count - 1);
        let chosen = sparse::choose(&ranked, cands, count - 1);
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
