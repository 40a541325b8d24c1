//! The CUDA model's batched forward over a page pool (the serving path): every scheduled
//! sequence's rows in one step, each sequence storing into and attending over its own
//! pages. Batch-invariant by construction: the fixed-order GEMM (`ops::gemm_fixed`), and
//! every row its own query through the flash-decoding kernel with its fixed split, so a
//! row's arithmetic never depends on what else is in the batch, how its prompt was
//! chunked, or whether it is a decode token or a recomputed one.

use super::{CudaModel, Gemm, SeqRows, StepAttn, StepPlan, WindowRows};
use crate::device::cuda::exec::GrowBuf;
use crate::device::cuda::ops::{self, DecodeScratch, GemmOut, GemmShape, PagedAttn};
use crate::device::DevPtr;
use crate::model::{check_batch, BatchSeq, PagePool};
use anyhow::{bail, Result};
use half::bf16;

/// Per-step buffers of the batched forward and of the verify step (`forward_rows`, its
/// own layout of `meta`), grown as steps grow.
#[derive(Default)]
pub(super) struct BatchBufs {
    meta: GrowBuf<i32>, // i32 [ids: t | pos: t | cache rows: t | ctx lens: t | want: r | tables: t × max_blocks | (window pool) window cache rows: t | window tables: t × max_blocks]
    part_o: GrowBuf<f32>, // f32 [t, num_heads, splits, head_dim]
    part_ml: GrowBuf<f32>, // f32 [t, num_heads, splits, 2]
    last: GrowBuf<bf16>, // bf16 [r, hidden]: the rows whose logits are wanted
    pub(super) logits: GrowBuf<f32>, // f32 [r, vocab]
}

/// The host side of one step's metadata, row by row.
#[derive(Default)]
struct RowMeta {
    ids: Vec<i32>,
    pos: Vec<i32>,
    cache_rows: Vec<i32>, // pool row of the token's K/V: page · block_size + pos % block_size
    ctx_lens: Vec<i32>,   // keys the row attends: its position + 1
    want: Vec<i32>,       // rows whose logits are wanted (`WantLogits::rows`), in order
    tables: Vec<i32>,     // [rows, max_blocks]: the row's sequence's pages, 0-padded
    window_rows: Vec<i32>, // [rows] (window pool) as `cache_rows`, in the window pool
    window_tables: Vec<i32>, // [rows, max_blocks] (window pool) as `tables`
}

impl RowMeta {
    fn build(seqs: &[BatchSeq<'_>], block_size: usize) -> (Self, usize) {
        let max_blocks = seqs.iter().map(|s| s.pages.len()).max().unwrap_or(1).max(1);
        let mut m = Self::default();
        // Pool row of position `p` through a table, and the table as a 0-padded row.
        let row = |table: &[u32], p: usize| {
            (table[p / block_size] as usize * block_size + p % block_size) as i32
        };
        fn padded(table: &[u32], max_blocks: usize) -> impl Iterator<Item = i32> + '_ {
            let pad = std::iter::repeat_n(0, max_blocks - table.len());
            table.iter().map(|&pg| pg as i32).chain(pad)
        }
        for s in seqs {
            for (j, &id) in s.tokens.iter().enumerate() {
                let p = s.pos0 + j;
                m.ids.push(id as i32);
                m.pos.push(p as i32);
                m.cache_rows.push(row(s.pages, p));
                m.ctx_lens.push(p as i32 + 1);
                m.tables.extend(padded(s.pages, max_blocks));
                if !s.window_pages.is_empty() {
                    m.window_rows.push(row(s.window_pages, p));
                    m.window_tables.extend(padded(s.window_pages, max_blocks));
                }
            }
            let row0 = m.ids.len() - s.tokens.len();
            m.want
                .extend(s.logits.rows(s.tokens.len()).map(|r| (row0 + r) as i32));
        }
        (m, max_blocks)
    }
}

impl CudaModel {
    /// One forward over a batch of sequences (decode rows and prefill chunks alike) over
    /// `pool`'s pages; the logits `[rows, vocab]` each sequence asked for (`WantLogits`).
    /// Each sequence's logits are bitwise the same whatever else is in the batch.
    pub fn forward_batch(
        &mut self,
        seqs: &[BatchSeq<'_>],
        pool: &mut dyn PagePool<bf16>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let c = self.cfg.clone();
        let bs = pool.block_size();
        check_batch(&c, seqs, pool)?;
        let max_ctx = seqs.iter().map(|s| s.pos0 + s.tokens.len()).max();
        let max_ctx = max_ctx.expect("check_batch: not empty");
        if max_ctx > self.max_pos {
            bail!(
                "position {max_ctx} is past the {} positions this CUDA model was built for",
                self.max_pos
            );
        }
        let (m, max_blocks) = RowMeta::build(seqs, bs);
        let (t, r) = (m.ids.len(), m.want.len());
        pool.begin_step(0, t)?;
        self.ensure_acts(t)?;
        // Metadata in one upload; its parts by offset.
        let mut meta = Vec::with_capacity(4 * t + r + m.tables.len());
        for part in [
            &m.ids,
            &m.pos,
            &m.cache_rows,
            &m.ctx_lens,
            &m.want,
            &m.tables,
            &m.window_rows,
            &m.window_tables,
        ] {
            meta.extend_from_slice(part);
        }
        let meta_d = self.upload_meta(&meta)?;
        let at = |i: usize| meta_d.at(i * t);
        let (ids, pos, cache_rows, ctx_lens) = (at(0), at(1), at(2), at(3));
        let (want, tables) = (at(4), meta_d.at(4 * t + r));
        let window_at = 4 * t + r + m.tables.len();
        let window = (pool.num_window_pages().is_some()).then(|| WindowRows {
            cache_rows: meta_d.at(window_at),
            tables: meta_d.at(window_at + t),
        });
        let (nh, hd) = (c.num_heads, c.head_dim);
        let scratch = self.rows_scratch(t, max_ctx)?;
        let a = self.acts.as_ref().expect("allocated above");
        let mut row0 = 0;
        let seq_rows = seqs
            .iter()
            .map(|s| {
                let r = SeqRows {
                    row0,
                    tokens: s.tokens.len(),
                    pos0: s.pos0,
                    state_slot: s.state_slot,
                };
                row0 += r.tokens;
                r
            })
            .collect();
        let step = StepPlan {
            rows: t,
            pos,
            cache_rows,
            gemm: Gemm::BatchInvariant,
            window,
            seqs: seq_rows,
            attn: StepAttn::PerRow(
                PagedAttn {
                    q: a.qkv,
                    k: DevPtr::from_addr(0), // the layer's pool
                    v: DevPtr::from_addr(0),
                    out: a.attn,
                    cu_seqlens: DevPtr::from_addr(0), // unused by the decode kernel
                    ctx_lens,
                    tables,
                    max_blocks,
                    block_size: bs,
                    num_heads: nh,
                    num_kv_heads: c.num_kv_heads,
                    q_stride: c.attn_qkv_dim(),
                    head_dim: hd,
                    batch: t,
                    max_q_len: 1,
                    max_ctx,
                    scale: c.attn_scale,
                    window: None, // the layer's
                    sinks: None,  // the layer's
                },
                scratch,
            ),
        };
        self.embed(ids, t)?;
        self.layers(&step, pool)?;
        let mut logits = self.head_rows(want, r)?.into_iter();
        Ok(seqs
            .iter()
            .map(|s| {
                let n = s.logits.rows(s.tokens.len()).len();
                (n > 0).then(|| logits.by_ref().take(n).flatten().collect())
            })
            .collect())
    }

    /// A step's i32 metadata uploaded into the batch buffer (pageable: the driver stages
    /// it before returning); where it is.
    pub(super) fn upload_meta(&mut self, meta: &[i32]) -> Result<DevPtr<i32>> {
        let exec = &*self.exec;
        let meta_d = self.batch.meta.ensure(exec, meta.len())?;
        // SAFETY: the buffer holds `meta.len()` i32.
        unsafe { super::htod_i32(exec, meta_d, meta)? };
        Ok(meta_d)
    }

    /// Flash-decoding partials for `rows` queries over at most `max_ctx` keys.
    pub(super) fn rows_scratch(&mut self, rows: usize, max_ctx: usize) -> Result<DecodeScratch> {
        let exec = &*self.exec;
        let (nh, hd) = (self.cfg.num_heads, self.cfg.head_dim);
        let splits = max_ctx.div_ceil(self.scratch.split_len);
        Ok(DecodeScratch {
            part_o: self.batch.part_o.ensure(exec, rows * nh * splits * hd)?,
            part_ml: self.batch.part_ml.ensure(exec, rows * nh * splits * 2)?,
            split_len: self.scratch.split_len,
            max_splits: splits,
        })
    }

    /// Logits `[vocab]` of the `r` rows of `a.hn` listed at `want`: gathered into one
    /// `[r, hidden]` block, one batch-invariant GEMM, one download.
    fn head_rows(&mut self, want: DevPtr<i32>, r: usize) -> Result<Vec<Vec<f32>>> {
        if r == 0 {
            return Ok(Vec::new());
        }
        let c = &self.cfg;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let exec = &*self.exec;
        let last = self.batch.last.ensure(exec, r * h)?;
        let out = self.batch.logits.ensure(exec, r * vocab)?;
        let a = self.acts.as_ref().expect("allocated by forward_batch");
        self.range("lm_head");
        // The embedding gather, with the activations as its table: last[i] = hn[want[i]]
        // (scale 1: an exact copy).
        exec.launch(&ops::embedding(a.hn, want, last, r, a.rows, h, 1.0))?;
        let shape = GemmShape {
            m: r,
            k: h,
            n: vocab,
        };
        self.gemm(
            Gemm::BatchInvariant,
            last,
            self.w.lm_head(),
            GemmOut::F32(out),
            shape,
        )?;
        self.pop();
        self.download_logits(out, r)
    }
}
