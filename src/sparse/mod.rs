//! Sparse decode over offloaded KV (issue #15): per layer and decode step, attention runs
//! over the sink page, the highest-scoring pages up to the budget and the recent window
//! (the decode buffer); only the chosen pages cross the link. See docs/offload.md,
//! "Sparse decode", for the decisions.
//!
//! Everything here is host code and the reference of the CUDA selection kernel
//! (`kernels/sparse.cu`): page metadata (channel-wise min and max of K, and each key's
//! box within them), the upper bound of a page's attention score it gives, the
//! selection, and the plan of copies that turns the pages a slot was prefetched with into
//! the selected pages in position order.

use anyhow::Result;

use crate::device::cpu::ops::AttnHeads;
use crate::device::KvElem;

pub mod eval;
pub mod replay;
mod row_fold;

/// Default tokens per page: 16 (Quest's default). With each key's box in the metadata a
/// page's bound is per key, so larger pages lose little recall (both 8,160-token needles
/// Quest's bound lost at page 8 are found at 16) and cost less: metadata of
/// `meta_rows(16)` = 4 rows per 16 tokens (1/8 of the KV bytes in bf16, 1/4 at page 8),
/// half the pages to score and to copy, in longer runs. Measured in docs/benchmarks.md.
pub const DEFAULT_PAGE_SIZE: usize = 16;

/// `--sparse-budget` and `--sparse-page-size`, shared by `strata generate`, `needle` and
/// (budget as a list) `strata bench offload`.
#[derive(Debug, Clone, clap::Args)]
pub struct SparseArgs {
    /// Sparse decode (with --enable-offload): KV tokens each layer attends and loads per
    /// decode step: the sink page, the best pages by their bound, the recent window (the
    /// partial last block). A multiple of --sparse-page-size, at least page + --block-size.
    #[arg(long, value_parser = crate::flags::tokens())]
    pub sparse_budget: Option<usize>,
    /// Tokens per sparse page (divides --block-size). 8 stays closer to full attention
    /// (per-step KL 0.25–0.8 of 16's on RULER tuning cases, docs/benchmarks.md)
    /// for twice the page metadata in device memory, twice the pages to score and more
    /// misses: on the CPU device it costs the whole speed-up.
    #[arg(long, default_value_t = DEFAULT_PAGE_SIZE, value_parser = crate::flags::block_size())]
    pub sparse_page_size: usize,
    /// Verified sparse decode (with --sparse-budget): sparse decode drafts this many
    /// tokens, then one step attending the whole context keeps those full attention would
    /// choose and replaces the first it would not (sampled: speculative sampling). Greedy,
    /// the output is full attention's token for token; sampled, distributed as its. One
    /// full load of the KV per round instead of per token (docs/offload.md, "Verified
    /// sparse decode").
    #[arg(long, value_name = "DRAFTS")]
    pub sparse_verify: Option<usize>,
}

impl SparseArgs {
    /// The setting, refusing it without offload (the flags only shape what offload loads).
    pub fn config(&self, offload: bool) -> Result<Option<SparseConfig>> {
        match self.sparse_budget {
            None => Ok(None),
            Some(_) if !offload => Err(crate::errors::usage(
                "--sparse-budget selects which offloaded KV pages to load: add --enable-offload",
            )),
            Some(budget) => Ok(Some(SparseConfig {
                budget,
                page_size: self.sparse_page_size,
            })),
        }
    }

    /// Drafts per verified round (`--sparse-verify`), refused without sparse decode.
    pub fn verify(&self) -> Result<Option<usize>> {
        match (self.sparse_verify, self.sparse_budget) {
            (None, _) => Ok(None),
            (Some(_), None) => Err(crate::errors::usage(
                "--sparse-verify checks sparse decode's tokens: add --sparse-budget",
            )),
            (Some(k), Some(_)) => crate::engine::verified::check_draft_len(k).map(|()| Some(k)),
        }
    }
}

/// `--sparse-budget` / `--sparse-page-size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseConfig {
    /// Past KV tokens one layer attends per decode step (the new token excluded): the
    /// recent window (the decode buffer, under one host block), the sink page and the best
    /// pages by score in the rest.
    pub budget: usize,
    /// Tokens per page: the unit of selection and of metadata.
    pub page_size: usize,
}

impl SparseConfig {
    /// Errors unless the budget and page size fit `block_size` (the recent window is the
    /// decode buffer, up to a block): the page size divides the block, the budget is a
    /// whole number of pages holding at least the sink page and a full window.
    pub fn check(&self, block_size: usize) -> Result<()> {
        let (b, p) = (self.budget, self.page_size);
        if p == 0 {
            return Err(crate::errors::usage(
                "--sparse-page-size must be at least 1",
            ));
        }
        if !block_size.is_multiple_of(p) {
            return Err(crate::errors::usage(format!("--sparse-page-size {p} must divide --block-size {block_size} (pages are cut from host blocks)")));
        }
        if b == 0 || !b.is_multiple_of(p) {
            return Err(crate::errors::usage(format!(
                "--sparse-budget {b} must be a positive multiple of --sparse-page-size {p}"
            )));
        }
        if b < p + block_size {
            return Err(crate::errors::usage(format!(
                "--sparse-budget {b} is below the sink page plus the recent window: at least {} tokens ({p} + --block-size {block_size})",
                p + block_size
            )));
        }
        Ok(())
    }

    /// Rows of metadata per page (`meta_rows`).
    pub fn meta_rows(&self) -> usize {
        meta_rows(self.page_size)
    }

    /// Pages `0..candidates` (the full host blocks') a decode step at `pos` may attend,
    /// and how many of them the compacted slot holds: the budget less the recent window
    /// (`pos % block_size` tokens in the decode buffer), in whole pages, sink included. A
    /// budget ≥ `pos` holds every page: the full path's rows, bit for bit.
    pub fn slot_pages(&self, pos: usize, block_size: usize) -> (usize, usize) {
        let window = pos % block_size;
        let candidates = (pos - window) / self.page_size;
        let room = (self.budget - window) / self.page_size; // >= 1: budget >= page + block
        (candidates, candidates.min(room))
    }
}

/// Tokens one mask row covers (the bits of a bf16 element).
pub const MASK_TOKENS: usize = 16;

/// Bits per key and channel that pin the key to a box inside its page's `[min, max]`:
/// each bit halves the box (`key_box`). 1 was the halves bound (issue #15); 2, the
/// quarters, keeps what the true per-page maximum of `q · k` keeps on the RULER tuning
/// cases where the halves bound lost needles (docs/benchmarks.md, issue #32), for one
/// more metadata row per 16 tokens and about twice the CPU scoring work.
pub const KEY_BITS: usize = 2;

/// Boxes a channel's range is cut into: `2^KEY_BITS`.
pub const BOXES: usize = 1 << KEY_BITS;

/// Rows of metadata per page, each `row` (= kv_dim) elements: the channel-wise min of K,
/// the max, then `KEY_BITS` **mask planes** of `⌈page_size / 16⌉` rows each: bit `t % 16`
/// of row `2 + b · ⌈page_size / 16⌉ + t / 16` is key `t`'s bit `b` in that channel, the
/// `b`-th halving of `key_box` (plane 0: the upper half of `[min, max]`, as the halves
/// mask was; plane 1: the upper half of that half, …). The planes pin each key to one of
/// `BOXES` boxes of its page's range per channel, so the bound is per key, not per page.
pub fn meta_rows(page_size: usize) -> usize {
    2 + KEY_BITS * page_size.div_ceil(MASK_TOKENS)
}

/// The split between a channel's lower and upper half, in f32: `lo + (hi − lo) / 2`,
/// never above `hi` (rounding, or an infinite range).
pub fn mid(lo: f32, hi: f32) -> f32 {
    let m = lo + (hi - lo) * 0.5;
    if m > hi {
        hi
    } else {
        m
    }
}

/// The edges of a channel's `BOXES` boxes: `[min, …, max]`, box `j` = `[edges[j],
/// edges[j + 1]]`, each inner edge the `mid` of the two edges around it (the split of the
/// halving that made it): the first halving splits `[min, max]` at `edges[BOXES / 2]`,
/// the next each half at its middle, and so on. `key_box` descends the same halvings, so
/// it reads the same splits.
pub fn box_edges(min: f32, max: f32) -> [f32; BOXES + 1] {
    let mut e = [0.0f32; BOXES + 1];
    box_edges_of_row(&[min], &[max], &mut e);
    e
}

/// `box_edges` of every channel of a row at once: `min[n]`, `max[n]` → `edges[BOXES + 1,
/// n]`, the same operations channel by channel, in loops over the channels the compiler
/// vectorises (the scoring computes a page's edges for every KV head).
#[inline(always)]
pub fn box_edges_of_row(min: &[f32], max: &[f32], edges: &mut [f32]) {
    let n = min.len();
    assert!(
        max.len() == n && edges.len() == (BOXES + 1) * n,
        "edges [BOXES + 1, n]"
    );
    edges[..n].copy_from_slice(min);
    edges[BOXES * n..].copy_from_slice(max);
    let mut step = BOXES / 2;
    while step > 0 {
        for a in (0..BOXES).step_by(2 * step) {
            let (lower, upper) = edges.split_at_mut((a + step) * n);
            let (mids, upper) = upper.split_at_mut(n);
            let (lo, hi) = (&lower[a * n..][..n], &upper[(step - 1) * n..][..n]);
            for ((m, &lo), &hi) in mids.iter_mut().zip(lo).zip(hi) {
                *m = mid(lo, hi);
            }
        }
        step /= 2;
    }
}

/// The box of `edges` (`box_edges`) key value `x` is pinned to: `KEY_BITS` halvings from
/// `[min, max]`, each taking the upper half when `x ≥` its split. Bit `b` of the index
/// from the top (`j >> (KEY_BITS − 1 − b)`) is halving `b`'s choice, mask plane `b`'s bit.
/// The box holds `x` whenever `min ≤ x ≤ max`.
pub fn key_box(edges: &[f32; BOXES + 1], x: f32) -> usize {
    let (mut lo, mut hi) = (0, BOXES);
    while hi - lo > 1 {
        let m = (lo + hi) / 2;
        if x >= edges[m] {
            lo = m;
        } else {
            hi = m;
        }
    }
    lo
}

/// Page metadata of each page of `keys`: `keys[pages · page_size, row]` →
/// `meta[pages, meta_rows(page_size), row]` (min row, max row, the mask planes; see
/// `meta_rows`). `row` = kv_heads · head_dim, so each KV head's channels get their own.
pub fn page_bounds<T: KvElem>(keys: &[T], row: usize, page_size: usize, meta: &mut [T]) {
    let rows = meta_rows(page_size);
    let pages = keys.len() / (row * page_size);
    assert_eq!(
        meta.len(),
        pages * rows * row,
        "meta [pages, meta_rows, row]"
    );
    let plane = page_size.div_ceil(MASK_TOKENS); // mask rows per plane
    let mut bits = vec![0u16; rows - 2]; // [KEY_BITS, plane]: one channel's mask rows
    for (page, b) in keys
        .chunks_exact(row * page_size)
        .zip(meta.chunks_exact_mut(rows * row))
    {
        let (bounds, masks) = b.split_at_mut(2 * row);
        let (lo, hi) = bounds.split_at_mut(row);
        lo.copy_from_slice(&page[..row]);
        hi.copy_from_slice(&page[..row]);
        for k in page.chunks_exact(row).skip(1) {
            for c in 0..row {
                let x = k[c].to_f32();
                if x < lo[c].to_f32() {
                    lo[c] = k[c];
                }
                if x > hi[c].to_f32() {
                    hi[c] = k[c];
                }
            }
        }
        for c in 0..row {
            let edges = box_edges(lo[c].to_f32(), hi[c].to_f32());
            bits.fill(0);
            for (t, k) in page.chunks_exact(row).enumerate() {
                let j = key_box(&edges, k[c].to_f32());
                for b in 0..KEY_BITS {
                    if j >> (KEY_BITS - 1 - b) & 1 == 1 {
                        bits[b * plane + t / MASK_TOKENS] |= 1 << (t % MASK_TOKENS);
                    }
                }
            }
            for (r, &b) in bits.iter().enumerate() {
                masks[r * row + c] = T::from_mask(b);
            }
        }
    }
}

/// One channel's term of a box bound: `max(q_c · lo_c, q_c · hi_c)` ≥ `q_c · k_c` for
/// every `k_c` in `[lo_c, hi_c]`, whatever the sign of `q_c` (rounded products are
/// monotone, so this holds in f32 too). A NaN resolves to the second product.
fn box_term(q: f32, lo: f32, hi: f32) -> f32 {
    let (a, b) = (q * lo, q * hi);
    if a > b {
        a
    } else {
        b
    }
}

/// The **box bound** of every page for every query head: `q[num_heads, head_dim]`
/// (post-RoPE, as attention sees it; the 1/√d scale does not change the order),
/// `meta[pages, meta_rows(page_size), row]` (`page_bounds`) → `[pages, num_heads]`. Each
/// key of the page lies, per channel, in the box of the page's `[min, max]` its mask
/// bits name (`key_box`: a quarter of the range with `KEY_BITS` = 2), so Quest's bound
/// over that smaller box bounds `q · k`; the page's bound is the largest over its keys.
/// An upper bound of every key's score, never above the halves bound of `KEY_BITS` = 1
/// nor Quest's `Σ_c max(q_c · min_c, q_c · max_c)` (each box lies in the half, and the
/// half in the range, that the looser bound uses; each term is at most that bound's term,
/// summed in the same order), and much tighter: Quest pairs each channel's best extreme,
/// which no single key need reach. (The offload fork's `max(q · min, q · max)` is not a
/// bound at all: with mixed signs `q · k` exceeds both.) Each query head reads its KV
/// head's channels; channels are summed in order with plain f32 multiply and add, the
/// keys' sums compared with `>` from the first: the CUDA kernel (`kernels/sparse.cu`)
/// does the same, so both choose the same pages.
pub fn head_bounds<Q: KvElem, T: KvElem>(
    q: &[Q],
    meta: &[T],
    h: AttnHeads,
    pages: usize,
    page_size: usize,
) -> Vec<f32> {
    use rayon::prelude::*;
    let row = h.num_kv_heads * h.head_dim;
    let rows = meta_rows(page_size);
    let q: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
    let mut out = vec![0.0f32; pages * h.num_heads];
    let group = h.num_heads / h.num_kv_heads;
    let kernel = page_kernel::<T>();
    out.par_chunks_mut(h.num_heads)
        .zip(meta[..pages * rows * row].par_chunks(rows * row))
        .for_each_init(
            || Scratch {
                bounds: (vec![0.0; h.head_dim], vec![0.0; h.head_dim]),
                edges: vec![0.0; (BOXES + 1) * h.head_dim],
                terms: vec![0.0; group * row_fold::head_terms(h.head_dim)],
                masks: Vec::with_capacity(KEY_BITS * h.head_dim),
            },
            |scratch, (out, page)| {
                prefetch_next(page);
                kernel(&q, page, h, page_size, scratch, out)
            },
        );
    out
}

/// Asks the CPU for the metadata of the page after `page` (same length, next in memory),
/// which the task most likely scores next: the scoring otherwise stalls on each page's
/// first lines (a layer's metadata is not in L2 after the layer's weights streamed by).
/// Measured on SmolLM2's 4K shapes, both settings in one process: 15–20% less scoring
/// time; two pages ahead gained nothing more. A prefetch never faults, so the page past
/// the last one costs nothing.
#[inline(always)]
fn prefetch_next<T>(page: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let next = page.as_ptr().wrapping_add(page.len()) as *const i8;
        for line in (0..std::mem::size_of_val(page)).step_by(64) {
            // SAFETY: a prefetch is a hint: it reads nothing the program sees and never
            // faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line)) };
        }
    }
}

/// `page_head_bounds` with the best row-fold kernel this CPU has (detected at run time),
/// its body compiled for that CPU too.
type PageKernel<T> = fn(&[f32], &[T], AttnHeads, usize, &mut Scratch, &mut [f32]);

fn page_kernel<T: KvElem>() -> PageKernel<T> {
    #[cfg(target_arch = "x86_64")]
    if row_fold::Avx512::detect().is_some() {
        return |q, page, h, page_size, scratch, out| {
            // SAFETY: AVX-512F was detected.
            unsafe { page_head_bounds_avx512(q, page, h, page_size, scratch, out) }
        };
    }
    |q, page, h, page_size, scratch, out| {
        page_head_bounds(row_fold::Portable, q, page, h, page_size, scratch, out)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn page_head_bounds_avx512<T: KvElem>(
    q: &[f32],
    page: &[T],
    h: AttnHeads,
    page_size: usize,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let kernel = row_fold::Avx512::detect().expect("detected by page_kernel");
    page_head_bounds(kernel, q, page, h, page_size, scratch, out)
}

/// `page_head_bounds`' scratch, for one KV head's query heads (its group).
struct Scratch {
    bounds: (Vec<f32>, Vec<f32>), // [head_dim] each: the page's min and max, as f32
    edges: Vec<f32>,              // [BOXES + 1, head_dim]: each channel's box edges
    terms: Vec<f32>,              // [group, row_fold::head_terms(head_dim)]: `term_index`
    masks: Vec<u16>,              // [KEY_BITS, head_dim]: one mask row's bits, per plane
}

/// One page's box bound for every query head (`head_bounds`): `page[meta_rows, row]` →
/// `out[num_heads]`. Per KV head: each channel's box edges, each box's term for each
/// query head, then per mask row its keys' sums and their maximum (`row_fold`, the 16
/// keys side by side, each key's term picked by its bits). Measured with `KEY_BITS` = 1
/// on SmolLM2's shapes (9 heads, 256 pages of 16, 30 layers, one thread, best of 8 runs):
/// 9.6 ms with the AVX2 build alone, 5.5 ms with the body compiled for AVX-512 (3 heads'
/// sums in registers, the terms 16 channels at a time, the keys' maximum a tree over the
/// lanes); `KEY_BITS` = 2 picks among 4 terms instead of 2 (docs/benchmarks.md).
#[inline(always)]
fn page_head_bounds<T: KvElem, K: row_fold::RowFold>(
    kernel: K,
    q: &[f32],
    page: &[T],
    h: AttnHeads,
    page_size: usize,
    Scratch {
        bounds,
        edges,
        terms,
        masks,
    }: &mut Scratch,
    out: &mut [f32],
) {
    let (hd, row) = (h.head_dim, h.num_kv_heads * h.head_dim);
    let group = h.num_heads / h.num_kv_heads;
    let plane = page_size.div_ceil(MASK_TOKENS); // mask rows per plane
    for (kv, out) in out.chunks_mut(group).enumerate() {
        let g = kv * hd;
        let (min, max) = (&page[g..][..hd], &page[row + g..][..hd]);
        for (((lo, hi), min), max) in bounds.0.iter_mut().zip(&mut bounds.1[..]).zip(min).zip(max) {
            (*lo, *hi) = (min.to_f32(), max.to_f32());
        }
        box_edges_of_row(&bounds.0, &bounds.1, edges);
        for (j, terms) in terms.chunks_exact_mut(row_fold::head_terms(hd)).enumerate() {
            kernel.tables(&q[(kv * group + j) * hd..][..hd], edges, terms);
        }
        for r in 0..plane {
            masks.clear();
            for b in 0..KEY_BITS {
                let bits = &page[(2 + b * plane + r) * row + g..][..hd];
                masks.extend(bits.iter().map(|m| m.mask()));
            }
            let keys = (page_size - r * MASK_TOKENS).min(MASK_TOKENS);
            let row = row_fold::Row {
                masks,
                terms,
                keys,
                first: r == 0,
            };
            kernel.fold_row(&row, out);
        }
    }
}

/// A page's score (`page_scores`); `better_first` orders the best page first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PageScore {
    /// The best rank any query head gives the page by its bound (0: some head's best
    /// page). Ranks from `page_scores`' `depth` on are not computed: they all read `depth`.
    pub best_rank: u32,
    /// Σ over the heads of the page's softmax share of `bound / √head_dim` (the attention a
    /// head could give it at most, as the bound estimates it): orders pages of one best
    /// rank, the budget's last places.
    pub share: f32,
}

impl PageScore {
    /// Better best rank first, then the larger share (`total_cmp`: a NaN from poisoned
    /// metadata is ordered, not a panic, and changes the choice, so the sanitizer sees it).
    /// The definition: `rank` sorts an integer key that orders pages the same way (tested
    /// against this comparator).
    pub fn better_first(&self, other: &Self) -> std::cmp::Ordering {
        self.best_rank
            .cmp(&other.best_rank)
            .then(other.share.total_cmp(&self.share))
    }
}

/// Score of each page from its per-head bounds (`head_bounds`, `[pages, num_heads]`):
/// first its best rank over the query heads, so the best pages of *every* head come before
/// any head's second-best (a union of the heads' top pages, round by round), then, within
/// a round, its summed softmax share. A head with one sharp peak (a retrieval head on the
/// needle page) thus always gets its page, however large and flat the other heads' bounds
/// are; the largest raw bound over the heads, and the summed share alone, let such heads
/// crowd it out (docs/offload.md, "Sparse decode", measured on the needle grid).
/// Monotone in every head's bound: a page whose bound under every head exceeds another
/// page's ranks better under every head, so scores better. Ranks are exact up to `depth`
/// (pass the number of pages `rank` will be asked for: each head's top `depth` already
/// holds that many pages, so deeper ranks never decide). Page 0 (the sink, always kept) is
/// not a candidate: it is not ranked and has no share.
pub fn page_scores(
    head_bounds: &[f32],
    h: AttnHeads,
    pages: usize,
    depth: usize,
) -> Vec<PageScore> {
    let n = h.num_heads;
    assert_eq!(head_bounds.len(), pages * n, "[pages, num_heads]");
    let depth = depth.min(pages.saturating_sub(1));
    let mut score = vec![
        PageScore {
            best_rank: depth as u32,
            share: 0.0
        };
        pages
    ];
    let scale = h.scale;
    let mut e = vec![0.0f32; pages]; // one head's exp((bound − max) · scale)
    let mut order: Vec<u64> = Vec::with_capacity(pages); // sort keys, page in the low bits
    for head in 0..n {
        let bound = |p: usize| head_bounds[p * n + head];
        let max = (1..pages).map(bound).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (p, e) in e.iter_mut().enumerate().skip(1) {
            *e = ((bound(p) - max) * scale).exp();
            sum += *e;
        }
        for (s, e) in score.iter_mut().zip(&e).skip(1) {
            s.share += e / sum;
        }
        // Larger bound first (`total_cmp`), then the earlier page: one integer per page.
        order.clear();
        order.extend((1..pages).map(|p| descending(bound(p)) << 32 | p as u64));
        best_n(&mut order, depth);
        for (r, &key) in order.iter().enumerate() {
            let best = &mut score[key as u32 as usize].best_rank;
            *best = (*best).min(r as u32);
        }
    }
    score
}

/// `x`'s place in descending `f32::total_cmp` order, as an integer (0: the largest): sort
/// keys compare as integers, not through a comparator reading bounds indirectly.
fn descending(x: f32) -> u64 {
    let b = x.to_bits();
    // total_cmp's ascending order: negatives' bits flipped, positives' sign bit set.
    let ascending = if b >> 31 == 1 { !b } else { b | 1 << 31 };
    u64::from(!ascending)
}

/// A page of a layer's host KV: page `p` holds positions `p · page_size ..` of the layer.
pub type Page = u32;

/// Keeps the `n` smallest of `keys`, sorted: a selection, not a sort of every element,
/// O(len + n log n).
fn best_n<K: Ord>(keys: &mut Vec<K>, n: usize) {
    if n < keys.len() {
        keys.select_nth_unstable(n);
        keys.truncate(n);
    }
    keys.sort_unstable();
}

/// The `n` best of pages `1..candidates` by their score from `head_bounds`
/// (`page_scores` ranked as deep as `rank` reads, so the two cannot disagree on `n`).
pub fn rank_pages(head_bounds: &[f32], h: AttnHeads, candidates: usize, n: usize) -> Vec<Page> {
    rank(&page_scores(head_bounds, h, candidates, n), candidates, n)
}

/// The `n` best of pages `1..candidates` by score, best first (ties: the earlier page).
pub fn rank(scores: &[PageScore], candidates: usize, n: usize) -> Vec<Page> {
    // `better_first`, then the earlier page, as one integer per page.
    let key = |p: usize| {
        let s = scores[p];
        u128::from(s.best_rank) << 96 | u128::from(descending(s.share)) << 32 | p as u128
    };
    let mut order: Vec<u128> = (1..candidates.max(1)).map(key).collect();
    best_n(&mut order, n);
    order.into_iter().map(|k| k as Page).collect()
}

/// The pages a layer attends this step, ascending: the sink page 0 and the `k` best of
/// pages `1..candidates` by score (`ranked`: `rank`'s answer, at least `k` long unless
/// every candidate fits), or every candidate when they fit.
pub fn choose(ranked: &[Page], candidates: usize, k: usize) -> Vec<Page> {
    if candidates <= 1 + k {
        return (0..candidates as Page).collect();
    }
    let mut chosen = vec![0];
    chosen.extend_from_slice(&ranked[..k]);
    chosen.sort_unstable();
    chosen
}

/// `n` pages from `src` (host page, or slot page index) to slot page index `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub src: usize,
    pub dst: usize,
    pub pages: usize,
}

/// The slot layout of `pages` (ascending): page `pages[i]` at slot page `i`, as copies of
/// runs contiguous in host memory.
pub fn fetch_runs(pages: &[Page]) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for (i, &p) in pages.iter().enumerate() {
        match runs.last_mut() {
            Some(r) if r.src + r.pages == p as usize && r.dst + r.pages == i => r.pages += 1,
            _ => runs.push(Run {
                src: p as usize,
                dst: i,
                pages: 1,
            }),
        }
    }
    runs
}

/// How a slot prefetched with `loaded` (page `loaded[j]` at slot page `j`) becomes
/// `selected` (page `selected[i]` at slot page `i`), both ascending: moves inside the slot
/// for pages already there (in this order: none overwrites a page still to move), then
/// fetches from the host for the rest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Compaction {
    /// Slot page → slot page, in order; source and destination never overlap.
    pub moves: Vec<Run>,
    /// Host page → slot page (the misses), runs contiguous in host memory.
    pub fetches: Vec<Run>,
    pub hits: usize,
    pub misses: usize,
}

pub fn compaction(loaded: &[Page], selected: &[Page]) -> Compaction {
    // Hits (j: where it is, i: where it goes), increasing in both: selected ∩ loaded keep
    // their position order in both layouts.
    let (mut left, mut right, mut miss) = (Vec::new(), Vec::new(), Vec::new());
    let mut j = 0;
    for (i, &p) in selected.iter().enumerate() {
        while j < loaded.len() && loaded[j] < p {
            j += 1;
        }
        if j < loaded.len() && loaded[j] == p {
            match i.cmp(&j) {
                std::cmp::Ordering::Less => left.push((j, i)),
                std::cmp::Ordering::Greater => right.push((j, i)),
                std::cmp::Ordering::Equal => {}
            }
        } else {
            miss.push((p, i));
        }
    }
    let hits = selected.len() - miss.len();
    // A hit moving left lands on a slot page whose page (if selected) moves left too and
    // earlier in the order; right moves mirror it: left ascending, then right descending.
    right.reverse();
    let mut moves: Vec<Run> = Vec::new();
    for (src, dst) in left.into_iter().chain(right) {
        let r = Run { src, dst, pages: 1 };
        match moves.last_mut() {
            // Extend a run of the same direction only while source and destination stay
            // disjoint (an overlapping device copy is undefined on CUDA).
            Some(m)
                if m.src + m.pages == src
                    && m.dst + m.pages == dst
                    && m.src.abs_diff(m.dst) > m.pages =>
            {
                m.pages += 1
            }
            Some(m) if src + 1 == m.src && dst + 1 == m.dst && m.src.abs_diff(m.dst) > m.pages => {
                m.src -= 1;
                m.dst -= 1;
                m.pages += 1;
            }
            _ => moves.push(r),
        }
    }
    let mut fetches: Vec<Run> = Vec::new();
    for (p, i) in miss {
        match fetches.last_mut() {
            Some(r) if r.src + r.pages == p as usize && r.dst + r.pages == i => r.pages += 1,
            _ => fetches.push(Run {
                src: p as usize,
                dst: i,
                pages: 1,
            }),
        }
    }
    Compaction {
        moves,
        fetches,
        hits,
        misses: selected.len() - hits,
    }
}

/// Pages prefetched beyond the budget's, as a fraction of them: the pages ranked just
/// below the last step's choice, which the next query most often promotes (a miss is a
/// synchronous wait; a margin page only costs link bytes that are hidden behind compute).
pub const PREFETCH_MARGIN: f64 = 0.25;

/// Gaps of up to this many pages between prefetched pages are loaded too: one copy instead
/// of two. A copy has a fixed cost (a DMA set-up on PCIe, a thread wake-up on the CPU
/// device) worth a few pages of bytes.
pub const MAX_GAP_PAGES: usize = 1;

/// Pages a prefetch for a slot of `count` pages aims at before gap filling: the count and
/// the margin (the ring slots hold a layer's whole context, so any prefetch fits).
pub fn prefetch_count(count: usize) -> usize {
    count + (count as f64 * PREFETCH_MARGIN).ceil() as usize
}

/// The pages to prefetch for a layer before its query is known, ascending: the sink page,
/// the pages it ranked best last step (`ranked`, best first: its choice and the margin
/// below it; for the first decode step, the prompt's last token's ranking) up to `count +
/// margin` pages, topped up with the most recent candidates (with no ranking at all: the
/// sink page and the most recent pages); then every gap of at most `MAX_GAP_PAGES` pages
/// between them, so the copies are fewer and larger.
pub fn predict(ranked: &[Page], candidates: usize, count: usize) -> Vec<Page> {
    if candidates == 0 {
        return Vec::new();
    }
    let want = prefetch_count(count).min(candidates);
    let mut pred: Vec<Page> = vec![0];
    pred.extend(
        ranked
            .iter()
            .copied()
            .filter(|&p| (p as usize) < candidates && p != 0)
            .take(want - 1),
    );
    pred.sort_unstable();
    pred.dedup();
    let mut p = candidates;
    while pred.len() < want && p > 0 {
        p -= 1;
        if let Err(at) = pred.binary_search(&(p as Page)) {
            pred.insert(at, p as Page);
        }
    }
    fill_gaps(&pred, MAX_GAP_PAGES)
}

/// `pages` (ascending) with every gap of at most `max_gap` pages between two of them filled.
pub fn fill_gaps(pages: &[Page], max_gap: usize) -> Vec<Page> {
    let mut out: Vec<Page> = Vec::with_capacity(pages.len());
    for &p in pages {
        if let Some(&last) = out.last() {
            if (p - last - 1) as usize <= max_gap {
                out.extend(last + 1..p);
            }
        }
        out.push(p);
    }
    out
}

/// Prefetch hits and misses of sparse decode, in pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SparseStats {
    /// Layer-steps that selected (fewer candidates than the budget never miss).
    pub selections: usize,
    pub hit_pages: usize,
    pub miss_pages: usize,
    /// Runs of missed pages contiguous in host memory (a layer fetches all of its runs
    /// in one submission for K and one for V).
    pub miss_runs: usize,
}

impl SparseStats {
    pub fn hit_rate(&self) -> f64 {
        let all = self.hit_pages + self.miss_pages;
        if all == 0 {
            1.0
        } else {
            self.hit_pages as f64 / all as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Applies a compaction to a slot holding `loaded` and returns the slot's pages.
    fn apply(loaded: &[Page], c: &Compaction, len: usize) -> Vec<Option<Page>> {
        let mut slot: Vec<Option<Page>> = vec![None; len.max(loaded.len())];
        for (j, &p) in loaded.iter().enumerate() {
            slot[j] = Some(p);
        }
        for m in &c.moves {
            assert!(
                m.src + m.pages <= m.dst || m.dst + m.pages <= m.src,
                "overlapping move {m:?}"
            );
            let src: Vec<_> = slot[m.src..m.src + m.pages].to_vec();
            slot[m.dst..m.dst + m.pages].copy_from_slice(&src);
        }
        for f in &c.fetches {
            for n in 0..f.pages {
                slot[f.dst + n] = Some((f.src + n) as Page);
            }
        }
        slot.truncate(len);
        slot
    }

    fn random_set(rng: &mut StdRng, universe: usize, n: usize) -> Vec<Page> {
        let mut v: Vec<Page> = (0..universe as Page).collect();
        for i in 0..n {
            let j = rng.random_range(i..universe);
            v.swap(i, j);
        }
        v.truncate(n);
        v.sort_unstable();
        v
    }

    #[test]
    fn compaction_lays_out_the_selection_in_order() {
        let mut rng = StdRng::seed_from_u64(5);
        for _ in 0..2000 {
            let universe = rng.random_range(1..40);
            let n_sel = rng.random_range(0..=universe);
            // A prefetch may hold more pages than the selection (the margin) or fewer.
            let n_load = rng.random_range(0..=universe);
            let selected = random_set(&mut rng, universe, n_sel);
            let loaded = random_set(&mut rng, universe, n_load);
            let c = compaction(&loaded, &selected);
            let slot = apply(&loaded, &c, selected.len());
            let want: Vec<_> = selected.iter().map(|&p| Some(p)).collect();
            assert_eq!(slot, want, "loaded {loaded:?} selected {selected:?}: {c:?}");
            let both = selected.iter().filter(|p| loaded.contains(p)).count();
            assert_eq!((c.hits, c.misses), (both, selected.len() - both));
        }
    }

    #[test]
    fn identical_sets_need_no_copies_and_runs_coalesce() {
        let c = compaction(&[0, 1, 2, 5], &[0, 1, 2, 5]);
        assert!(c.moves.is_empty() && c.fetches.is_empty());
        let c = compaction(&[], &[0, 1, 2, 5, 6]);
        assert_eq!(c.fetches.len(), 2, "{c:?}");
        assert_eq!(
            fetch_runs(&[0, 1, 2, 7, 8]),
            vec![
                Run {
                    src: 0,
                    dst: 0,
                    pages: 3
                },
                Run {
                    src: 7,
                    dst: 3,
                    pages: 2
                }
            ]
        );
    }

    #[test]
    fn prediction_keeps_the_ranking_adds_a_margin_and_fills_gaps() {
        // count 4 + a quarter (1): 5 pages before gap filling.
        assert_eq!(predict(&[], 10, 4), vec![0, 6, 7, 8, 9]); // the sink + the 4 newest
        assert_eq!(predict(&[], 20, 4), vec![0, 16, 17, 18, 19]);
        // Best first: the first 4 of the ranking; 12 is not yet a candidate.
        assert_eq!(predict(&[12, 9, 3, 6, 15], 12, 4), vec![0, 3, 6, 9, 10, 11]);
        assert_eq!(predict(&[2, 1], 3, 3), vec![0, 1, 2]);
        assert_eq!(predict(&[], 0, 3), Vec::<Page>::new());
        assert_eq!(fill_gaps(&[0, 2, 5, 6, 9], 1), vec![0, 1, 2, 5, 6, 9]);
        assert_eq!(
            fill_gaps(&[0, 2, 5, 6, 9], 2),
            vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
        );
        assert_eq!(fill_gaps(&[0, 2, 5], 0), vec![0, 2, 5]);
    }

    #[test]
    fn rank_is_a_sort_by_score_cut_at_n() {
        let mut rng = StdRng::seed_from_u64(8);
        for _ in 0..500 {
            let cands = rng.random_range(0..50);
            // Few distinct values: ties must go to the earlier page; NaNs and zeros of
            // either sign are ordered as `total_cmp` orders them.
            let special = [f32::NAN, -f32::NAN, 0.0, -0.0, f32::INFINITY, -1.5, 1e-40];
            let scores: Vec<PageScore> = (0..cands)
                .map(|_| PageScore {
                    best_rank: rng.random_range(0..3),
                    share: match rng.random_range(0..4) {
                        0 => special[rng.random_range(0..special.len())],
                        _ => rng.random_range(0..3) as f32,
                    },
                })
                .collect();
            let n = rng.random_range(0..cands + 2);
            let mut all: Vec<Page> = (1..cands.max(1) as Page).collect();
            // The definition: `better_first`, then the earlier page.
            all.sort_by(|&a, &b| {
                scores[a as usize]
                    .better_first(&scores[b as usize])
                    .then(a.cmp(&b))
            });
            all.truncate(n);
            assert_eq!(rank(&scores, cands, n), all, "{scores:?} n {n}");
        }
    }

    /// The integer key orders floats as `total_cmp` does, reversed, over every class of
    /// bit pattern (random bits hit NaNs of both signs, subnormals and zeros).
    #[test]
    fn descending_keys_reverse_total_cmp() {
        let mut rng = StdRng::seed_from_u64(9);
        let special = [
            f32::NAN,
            -f32::NAN,
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let pick = |rng: &mut StdRng| match rng.random_range(0..3) {
            0 => special[rng.random_range(0..special.len())],
            1 => rng.random_range(-2.0f32..2.0),
            _ => f32::from_bits(rng.random()),
        };
        for _ in 0..20_000 {
            let (a, b) = (pick(&mut rng), pick(&mut rng));
            assert_eq!(
                descending(a).cmp(&descending(b)),
                b.total_cmp(&a),
                "{a} {b}"
            );
        }
    }

    #[test]
    fn config_is_checked() {
        let ok = SparseConfig {
            budget: 512,
            page_size: 16,
        };
        ok.check(256).unwrap();
        // 4096 + 100 stored: 256 candidates; 512 - 100 tokens of budget hold 25 pages.
        assert_eq!(ok.slot_pages(4196, 256), (256, 25));
        assert_eq!(ok.slot_pages(4096, 256), (256, 32));
        assert_eq!(ok.slot_pages(300, 256), (16, 16));
        for (budget, page_size, bs) in [
            (0, 16, 256),   // zero budget
            (500, 16, 256), // not a multiple of the page
            (256, 16, 256), // below sink + window
            (512, 0, 256),  // zero page
            (512, 24, 256), // page does not divide the block
        ] {
            let c = SparseConfig { budget, page_size };
            assert!(c.check(bs).is_err(), "{c:?} with block {bs}");
        }
    }

    #[test]
    fn metadata_is_min_max_and_each_keys_quarter_per_channel() {
        assert_eq!(KEY_BITS, 2, "the values below are worked out for quarters");
        let keys = [1.0f32, -2.0, 3.0, 4.0, -5.0, 0.5]; // 3 rows of 2, one page of 3
        let mut b = [0.0f32; 8]; // [min | max | plane 0 | plane 1, 2 channels]
        page_bounds(&keys, 2, 3, &mut b);
        assert_eq!(b[..4], [-5.0, -2.0, 3.0, 4.0]);
        // Channel 0: [-5, 3] splits at -1, then -3 and 1: keys 1, 3, -5 → quarters 3, 3, 0
        // (bits 11, 11, 00). Channel 1: [-2, 4] splits at 1, then -0.5 and 2.5: keys -2,
        // 4, 0.5 → quarters 0, 3, 1 (bits 00, 11, 01). Plane 0 holds the first bits
        // (upper half), plane 1 the second, bit t for key t.
        assert_eq!([b[4].mask(), b[5].mask()], [0b011, 0b010]);
        assert_eq!([b[6].mask(), b[7].mask()], [0b011, 0b110]);
        assert_eq!(box_edges(-5.0, 3.0), [-5.0, -3.0, -1.0, 1.0, 3.0]);
        assert_eq!(meta_rows(16), 4);
        assert_eq!(meta_rows(17), 6);
    }
}
