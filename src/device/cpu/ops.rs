//! CPU compute ops in f32: the reference every CUDA kernel is checked against, and the
//! kernels the CPU device runs. Row-major throughout; shapes are given beside each argument.

use std::ops::Range;

use rayon::prelude::*;

pub use super::dot::dot_fixed;
use super::dot::{DotKernel, Rows};
use super::fused::{StoredDot, StoredRows};
use super::packed::{PackedRows, PACK};
use super::q8;
use super::rows::KvRows;
use crate::device::kv_elem::KvElem;
use crate::device::MlpAct;

/// Weight rows per parallel task of `linear` (a multiple of every kernel's `NR`): the tile
/// (≤ 24 × k floats) stays in L2 while every input row streams past it. Tasks split only
/// the output columns, never `k`.
const W_TILE: usize = 24;
const _: () = assert!(
    W_TILE.is_multiple_of(PACK),
    "a tile is whole repacked groups"
);

/// Batches up to this many rows read stored weights straight into registers (the fused
/// path, `fused.rs`); larger ones dequantize each tile once into scratch and stream every
/// input row past it. Both give the same bits, so the switch never shows in a result.
const FUSED_MAX_M: usize = 4;

/// A weight matrix `[n, k]` (HF `[out, in]`) whose rows `linear` reads as f32.
pub trait WeightRows: Sync {
    /// `(n, k)`: output features, input features.
    fn out_in(&self) -> (usize, usize);
    /// Rows `rows` as f32, `[rows.len(), k]`: borrowed where stored in f32, else
    /// dequantized into `scratch` (exactly, so the result never depends on which).
    fn rows_f32<'s>(&'s self, rows: Range<usize>, scratch: &'s mut Vec<f32>) -> &'s [f32];
    /// Rows `rows` as stored, if they lie in one stored (not f32) part of the matrix.
    fn stored_rows(&self, _rows: Range<usize>) -> Option<StoredRows<'_>> {
        None
    }
    /// How `linear` treats the input rows multiplied by this weight.
    fn activations(&self) -> ActivationMode {
        ActivationMode::F32
    }
    /// The rows as consecutive parts, for the `q8` path: each repacked for its integer
    /// kernels (`packed.rs`), or read through `stored_rows` / `rows_f32`. Tiles never span
    /// two parts.
    fn q8_parts(&self) -> Vec<Q8Part<'_>> {
        vec![Q8Part {
            rows: 0..self.out_in().0,
            packed: None,
        }]
    }
}

/// Consecutive rows of a weight, as `WeightRows::q8_parts` hands them out.
pub struct Q8Part<'a> {
    pub rows: Range<usize>,
    /// The rows repacked, if they are.
    pub packed: Option<PackedRows<'a>>,
}

/// How `linear` treats its input rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationMode {
    /// As they are, in f32: bitwise the f32 reference's result, whatever the weight format.
    #[default]
    F32,
    /// Quantised per block of 32 (two 8-bit planes), then integer dots (`q8.rs`) with the weight
    /// rows in a format with an integer kernel (`packed::supports`; other rows take the f32
    /// path). Batch-invariant, not bitwise the f32 result.
    Q8,
}

/// A row-major f32 matrix `[n, k]` borrowed as a weight.
#[derive(Clone, Copy)]
pub struct F32Rows<'a> {
    pub data: &'a [f32], // [n, k]
    pub k: usize,
}

impl WeightRows for F32Rows<'_> {
    fn out_in(&self) -> (usize, usize) {
        (self.data.len() / self.k.max(1), self.k)
    }

    fn rows_f32<'s>(&'s self, rows: Range<usize>, _: &'s mut Vec<f32>) -> &'s [f32] {
        &self.data[rows.start * self.k..rows.end * self.k]
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` (+ `bias[n]`): a linear layer with HF `[out, in]` weights.
///
/// **Batch-invariant**: every output element is `dot_fixed(x row, w row)` (see `dot.rs`),
/// the same sequence of floating-point operations whatever `m` is, whatever the other rows
/// are and however the work is tiled, threaded or vectorised; so a token's result never
/// depends on what it is batched with, nor on the CPU (only the speed does).
pub fn linear(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
) {
    assert_eq!(w.len(), n * k, "linear: w is not [n, k]");
    linear_weight(x, &F32Rows { data: w, k }, bias, out, m);
}

/// `linear` over any stored weight `w[n, k]`: each tile of weight rows is dequantized once
/// (into a per-task scratch that stays in L2) and every input row streams past it, so a
/// stored format costs one dequantization per call whatever `m` is, and its results are
/// bitwise those of `linear` over the dequantized f32 weights.
pub fn linear_weight<W: WeightRows>(
    x: &[f32],
    w: &W,
    bias: Option<&[f32]>,
    out: &mut [f32],
    m: usize,
) {
    let (n, k) = w.out_in();
    assert_eq!(x.len(), m * k, "linear: x is not [m, k]");
    assert_eq!(out.len(), m * n, "linear: out is not [m, n]");
    if m == 0 || n == 0 {
        return;
    }
    if w.activations() == ActivationMode::Q8 && k.is_multiple_of(q8::QK) {
        linear_q8(x, w, out, m);
    } else {
        linear_f32(x, w, out, m);
    }
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(n) {
            for (o, b) in row.iter_mut().zip(b) {
                *o += b;
            }
        }
    }
}

/// `linear_weight`'s f32 path: every tile through the fixed-order f32 dots.
fn linear_f32<W: WeightRows>(x: &[f32], w: &W, out: &mut [f32], m: usize) {
    // Register blocks (input rows × weight rows) that fill each ISA's registers.
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = super::dot::Avx512::detect() {
        linear_tiles::<_, _, 4, 6, 4>(kern, x, w, out, m);
    } else {
        linear_tiles::<_, _, 2, 3, 3>(BUILD_KERNEL, x, w, out, m);
    }
    #[cfg(not(target_arch = "x86_64"))]
    linear_tiles::<_, _, 2, 3, 3>(BUILD_KERNEL, x, w, out, m);
}

/// Input rows at or above which their quantisation is split across threads.
const Q8_PAR_ROWS: usize = 16;

/// `linear_weight`'s `ActivationMode::Q8` path: `x[m, k]` quantised once (each row alone, so
/// its blocks never depend on the batch), then each tile of weight rows through the best
/// integer kernel this CPU has (`q8.rs`; all give the portable kernel's bits). A tile that
/// is not one run of rows repacked for an integer kernel (`packed::supports`) takes the f32 path: which path a row takes depends
/// on the weight alone, never on `m`.
fn linear_q8<W: WeightRows>(x: &[f32], w: &W, out: &mut [f32], m: usize) {
    let (_, k) = w.out_in();
    let nb = k / q8::QK;
    let mut xq = vec![q8::Q8Block::ZERO; m * nb]; // [m, nb]
    if m >= Q8_PAR_ROWS {
        xq.par_chunks_mut(nb)
            .zip(x.par_chunks(k))
            .for_each(|(q, x)| q8::quantize_row(x, q));
    } else {
        for (q, x) in xq.chunks_mut(nb).zip(x.chunks(k)) {
            q8::quantize_row(x, q);
        }
    }
    let xq = Q8Input { blocks: &xq, x, nb };
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(kern) = q8::Vnni::detect() {
            // Repacked groups 8 input rows at a time: a K-quant block's unpacking (high
            // bits, sub-scales) is shared by more rows. Gemma 3 270M Q4_K_M prefill at 4K,
            // Xeon, 2 threads: 355–370 tok/s with 2, 377–395 with 4, 394–404 with 8.
            return q8_tiles::<_, _, 8, 4, 8>(kern, &xq, w, out, m);
        }
        if let Some(kern) = q8::Avx2::detect() {
            return q8_tiles::<_, _, 4, 3, 2>(kern, &xq, w, out, m);
        }
    }
    q8_tiles::<_, _, 4, 3, 2>(q8::Portable, &xq, w, out, m);
}

/// The input of `linear_q8`: the rows quantised, and as they are (for tiles on the f32 path).
struct Q8Input<'a> {
    blocks: &'a [q8::Q8Block], // [m, nb]
    x: &'a [f32],              // [m, k]
    nb: usize,
}

/// One parallel task of `linear_q8`: at most `W_TILE` rows of one part of the weight.
enum Q8Task<'a> {
    /// Groups `groups` of repacked rows whose row 0 is output row `row0`.
    Packed {
        rows: PackedRows<'a>,
        groups: Range<usize>,
        row0: usize,
    },
    /// Output rows as stored (the integer path) or not (the f32 path).
    Rows(Range<usize>),
}

/// `w`'s rows cut into tasks, part by part (`WeightRows::q8_parts`).
fn q8_tasks<W: WeightRows>(w: &W) -> Vec<Q8Task<'_>> {
    let (n, _) = w.out_in();
    let mut tasks = Vec::new();
    for part in w.q8_parts() {
        // The tasks write `out[.., part.rows]` through a raw pointer: hold the parts to it.
        assert!(part.rows.end <= n, "q8_parts: rows past the weight's {n}");
        if let Some(p) = &part.packed {
            assert_eq!(
                p.rows,
                part.rows.len(),
                "q8_parts: a repacked part of another size"
            );
        }
        match part.packed {
            Some(rows) => {
                let (all, per) = (rows.groups(), W_TILE / PACK);
                tasks.extend((0..all).step_by(per).map(|g| Q8Task::Packed {
                    rows,
                    groups: g..(g + per).min(all),
                    row0: part.rows.start,
                }));
            }
            None => tasks.extend(
                part.rows
                    .clone()
                    .step_by(W_TILE)
                    .map(|j| Q8Task::Rows(j..(j + W_TILE).min(part.rows.end))),
            ),
        }
    }
    tasks
}

/// Parallel over the tasks of `q8_tasks`. Repacked groups take `PR`, 2 or 1 input rows at a
/// time; rows as stored take blocks of 4 input rows × `FC4` or 1 weight rows, then of 2 or 1
/// input rows × `FC` or 1.
fn q8_tiles<Q: q8::Q8Dot, W: WeightRows, const FC: usize, const FC4: usize, const PR: usize>(
    kern: Q,
    xq: &Q8Input<'_>,
    w: &W,
    out: &mut [f32],
    m: usize,
) {
    let (n, _) = w.out_in();
    let dst = SyncPtr(out.as_mut_ptr());
    q8_tasks(w).into_par_iter().for_each(|task| match task {
        Q8Task::Packed { rows, groups, row0 } => {
            for g in groups {
                packed_group::<Q, PR>(kern, xq, rows, g, row0, (m, n), dst);
            }
        }
        Q8Task::Rows(tile) => match w.stored_rows(tile.clone()) {
            Some(rows) if q8::supports(rows.format) => {
                q8_tile::<Q, FC, FC4>(kern, xq, rows, tile, (m, n), dst)
            }
            _ => f32_tile(xq.x, w, tile, m, dst),
        },
    });
}

/// Group `g` of repacked `rows` (whose row 0 is output row `row0`) dotted with every
/// quantised input row, `PR`, 2 or 1 at a time, into `out[m, n]`. The group's bytes stay in
/// L1 while the input rows stream past.
fn packed_group<Q: q8::Q8Dot, const PR: usize>(
    kern: Q,
    xq: &Q8Input<'_>,
    rows: PackedRows<'_>,
    g: usize,
    row0: usize,
    (m, n): (usize, usize),
    out: SyncPtr,
) {
    let group = rows.group(g);
    let j = row0 + g * PACK;
    let valid = PACK.min(rows.rows - g * PACK); // the last group's padding is not written
    let mut i = 0;
    while i < m {
        let r = [PR, 2, 1].into_iter().find(|&r| i + r <= m).unwrap_or(1);
        let at = (i, j, valid, n);
        match r {
            _ if r == PR => packed_block::<Q, PR>(kern, xq, group, at, out),
            2 => packed_block::<Q, 2>(kern, xq, group, at, out),
            _ => packed_block::<Q, 1>(kern, xq, group, at, out),
        }
        i += r;
    }
}

/// `out[i..i + R, j..j + valid]` for `R` quantised inputs × one repacked group.
#[inline(always)]
fn packed_block<Q: q8::Q8Dot, const R: usize>(
    kern: Q,
    xq: &Q8Input<'_>,
    group: super::packed::PackedGroup<'_>,
    (i, j, valid, n): (usize, usize, usize, usize),
    out: SyncPtr,
) {
    let nb = xq.nb;
    let xs: [&[q8::Q8Block]; R] =
        std::array::from_fn(|r| &xq.blocks[(i + r) * nb..(i + r + 1) * nb]);
    let res = kern.packed_block(&xs, group);
    for (r, row) in res.iter().enumerate() {
        for (c, v) in row[..valid].iter().enumerate() {
            // SAFETY: (i + r, j + c) is inside [m, n] and this task owns the group's rows.
            unsafe { *out.at((i + r) * n + j + c) = *v };
        }
    }
}

/// One tile of the f32 path with the best f32 kernel (the q8 mode's fallback).
fn f32_tile<W: WeightRows>(x: &[f32], w: &W, tile: Range<usize>, m: usize, dst: SyncPtr) {
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = super::dot::Avx512::detect() {
        return dequantized_tile::<_, _, 4, 6>(kern, x, w, tile, m, dst);
    }
    dequantized_tile::<_, _, 2, 3>(BUILD_KERNEL, x, w, tile, m, dst);
}

/// One tile on the integer path: weight rows `tile` of `n`, stored in `rows`, dotted with
/// every quantised input row, into `out[m, n]`.
fn q8_tile<Q: q8::Q8Dot, const FC: usize, const FC4: usize>(
    kern: Q,
    xq: &Q8Input<'_>,
    rows: StoredRows<'_>,
    tile: Range<usize>,
    (m, n): (usize, usize),
    out: SyncPtr,
) {
    let mut i = 0;
    while i < m {
        let r = [4, 2, 1].into_iter().find(|&r| i + r <= m).unwrap_or(1);
        let mut j = tile.start;
        while j < tile.end {
            // Blocks of 4 input rows take `FC4` weight rows (their accumulators fill the
            // registers sooner).
            let wide = if r == 4 { FC4 } else { FC };
            let c = if j + wide <= tile.end { wide } else { 1 };
            match (r, c) {
                (4, 1) => q8_block::<Q, 4, 1>(kern, xq, rows, i, j, tile.start, n, out),
                (4, _) => q8_block::<Q, 4, FC4>(kern, xq, rows, i, j, tile.start, n, out),
                (2, 1) => q8_block::<Q, 2, 1>(kern, xq, rows, i, j, tile.start, n, out),
                (2, _) => q8_block::<Q, 2, FC>(kern, xq, rows, i, j, tile.start, n, out),
                (_, 1) => q8_block::<Q, 1, 1>(kern, xq, rows, i, j, tile.start, n, out),
                (_, _) => q8_block::<Q, 1, FC>(kern, xq, rows, i, j, tile.start, n, out),
            }
            j += c;
        }
        i += r;
    }
}

/// `out[i.., j..]` for an `R × C` block of quantised inputs × stored weight rows (`j0`: the
/// tile's first row, `rows`' row 0).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn q8_block<Q: q8::Q8Dot, const R: usize, const C: usize>(
    kern: Q,
    xq: &Q8Input<'_>,
    rows: StoredRows<'_>,
    i: usize,
    j: usize,
    j0: usize,
    n: usize,
    out: SyncPtr,
) {
    let nb = xq.nb;
    let xs: [&[q8::Q8Block]; R] =
        std::array::from_fn(|r| &xq.blocks[(i + r) * nb..(i + r + 1) * nb]);
    let ws: [&[u8]; C] = std::array::from_fn(|c| rows.row(j - j0 + c));
    write_block(&kern.q8_block(rows.format, &xs, &ws), i, j, n, out);
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
const BUILD_KERNEL: super::dot::Avx2 = super::dot::Avx2;
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
)))]
const BUILD_KERNEL: super::dot::Portable = super::dot::Portable;

/// Parallel over weight-row tiles; in each, `MR × NR` blocks, then the edges (`FC` weight
/// rows a block on the fused path).
pub(super) fn linear_tiles<
    K: DotKernel + StoredDot,
    W: WeightRows,
    const MR: usize,
    const NR: usize,
    const FC: usize,
>(
    kern: K,
    x: &[f32],
    w: &W,
    out: &mut [f32],
    m: usize,
) {
    let (n, _) = w.out_in();
    let dst = SyncPtr(out.as_mut_ptr());
    (0..n.div_ceil(W_TILE)).into_par_iter().for_each(|tile| {
        let j0 = tile * W_TILE;
        let j_end = (j0 + W_TILE).min(n);
        if m <= FUSED_MAX_M {
            if let Some(rows) = w.stored_rows(j0..j_end) {
                return fused_tile::<K, FC>(kern, x, rows, j0..j_end, (m, n), dst);
            }
        }
        dequantized_tile::<K, W, MR, NR>(kern, x, w, j0..j_end, m, dst);
    });
}

/// One tile dequantized to f32 (`MR × NR` blocks, then the edges): weight rows `tile`
/// dotted with every input row of `x[m, k]`, into `out[m, n]`.
fn dequantized_tile<K: DotKernel, W: WeightRows, const MR: usize, const NR: usize>(
    kern: K,
    x: &[f32],
    w: &W,
    tile: Range<usize>,
    m: usize,
    dst: SyncPtr,
) {
    let (n, k) = w.out_in();
    let (j0, j_end) = (tile.start, tile.end);
    // One scratch per thread, kept across calls: a fresh buffer per task would cost an
    // allocation (and, past malloc's mmap threshold, page faults) per tile.
    TILE_SCRATCH.with_borrow_mut(|scratch| {
        let wt = w.rows_f32(j0..j_end, scratch); // [j_end - j0, k]
        let at = |i, j| Block { i, j, j0, k, n };
        let mut i = 0;
        while i < m {
            let full_rows = i + MR <= m;
            let mut j = j0;
            while j < j_end {
                let full_cols = j + NR <= j_end;
                match (full_rows, full_cols) {
                    (true, true) => linear_block::<K, MR, NR>(kern, x, wt, at(i, j), dst),
                    (true, false) => linear_block::<K, MR, 1>(kern, x, wt, at(i, j), dst),
                    (false, true) => linear_block::<K, 1, NR>(kern, x, wt, at(i, j), dst),
                    (false, false) => linear_block::<K, 1, 1>(kern, x, wt, at(i, j), dst),
                }
                j += if full_cols { NR } else { 1 };
            }
            i += if full_rows { MR } else { 1 };
        }
    })
}

/// One tile on the fused path: weight rows `tile` of `n`, stored in `rows`, dotted with
/// every input row of `x[m, k]`, in blocks of 4, 2 or 1 input rows × `FC` or 1 weight
/// rows, into `out[m, n]`.
fn fused_tile<K: StoredDot, const FC: usize>(
    kern: K,
    x: &[f32],
    rows: StoredRows<'_>,
    tile: Range<usize>,
    (m, n): (usize, usize),
    out: SyncPtr,
) {
    let k = rows.cols;
    let mut i = 0;
    while i < m {
        let r = [4, 2, 1].into_iter().find(|&r| i + r <= m).unwrap_or(1);
        let mut j = tile.start;
        while j < tile.end {
            let c = if j + FC <= tile.end { FC } else { 1 };
            let at = Block {
                i,
                j,
                j0: tile.start,
                k,
                n,
            };
            match (r, c) {
                (4, 1) => fused_block::<K, 4, 1>(kern, x, rows, at, out),
                (4, _) => fused_block::<K, 4, FC>(kern, x, rows, at, out),
                (2, 1) => fused_block::<K, 2, 1>(kern, x, rows, at, out),
                (2, _) => fused_block::<K, 2, FC>(kern, x, rows, at, out),
                (_, 1) => fused_block::<K, 1, 1>(kern, x, rows, at, out),
                (_, _) => fused_block::<K, 1, FC>(kern, x, rows, at, out),
            }
            j += c;
        }
        i += r;
    }
}

/// `out[i.., j..]` for an `R × C` block of inputs × stored weight rows.
#[inline(always)]
fn fused_block<K: StoredDot, const R: usize, const C: usize>(
    kern: K,
    x: &[f32],
    rows: StoredRows<'_>,
    b: Block,
    out: SyncPtr,
) {
    let Block { i, j, j0, k, n } = b;
    let xs: [&[f32]; R] = std::array::from_fn(|r| &x[(i + r) * k..(i + r + 1) * k]);
    let ws: [&[u8]; C] = std::array::from_fn(|c| rows.row(j - j0 + c));
    let res = kern.stored_block(rows.format, &xs, &ws);
    write_block(&res, i, j, n, out);
}

/// Writes an `R × C` block's results at `out[i.., j..]` (`out` is `[m, n]`).
#[inline(always)]
fn write_block<const R: usize, const C: usize>(
    res: &[[f32; C]; R],
    i: usize,
    j: usize,
    n: usize,
    out: SyncPtr,
) {
    for (r, row) in res.iter().enumerate() {
        for (c, v) in row.iter().enumerate() {
            // SAFETY: (i + r, j + c) is inside [m, n] and this task owns columns j..j + C.
            unsafe { *out.at((i + r) * n + j + c) = *v };
        }
    }
}

thread_local! {
    /// A weight tile dequantized to f32, `[W_TILE, k]`.
    static TILE_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: only used by tasks that write pairwise disjoint elements of one live slice.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The element at `offset` (a method, so closures capture the `Sync` wrapper).
    ///
    /// # Safety
    /// `offset` is inside the slice the pointer came from.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        self.0.add(offset)
    }
}

/// Where a block of `linear` starts: input row `i`, weight row `j` of the tile whose first
/// row is `j0`, in `x[m, k]`, `out[m, n]`.
#[derive(Clone, Copy)]
struct Block {
    i: usize,
    j: usize,
    j0: usize,
    k: usize,
    n: usize,
}

/// `out[i.., j..]` for an `R × C` block of inputs × weight rows (`wt` = the tile's rows).
#[inline(always)]
fn linear_block<K: DotKernel, const R: usize, const C: usize>(
    kern: K,
    x: &[f32],
    wt: &[f32],
    b: Block,
    out: SyncPtr,
) {
    let Block { i, j, j0, k, n } = b;
    let xs: [&[f32]; R] = std::array::from_fn(|r| &x[(i + r) * k..(i + r + 1) * k]);
    let ws: [&[f32]; C] = std::array::from_fn(|c| &wt[(j - j0 + c) * k..(j - j0 + c + 1) * k]);
    write_block(&kern.block(&xs, &ws), i, j, n, out);
}

/// Dot product with 16 independent accumulators so it vectorizes.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// RMSNorm of each `dim`-wide row: `out = x / sqrt(mean(x²) + eps) * w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    let f = |(o, x): (&mut [f32], &[f32])| {
        for (o, x) in o.chunks_exact_mut(dim).zip(x.chunks_exact(dim)) {
            rms_norm_row(x, w, eps, o);
        }
    };
    if serial(x.len()) {
        out.chunks_mut(dim * 16).zip(x.chunks(dim * 16)).for_each(f);
    } else {
        out.par_chunks_mut(dim * 16)
            .zip(x.par_chunks(dim * 16))
            .for_each(f);
    }
}

/// Values at or below which an elementwise op (norm, RoPE, SiLU) runs on the calling
/// thread: a decode step's op is a few microseconds of work, and handing it to the pool
/// (wake a worker, sleep until it is done, be woken) costs more, ten times per layer. The
/// results are the same either way: every row is computed alone.
const SERIAL_MAX: usize = 1 << 14;

fn serial(values: usize) -> bool {
    values <= SERIAL_MAX
}

#[inline]
pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss = dot(x, x) / x.len() as f32;
    let scale = 1.0 / (ss + eps).sqrt();
    for ((o, x), w) in out.iter_mut().zip(x).zip(w) {
        *o = x * scale * w;
    }
}

/// Residual add fused with the next RMSNorm: `x += delta; out = rms_norm(x)`.
pub fn add_rms_norm(x: &mut [f32], delta: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    let f = |((o, x), d): ((&mut [f32], &mut [f32]), &[f32])| {
        for ((o, x), d) in o
            .chunks_exact_mut(dim)
            .zip(x.chunks_exact_mut(dim))
            .zip(d.chunks_exact(dim))
        {
            for (x, d) in x.iter_mut().zip(d) {
                *x += d;
            }
            rms_norm_row(x, w, eps, o);
        }
    };
    if serial(x.len()) {
        out.chunks_mut(dim * 16)
            .zip(x.chunks_mut(dim * 16))
            .zip(delta.chunks(dim * 16))
            .for_each(f);
    } else {
        out.par_chunks_mut(dim * 16)
            .zip(x.par_chunks_mut(dim * 16))
            .zip(delta.par_chunks(dim * 16))
            .for_each(f);
    }
}

/// The logistic function, `1 / (1 + e^-x)`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Rotary embedding, NeoX/HF convention (pairs `i` and `i + d/2`), in place on
/// `x[tokens, heads, head_dim]` (rows may be strided by `row_stride`); `cos`/`sin` are
/// `[tokens, rotary_dim / 2]` (`rotary_dim ≤ head_dim`).
pub fn rope(
    x: &mut [f32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    row_stride: usize,
    cos: &[f32],
    sin: &[f32],
) {
    // The tables say how much of each head rotates: `[tokens, rotary_dim / 2]` (a partial
    // RoPE rotates the head's first `rotary_dim` dimensions, pairing `i` with
    // `i + rotary_dim / 2`; the rest pass through).
    let half = cos.len() / tokens.max(1);
    assert!(
        2 * half <= head_dim && sin.len() == cos.len(),
        "RoPE tables wider than the head"
    );
    let f = |(t, row): (usize, &mut [f32])| {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for h in 0..heads {
            let v = &mut row[h * head_dim..h * head_dim + 2 * half];
            let (a, b) = v.split_at_mut(half);
            for i in 0..half {
                let (x0, x1) = (a[i], b[i]);
                a[i] = x0 * c[i] - x1 * s[i];
                b[i] = x0 * s[i] + x1 * c[i];
            }
        }
    };
    if serial(tokens * heads * head_dim) {
        x.chunks_mut(row_stride)
            .take(tokens)
            .enumerate()
            .for_each(f);
    } else {
        x.par_chunks_mut(row_stride)
            .take(tokens)
            .enumerate()
            .for_each(f);
    }
}

/// `cos`, `sin` tables `[positions, head_dim / 2]` for positions `pos0..pos0 + n`.
pub fn rope_tables(inv_freq: &[f32], pos0: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    rope_tables_at(inv_freq, &(pos0..pos0 + n).collect::<Vec<_>>())
}

/// `cos`, `sin` tables `[positions.len(), head_dim / 2]` for arbitrary positions.
pub fn rope_tables_at(inv_freq: &[f32], positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let n = positions.len();
    let mut cos = vec![0.0; n * half];
    let mut sin = vec![0.0; n * half];
    for (t, &p) in positions.iter().enumerate() {
        let p = p as f32;
        for (i, f) in inv_freq.iter().enumerate() {
            let a = p * f;
            cos[t * half + i] = a.cos();
            sin[t * half + i] = a.sin();
        }
    }
    (cos, sin)
}

/// `out[t, i] = act(gu[t, i]) * gu[t, inter + i]` for the given activation (the CUDA
/// builder `gated_mul` picks its kernel by the same kind).
pub fn gated_act(act: MlpAct, gu: &[f32], inter: usize, out: &mut [f32]) {
    match act {
        MlpAct::Silu => silu_mul(gu, inter, out),
        MlpAct::GeluTanh => gelu_tanh_mul(gu, inter, out),
    }
}

/// `out[t, i] = silu(gu[t, i]) * gu[t, inter + i]`, with `gu` = `[tokens, 2 * inter]` (gate, up).
pub fn silu_mul(gu: &[f32], inter: usize, out: &mut [f32]) {
    gated_mul(gu, inter, out, |g| g / (1.0 + exp_fast(-g)));
}

/// `out[t, i] = gelu_tanh(gu[t, i]) * gu[t, inter + i]` (GeGLU; `gu` as for `silu_mul`),
/// GELU's tanh approximation as PyTorch's `gelu(approximate="tanh")` computes it.
pub fn gelu_tanh_mul(gu: &[f32], inter: usize, out: &mut [f32]) {
    gated_mul(gu, inter, out, gelu_tanh);
}

/// `out[t, i] = act(gu[t, i]) * gu[t, inter + i]`: a gated MLP's activation.
#[inline(always)]
fn gated_mul(gu: &[f32], inter: usize, out: &mut [f32], act: impl Fn(f32) -> f32 + Sync) {
    gated(gu, inter, out, |g, u| act(g) * u)
}

/// `out[t, i] = f(gu[t, i], gu[t, inter + i])`: a gated MLP's activation of gate and up.
#[inline(always)]
fn gated(gu: &[f32], inter: usize, out: &mut [f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    let f = |(o, gu): (&mut [f32], &[f32])| {
        let (g, u) = gu.split_at(inter);
        for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
            *o = f(*g, *u);
        }
    };
    if serial(out.len()) {
        out.chunks_mut(inter).zip(gu.chunks(2 * inter)).for_each(f);
    } else {
        out.par_chunks_mut(inter)
            .zip(gu.par_chunks(2 * inter))
            .for_each(f);
    }
}

/// gpt-oss's experts: `out[t, i] = (clamp(u, ±limit) + 1) · g · σ(alpha · g)` with
/// `g = min(gate, limit)`, `u` the up value (`gu` as for `silu_mul`; transformers'
/// `GptOssExperts._apply_gate`, the sigmoid exact as torch's).
pub fn clamped_swiglu_mul(gu: &[f32], inter: usize, alpha: f32, limit: f32, out: &mut [f32]) {
    gated(gu, inter, out, |g, u| {
        let g = g.min(limit);
        let u = u.clamp(-limit, limit);
        (u + 1.0) * (g * (1.0 / (1.0 + (-(g * alpha)).exp())))
    })
}

/// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// RMSNorm of each `w.len()`-wide row of `x`, in place (Gemma's norms on a sublayer's
/// output before the residual add).
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    let f = |x: &mut [f32]| {
        let mut tmp = vec![0.0f32; dim];
        for x in x.chunks_exact_mut(dim) {
            rms_norm_row(x, w, eps, &mut tmp);
            x.copy_from_slice(&tmp);
        }
    };
    if serial(x.len()) {
        x.chunks_mut(dim * 16).for_each(f);
    } else {
        x.par_chunks_mut(dim * 16).for_each(f);
    }
}

/// Per-head RMSNorm (Qwen3 q/k norm) on `x[tokens, heads, head_dim]` with row stride `row_stride`.
pub fn head_rms_norm(
    x: &mut [f32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    row_stride: usize,
    w: &[f32],
    eps: f32,
) {
    let f = |row: &mut [f32]| {
        let mut tmp = vec![0.0f32; head_dim];
        for h in 0..heads {
            let v = &mut row[h * head_dim..(h + 1) * head_dim];
            rms_norm_row(v, w, eps, &mut tmp);
            v.copy_from_slice(&tmp);
        }
    };
    if serial(tokens * heads * head_dim) {
        x.chunks_mut(row_stride).take(tokens).for_each(f);
    } else {
        x.par_chunks_mut(row_stride).take(tokens).for_each(f);
    }
}

/// `exp(x)` for `x <= 0` (softmax after subtracting the row max).
#[inline(always)]
pub fn exp_nonpos(x: f32) -> f32 {
    exp_fast(x)
}

/// `exp_fast`'s constants, shared with the 16-lane version (`dot.rs`), which must do the
/// same operations on the same values.
pub(super) mod exp_consts {
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two (Cody-Waite) so `n · ln2` stays exact for |n| up to ~128.
    pub const LN2_HI: f32 = 0.693_145_75;
    pub const LN2_LO: f32 = 1.428_606_8e-6;
    pub const MAGIC: f32 = 12_582_912.0; // 1.5 · 2²³: adding it rounds to an integer
    pub const LO: f32 = -87.0; // the clamp: exp saturates outside [LO, HI]
    pub const HI: f32 = 88.0;
    /// The degree-6 polynomial's coefficients, highest first (Horner's order).
    pub const POLY: [f32; 7] = [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ];
}

/// `exp(x)`, vectorizable: 2ⁿ · e^r with |r| ≤ ln2/2 and a degree-6 polynomial
/// (relative error ≈ 2e-7, at f32 rounding level); saturates outside [-87, 88].
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    use exp_consts::*;
    let x = x.clamp(LO, HI);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    // n as an integer: t = 1.5 · 2²³ + n lies in [2²³, 2²⁴), where one unit is one ulp,
    // so n is the difference of the bit patterns. (`n as i32`, the same value, saturates
    // and so compiles to a scalar conversion per lane.)
    let n_int = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // Horner: 1 + r(1 + r(1/2 + r(1/6 + r(1/24 + r(1/120 + r/720))))).
    let mut p = POLY[0];
    for k in &POLY[1..] {
        p = k + r * p;
    }
    p * f32::from_bits(((n_int + 127) as u32) << 23)
}

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub tokens: usize, // new query tokens
    pub pos0: usize,   // absolute position of the first query token
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Head layout and mask of an attention call (the part every sequence of a batch shares).
#[derive(Clone, Copy, Debug)]
pub struct AttnHeads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Scores are `q·k × scale`.
    pub scale: f32,
    /// A sliding window: the query at `p` sees keys `p - window < k <= p` (`None`: all `k <= p`).
    pub window: Option<usize>,
}

impl AttnHeads {
    /// Plain causal attention scaled by 1/√head_dim.
    pub fn causal(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        Self {
            num_heads,
            num_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
        }
    }

    /// The first key the query at `pos` sees.
    #[inline(always)]
    pub fn first_key(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// Where a position's K/V row (`[kv_heads, head_dim]`) starts in a layer's K and V buffers.
pub trait KvLayout: Sync {
    fn row_offset(&self, pos: usize) -> usize;
}

/// One sequence's cache, positions in order: `[capacity, kv_heads, head_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct ContiguousRows {
    pub row: usize, // kv_heads * head_dim
}

impl KvLayout for ContiguousRows {
    #[inline(always)]
    fn row_offset(&self, pos: usize) -> usize {
        pos * self.row
    }
}

/// A sliding-window layer's ring `[rows, kv_heads, head_dim]`: position `p` at row
/// `p % rows` (rows past the window hold newer or older positions, which the mask skips).
#[derive(Clone, Copy, Debug)]
pub struct RingRows {
    pub row: usize, // kv_heads * head_dim
    pub rows: usize,
}

impl KvLayout for RingRows {
    #[inline(always)]
    fn row_offset(&self, pos: usize) -> usize {
        pos % self.rows * self.row
    }
}

/// A page pool `[num_pages, block_size, kv_heads, head_dim]` read through one sequence's
/// block table: position `p` lives in page `pages[p / block_size]`, slot `p % block_size`.
#[derive(Clone, Copy, Debug)]
pub struct PagedRows<'a> {
    pub pages: &'a [u32],
    pub block_size: usize,
    pub row: usize, // kv_heads * head_dim
}

impl KvLayout for PagedRows<'_> {
    #[inline(always)]
    fn row_offset(&self, pos: usize) -> usize {
        (self.pages[pos / self.block_size] as usize * self.block_size + pos % self.block_size)
            * self.row
    }
}

/// One sequence of a batched attention call: query rows `row0..row0 + tokens` of `q`/`out`
/// are its positions `pos0..pos0 + tokens`, and its keys are read through `kv`.
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<L> {
    pub row0: usize,
    pub tokens: usize,
    pub pos0: usize,
    pub kv: L,
}

const Q_TILE: usize = 32; // query tokens per task (× heads of a KV group); never changes bits
const K_TILE: usize = 128; // keys per online-softmax step, at absolute multiples of K_TILE
/// Keys per partition, at absolute multiples of KV_SPLIT (flash-decoding splits); the
/// partials of a query are merged in partition order. Fixed, so the bits never depend
/// on how many queries a call has or how many threads run it.
const KV_SPLIT: usize = 512;
/// Partials (`Partial`) one wave of an attention call holds at most (one item beyond);
/// the unit tests use small waves, so their references check the wave boundaries.
#[cfg(not(test))]
const WAVE_PARTIAL_BYTES: usize = 64 << 20;
#[cfg(test)]
const WAVE_PARTIAL_BYTES: usize = 1 << 16;
/// Query tokens per sequence up to which a task reads every KV head (whole K/V rows).
const WHOLE_ROWS_MAX_TOKENS: usize = 8;
const _: () = assert!(
    WHOLE_ROWS_MAX_TOKENS <= Q_TILE,
    "a decode-like sequence is one tile"
);
/// Keys per step of a tile's score and `P·V` passes, each step over every KV head of the
/// task (so a step reads whole K/V rows); never changes bits.
const KV_CHUNK: usize = 32;

/// Causal GQA attention of one sequence over a contiguous cache (see [`attention_batch`]).
///
/// `q[tokens, num_heads, head_dim]`; `k`, `v`: `[>= pos0 + tokens, num_kv_heads, head_dim]`
/// (the layer's cache, the new tokens already stored); `out[tokens, num_heads, head_dim]`.
pub fn attention<T: KvElem>(q: &[f32], k: &[T], v: &[T], out: &mut [f32], s: AttnShape) {
    let (heads, seq) = s.batch_of_one();
    attention_batch(q, KvRows::from_slices(k, v), out, heads, None, &[seq]);
}

impl AttnShape {
    /// This one sequence over a contiguous cache as `attention_batch` / `attention_with`
    /// take it: the heads, and the sequence.
    pub fn batch_of_one(self) -> (AttnHeads, AttnSeq<ContiguousRows>) {
        let heads = AttnHeads::causal(self.num_heads, self.num_kv_heads, self.head_dim);
        let seq = AttnSeq {
            row0: 0,
            tokens: self.tokens,
            pos0: self.pos0,
            kv: ContiguousRows {
                row: self.num_kv_heads * self.head_dim,
            },
        };
        (heads, seq)
    }
}

/// Causal GQA attention for a batch of sequences, each over its own keys (contiguous or
/// paged: no gather), never materialising a `tokens × keys` score matrix.
///
/// **Batch-invariant**: a query row's output is a function of its own q, its position and
/// its keys alone. Its keys are cut into partitions at absolute multiples of `KV_SPLIT`,
/// each walked in `K_TILE` tiles (absolute too) with an online softmax, scores by
/// [`dot_fixed`], `P·V` one key after the other; the partials are merged in partition
/// order. So batching, chunking, the task split and paging never change a bit.
///
/// K and V are read in the cache's element `T`, widened to f32 in registers (exactly), so
/// the result over a 16-bit cache is bitwise the result over the same values in f32. The
/// kernel (AVX-512 if this CPU has it, else the build's) changes no bit either (`dot.rs`).
///
/// `q[rows, num_heads, head_dim]`; `k`, `v`: the layer's K/V buffers, addressed by each
/// sequence's layout; `out[rows, num_heads, head_dim]`.
///
/// `sinks[num_heads]` (gpt-oss): each head's learned logit, one more term in every
/// softmax's denominator that attends nothing (`exp(sink − m)` next to the keys').
pub fn attention_batch<T: KvElem, L: KvLayout>(
    q: &[f32],
    kv: KvRows<'_, T>,
    out: &mut [f32],
    h: AttnHeads,
    sinks: Option<&[f32]>,
    seqs: &[AttnSeq<L>],
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = super::dot::Avx512::detect() {
        return attention_with(kern, q, kv, out, h, sinks, seqs);
    }
    attention_with(BUILD_KERNEL, q, kv, out, h, sinks, seqs)
}

/// `attention_batch` with the kernel `kern`.
pub fn attention_with<K: DotKernel, T: KvElem, L: KvLayout>(
    kern: K,
    q: &[f32],
    kv: KvRows<'_, T>,
    out: &mut [f32],
    h: AttnHeads,
    sinks: Option<&[f32]>,
    seqs: &[AttnSeq<L>],
) {
    if let Some(s) = sinks {
        assert_eq!(s.len(), h.num_heads, "attention: sinks are not [num_heads]");
    }
    let hd = h.head_dim;
    let group = h.num_heads / h.num_kv_heads;
    let row_stride = h.num_heads * hd;
    // Work items: (sequence, KV groups, query tile); each has one task per partition. In
    // a decode-like call a task takes every KV head when there are tasks enough for the
    // threads without splitting them: it then reads whole K/V rows, in order (a stream
    // the prefetchers follow), instead of one head's slice of each row.
    #[derive(Clone, Copy)]
    struct Item {
        seq: usize,
        g0: usize, // KV heads g0..g0 + ng
        ng: usize,
        t0: usize, // first query of the tile, relative to the sequence
        nq: usize,
        parts: usize, // partitions with keys the tile sees, from `first_task` on
        first_task: usize,
    }
    // Partitions of a query tile of `nq` tokens from `t0`: its last query sees the last,
    // its first query's window (if any) starts in the first.
    let partitions = |s: &AttnSeq<L>, t0: usize, nq: usize| {
        h.first_key(s.pos0 + t0) / KV_SPLIT..(s.pos0 + t0 + nq).div_ceil(KV_SPLIT)
    };
    // Decode-like calls only (one query tile a sequence): a prefill tile reuses each K/V
    // row for its 32 queries (the stream matters less), and all heads × 32 queries of a
    // large model outgrow L2.
    let decode_like = seqs.iter().all(|s| s.tokens <= WHOLE_ROWS_MAX_TOKENS);
    let whole_row_tasks: usize = seqs.iter().map(|s| partitions(s, 0, s.tokens).len()).sum();
    let ng = if decode_like && whole_row_tasks >= rayon::current_num_threads() {
        h.num_kv_heads
    } else {
        1
    };
    let mut items = Vec::new();
    let mut tasks = Vec::new(); // (item, partition)
    for (si, s) in seqs.iter().enumerate() {
        for g0 in (0..h.num_kv_heads).step_by(ng) {
            for t0 in (0..s.tokens).step_by(Q_TILE) {
                let nq = Q_TILE.min(s.tokens - t0);
                let parts = partitions(s, t0, nq);
                let item = items.len();
                items.push(Item {
                    seq: si,
                    g0,
                    ng,
                    t0,
                    nq,
                    parts: parts.len(),
                    first_task: tasks.len(),
                });
                tasks.extend(parts.map(|p| (item, p)));
            }
        }
    }
    // Items in waves whose partials stay within `WAVE_PARTIAL_BYTES` (a long prefill has
    // tiles × partitions of them: 16K tokens of a head_dim-256 model held ~1.5 GB at once).
    // Each task and each merge is the same computation whatever the wave: no bit changes.
    let dst_ptr = SyncPtr(out.as_mut_ptr());
    let mut first = 0;
    while first < items.len() {
        let mut end = first;
        let mut bytes = 0;
        while end < items.len() && (end == first || bytes < WAVE_PARTIAL_BYTES) {
            let it = &items[end];
            bytes += it.parts * it.ng * it.nq * group * (hd + 2) * 4;
            end += 1;
        }
        let wave = &items[first..end];
        let t0 = wave[0].first_task;
        let t1 = wave[wave.len() - 1].first_task + wave[wave.len() - 1].parts;
        let partials: Vec<Partial> = tasks[t0..t1]
            .par_iter()
            .map(|&(it, p)| {
                let it = items[it];
                let s = &seqs[it.seq];
                let key_end = s.pos0 + it.t0 + it.nq; // exclusive: the tile's last query sees keys < key_end
                let (ks, ke) = (p * KV_SPLIT, ((p + 1) * KV_SPLIT).min(key_end));
                let heads = it.g0..it.g0 + it.ng;
                attend_part(kern, q, kv, h, s, heads, it.t0, it.nq, ks, ke)
            })
            .collect();
        // Merge each query row's partials in partition order and normalise into `out`.
        wave.par_iter().for_each(|it| {
            let parts = &partials[it.first_task - t0..it.first_task - t0 + it.parts];
            let row0 = seqs[it.seq].row0 + it.t0;
            for g in 0..it.ng {
                for i in 0..it.nq {
                    for j in 0..group {
                        let r = (g * it.nq + i) * group + j;
                        let head = (it.g0 + g) * group + j;
                        let sink = sinks.map(|s| s[head]);
                        let m = parts
                            .iter()
                            .map(|p| p.m[r])
                            .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
                        // SAFETY: this item alone writes heads of KV heads g0..g0 + ng of its
                        // rows; `out` is [rows, num_heads, head_dim] and the row is inside it.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(
                                dst_ptr.at((row0 + i) * row_stride + head * hd),
                                hd,
                            )
                        };
                        dst.fill(0.0);
                        let mut l = sink.map_or(0.0, |s| (s - m).exp());
                        for p in parts {
                            if p.m[r] == f32::NEG_INFINITY {
                                continue;
                            }
                            let w = (p.m[r] - m).exp();
                            l += p.l[r] * w;
                            for (d, o) in dst.iter_mut().zip(&p.o[r * hd..(r + 1) * hd]) {
                                *d += o * w;
                            }
                        }
                        let inv = 1.0 / l;
                        dst.iter_mut().for_each(|d| *d *= inv);
                    }
                }
            }
        });
        first = end;
    }
}

/// `k`, `v` = the K and V slices `cols` of the rows at `positions`.
fn rows_at<'a, T, L: KvLayout>(
    kv: KvRows<'a, T>,
    layout: &L,
    cols: Range<usize>,
    positions: Range<usize>,
    k: &mut Vec<&'a [T]>,
    v: &mut Vec<&'a [T]>,
) {
    k.clear();
    v.clear();
    for pos in positions {
        let (kr, vr) = kv.rows(layout.row_offset(pos) + cols.start, cols.len());
        k.push(kr);
        v.push(vr);
    }
}

struct Partial {
    m: Vec<f32>, // [rows] running max of the scaled scores
    l: Vec<f32>, // [rows] running sum of exp(score - m)
    o: Vec<f32>, // [rows, head_dim] Σ exp(score - m) · v
}

/// One task: the `nq` queries (from `t0`) of one sequence × the heads of KV heads `kv_heads`,
/// over keys `ks..ke`. Rows `r = (g * nq + i) * group + j`: KV head `kv_heads.start + g`,
/// token `t0 + i`, its head `j` in the group; a KV head's rows are adjacent (one score
/// call), and so are a token's heads in it (they see the same keys: `P·V` shares each value
/// load). Every step is per row; rows only share loads.
#[allow(clippy::too_many_arguments)]
fn attend_part<K: DotKernel, T: KvElem, L: KvLayout>(
    kern: K,
    q: &[f32],
    kv: KvRows<'_, T>,
    h: AttnHeads,
    s: &AttnSeq<L>,
    kv_heads: Range<usize>,
    t0: usize,
    nq: usize,
    ks: usize,
    ke: usize,
) -> Partial {
    let hd = h.head_dim;
    let group = h.num_heads / h.num_kv_heads;
    let g_rows = nq * group; // rows of one KV head
    let rows = kv_heads.len() * g_rows;
    let q_stride = h.num_heads * hd;
    let scale = h.scale;
    // qg[rows, hd], pre-scaled.
    let mut qg = vec![0.0f32; rows * hd];
    for (g, kvh) in kv_heads.clone().enumerate() {
        for i in 0..nq {
            let src = &q[(s.row0 + t0 + i) * q_stride + kvh * group * hd..][..group * hd];
            let dst = &mut qg[(g * nq + i) * group * hd..][..group * hd];
            for (d, x) in dst.iter_mut().zip(src) {
                *d = x * scale;
            }
        }
    }
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0.0f32; rows];
    let mut o = vec![0.0f32; rows * hd];
    // Scores, then probabilities: [rows, K_TILE].
    let mut sc = vec![0.0f32; rows * K_TILE];
    // Whole K and V rows (the task's KV heads) of this tile and of the chunk after it (the
    // next partition's too: a thread mostly takes the partitions in order), wherever their
    // pages are: [kn + up to KV_CHUNK][kv_heads.len() * hd]. Each pass over a chunk asks
    // for the rows the next pass reads (`next` below), an access the hardware would start
    // too late (a chunk is a few thousand cycles of compute, a miss a few hundred).
    let (mut whole_k, mut whole_v): (Vec<&[T]>, Vec<&[T]>) = (Vec::new(), Vec::new());
    let whole = kv_heads.start * hd..kv_heads.end * hd;
    let key_end = s.pos0 + t0 + nq; // the tile's last query sees keys < key_end
    let nh = kv_heads.len();
    // KV head `g`'s share of the rows a chunk's pass asks for (a third with the default
    // model's 3 KV heads), which the kernels spread evenly over their keys (`Pacer`), so the
    // misses go out at a steady rate through the whole pass. Asking for them all in head
    // 0's call bursts them faster than a core's misses drain and stalls the compute behind
    // them (4K f16 decode attention, one thread: 272–283 → 228–229 µs a layer hot, 400–408
    // → 334–339 from memory, with this and the order of `next`; docs/cpu.md).
    let share = |rows: usize, g: usize| g * rows / nh..(g + 1) * rows / nh;
    // Query `i`'s visible keys in the tile from `kb` of `kn` keys, as tile offsets: its
    // window's first key (0 without one) up to itself (causal).
    let visible = |i: usize, kb: usize, kn: usize| {
        let p = s.pos0 + t0 + i;
        h.first_key(p).saturating_sub(kb).min(kn)..(p + 1).saturating_sub(kb).min(kn)
    };
    // Tiles (at absolute multiples of K_TILE) before the tile's first window see nothing.
    let mut kb = ks.max(h.first_key(s.pos0 + t0) / K_TILE * K_TILE);
    while kb < ke {
        let kn = K_TILE.min(ke - kb);
        let fetched = kb..key_end.min(kb + kn + KV_CHUNK);
        let (wk, wv) = (&mut whole_k, &mut whole_v);
        rows_at(kv, &s.kv, whole.clone(), fetched, wk, wv);
        // This tile's K and V rows; KV head `g`'s are their columns `g * hd..(g + 1) * hd`.
        let (tile_k, tile_v) = (Rows::whole(&whole_k[..kn]), Rows::whole(&whole_v[..kn]));
        let head = |g: usize| g * hd..(g + 1) * hd;
        // The rows after a chunk ending at tile key c1.
        let after = |c1: usize| c1..whole_k.len().min(c1 + KV_CHUNK);
        // sc[rows, kn] = qg · Kᵀ, each score the fixed-order dot. Key chunk by key chunk,
        // every KV head in each: a chunk's K rows are read whole and in order (one head's
        // slice of each row is a stride the prefetchers do not follow).
        for c0 in (0..kn).step_by(KV_CHUNK) {
            let c1 = kn.min(c0 + KV_CHUNK);
            for g in 0..kv_heads.len() {
                let qg = &qg[g * g_rows * hd..(g + 1) * g_rows * hd];
                let sc = &mut sc[g * g_rows * K_TILE + c0..(g + 1) * g_rows * K_TILE];
                // Next: the K rows after the chunk, or after the tile's last chunk its first
                // V chunk, which `P·V` reads right after the softmax.
                let next = if c1 < kn {
                    &whole_k[after(c1)]
                } else {
                    &whole_v[..KV_CHUNK.min(kn)]
                };
                let ahead = &next[share(next.len(), g)];
                let keys = tile_k.columns(head(g)).range(c0..c1);
                kern.scores(qg, keys, sc, K_TILE, ahead);
            }
        }
        // Online softmax per row: sc becomes this tile's probabilities.
        for g in 0..kv_heads.len() {
            for i in 0..nq {
                let seen = visible(i, kb, kn);
                if seen.is_empty() {
                    continue;
                }
                for r in (g * nq + i) * group..(g * nq + i + 1) * group {
                    let row = &mut sc[r * K_TILE + seen.start..r * K_TILE + seen.end];
                    let m_new = m[r].max(kern.row_max(row));
                    let corr = exp_nonpos(m[r] - m_new);
                    let sum = kern.exp_sum(row, m_new);
                    l[r] = l[r] * corr + sum;
                    m[r] = m_new;
                    if corr != 1.0 {
                        o[r * hd..(r + 1) * hd].iter_mut().for_each(|x| *x *= corr);
                    }
                }
            }
        }
        // o += P · V, one key after the other for every element (chunks in order), a
        // token's heads sharing each value load; key chunks outermost as for the scores.
        for c0 in (0..kn).step_by(KV_CHUNK) {
            let c1 = kn.min(c0 + KV_CHUNK);
            // Next: the V rows after the chunk, or after the tile's last chunk the next
            // tile's (or partition's) first K chunk.
            let next = if c1 < kn {
                &whole_v[after(c1)]
            } else {
                &whole_k[after(c1)]
            };
            for g in 0..kv_heads.len() {
                let mut ahead = &next[share(next.len(), g)]; // for the head's first call
                for i in 0..nq {
                    let seen = visible(i, kb, kn);
                    let keys = c0.max(seen.start)..c1.min(seen.end);
                    if keys.is_empty() {
                        continue;
                    }
                    let rows = (g * nq + i) * group..(g * nq + i + 1) * group;
                    let acc = &mut o[rows.start * hd..rows.end * hd];
                    let ps = &sc[rows.start * K_TILE + keys.start..];
                    let vs = tile_v.columns(head(g)).range(keys);
                    kern.accumulate_rows(ps, K_TILE, vs, acc, ahead);
                    ahead = &[];
                }
            }
        }
        kb += kn;
    }
    Partial { m, l, o }
}

/// Reference attention for tests: plain softmax over the full score row.
pub fn attention_naive(q: &[f32], k: &[f32], v: &[f32], s: AttnShape) -> Vec<f32> {
    let hd = s.head_dim;
    let group = s.num_heads / s.num_kv_heads;
    let mut out = vec![0.0; s.tokens * s.num_heads * hd];
    for t in 0..s.tokens {
        let p = s.pos0 + t;
        for h in 0..s.num_heads {
            let g = h / group;
            let qv = &q[(t * s.num_heads + h) * hd..][..hd];
            let scores: Vec<f64> = (0..=p)
                .map(|j| {
                    let kv = &k[(j * s.num_kv_heads + g) * hd..][..hd];
                    qv.iter()
                        .zip(kv)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
            let sum: f64 = e.iter().sum();
            let o = &mut out[(t * s.num_heads + h) * hd..][..hd];
            for (j, w) in e.iter().enumerate() {
                let vv = &v[(j * s.num_kv_heads + g) * hd..][..hd];
                for (d, x) in o.iter_mut().zip(vv) {
                    *d += (*w / sum) as f32 * x;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn rand_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    #[test]
    fn exp_matches_std() {
        for i in -17000..17000 {
            let x = i as f32 * 0.005;
            let (a, b) = (exp_fast(x), x.exp());
            assert!((a - b).abs() <= 3e-7 * b.max(1e-30), "exp({x}): {a} vs {b}");
        }
    }

    #[test]
    fn attention_matches_naive() {
        let mut rng = StdRng::seed_from_u64(7);
        // (tokens, pos0, heads, kv_heads, head_dim): prefill tiles, decode splits, GQA.
        for &(tokens, pos0, nh, nkv, hd) in &[
            (1, 0, 2, 1, 8),
            (37, 0, 4, 2, 16),
            (5, 700, 6, 2, 32),
            (1, 1500, 9, 3, 64),
            (200, 90, 4, 4, 8),
        ] {
            let total = pos0 + tokens;
            let q = rand_vec(&mut rng, tokens * nh * hd);
            let k = rand_vec(&mut rng, total * nkv * hd);
            let v = rand_vec(&mut rng, total * nkv * hd);
            let s = AttnShape {
                tokens,
                pos0,
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
            };
            let mut out = vec![0.0; tokens * nh * hd];
            attention(&q, &k, &v, &mut out, s);
            let want = attention_naive(&q, &k, &v, s);
            let err = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err < 1e-5, "{s:?}: max abs error {err}");
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn a_linear_rows_bits_do_not_depend_on_the_other_rows() {
        let mut rng = StdRng::seed_from_u64(5);
        // k = 37: eight-lane body and a tail; n = 70: partial weight tiles and blocks.
        let (m, k, n) = (19, 37, 70);
        let x = rand_vec(&mut rng, m * k);
        let w = rand_vec(&mut rng, n * k);
        let mut all = vec![0.0; m * n];
        linear(&x, &w, None, &mut all, m, k, n);
        for i in 0..m {
            let mut one = vec![0.0; n];
            linear(&x[i * k..(i + 1) * k], &w, None, &mut one, 1, k, n);
            assert_eq!(bits(&one), bits(&all[i * n..(i + 1) * n]), "row {i} alone");
            for j in 0..n {
                let d = dot_fixed(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
                assert_eq!(d.to_bits(), all[i * n + j].to_bits());
            }
        }
        // Row 3 among 6 other random rows.
        let mut x2 = rand_vec(&mut rng, 7 * k);
        x2[3 * k..4 * k].copy_from_slice(&x[3 * k..4 * k]);
        let mut out = vec![0.0; 7 * n];
        linear(&x2, &w, None, &mut out, 7, k, n);
        assert_eq!(bits(&out[3 * n..4 * n]), bits(&all[3 * n..4 * n]));
    }

    /// A sliding window: each query at `p` attends exactly keys `p - w < k <= p` (an f64
    /// masked softmax, at the boundary sizes 1, a tile, a partition, and past the context),
    /// with a score scale other than 1/√head_dim, and chunking changes no bit.
    #[test]
    fn windowed_attention_matches_a_masked_reference_and_ignores_chunking() {
        let mut rng = StdRng::seed_from_u64(12);
        let (nh, nkv, hd, total) = (4, 1, 16, 1300);
        let (qd, row) = (nh * hd, nkv * hd);
        let q = rand_vec(&mut rng, total * qd);
        let k = rand_vec(&mut rng, total * row);
        let v = rand_vec(&mut rng, total * row);
        for w in [1, 5, 128, 129, 512, 700, 5000] {
            let heads = AttnHeads {
                scale: 0.3,
                window: Some(w),
                ..AttnHeads::causal(nh, nkv, hd)
            };
            let run = |pos0: usize, len: usize| {
                let mut out = vec![0.0; len * qd];
                let seq = AttnSeq {
                    row0: 0,
                    tokens: len,
                    pos0,
                    kv: ContiguousRows { row },
                };
                let qs = &q[pos0 * qd..(pos0 + len) * qd];
                attention_batch(
                    qs,
                    KvRows::from_slices(&k, &v),
                    &mut out,
                    heads,
                    None,
                    &[seq],
                );
                out
            };
            let whole = run(0, total);
            for p in [0, 1, w.saturating_sub(1), w, w + 1, 777, total - 1] {
                let p = p.min(total - 1);
                for h in 0..nh {
                    let qv = &q[(p * nh + h) * hd..][..hd];
                    let keys = (p + 1).saturating_sub(w)..p + 1;
                    let sc: Vec<f64> = keys
                        .clone()
                        .map(|j| {
                            let kr = &k[j * row..][..hd];
                            qv.iter()
                                .zip(kr)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                                * 0.3
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                    for d in 0..hd {
                        let want: f64 = keys
                            .clone()
                            .zip(&sc)
                            .map(|(j, s)| (s - mx).exp() / sum * v[j * row + d] as f64)
                            .sum();
                        let got = whole[(p * nh + h) * hd + d] as f64;
                        assert!(
                            (got - want).abs() < 1e-5,
                            "w {w} p {p} h {h}: {got} vs {want}"
                        );
                    }
                }
            }
            let mut pos = 0;
            for len in [1, 37, 200, 300, 161, 1, 600] {
                assert_eq!(
                    bits(&run(pos, len)),
                    bits(&whole[pos * qd..(pos + len) * qd]),
                    "w {w}: chunk at {pos}"
                );
                pos += len;
            }
        }
    }

    #[test]
    fn attention_rows_do_not_depend_on_chunking_batching_or_pages() {
        let mut rng = StdRng::seed_from_u64(9);
        let (nh, nkv, hd, total, bs) = (6, 2, 16, 700, 4);
        let row = nkv * hd;
        let heads = AttnHeads::causal(nh, nkv, hd);
        let q = rand_vec(&mut rng, total * nh * hd);
        let k = rand_vec(&mut rng, total * row);
        let v = rand_vec(&mut rng, total * row);
        let shape = |tokens, pos0| AttnShape {
            tokens,
            pos0,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
        };
        let qd = nh * hd;
        let mut whole = vec![0.0; total * qd];
        attention(&q, &k, &v, &mut whole, shape(total, 0));
        // Chunked as a scheduler might (one decode row at the end, across a partition).
        let mut pos = 0;
        for len in [1, 37, 200, 300, 161, 1] {
            let mut part = vec![0.0; len * qd];
            attention(
                &q[pos * qd..(pos + len) * qd],
                &k,
                &v,
                &mut part,
                shape(len, pos),
            );
            assert_eq!(
                bits(&part),
                bits(&whole[pos * qd..(pos + len) * qd]),
                "chunk at {pos}"
            );
            pos += len;
        }
        // Paged at shuffled pages, in a batch with a second sequence sharing the pool.
        let pages_total = 2 * total.div_ceil(bs);
        let mut order: Vec<u32> = (0..pages_total as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        let (mine, other) = order.split_at(total.div_ceil(bs));
        let mut kp = rand_vec(&mut rng, pages_total * bs * row);
        let mut vp = rand_vec(&mut rng, pages_total * bs * row);
        let mine_rows = PagedRows {
            pages: mine,
            block_size: bs,
            row,
        };
        for p in 0..total {
            let at = mine_rows.row_offset(p);
            kp[at..at + row].copy_from_slice(&k[p * row..(p + 1) * row]);
            vp[at..at + row].copy_from_slice(&v[p * row..(p + 1) * row]);
        }
        // Rows: 3 of the other sequence's queries, then positions 600..700 of ours.
        let q_other = rand_vec(&mut rng, 3 * qd);
        let qb = [q_other, q[600 * qd..].to_vec()].concat();
        let seqs = [
            AttnSeq {
                row0: 0,
                tokens: 3,
                pos0: 50,
                kv: PagedRows {
                    pages: other,
                    block_size: bs,
                    row,
                },
            },
            AttnSeq {
                row0: 3,
                tokens: 100,
                pos0: 600,
                kv: mine_rows,
            },
        ];
        let mut out = vec![0.0; 103 * qd];
        attention_batch(
            &qb,
            KvRows::from_slices(&kp, &vp),
            &mut out,
            heads,
            None,
            &seqs,
        );
        assert_eq!(bits(&out[3 * qd..]), bits(&whole[600 * qd..]));
    }

    /// Attention over a 16-bit cache is bitwise attention over the same values widened to
    /// f32 (the kernels widen in registers and keep the f32 order), with every kernel this
    /// machine has; and it stays close to the naive f64 softmax over the unrounded values
    /// (the rounding is the only difference a 16-bit cache makes).
    fn check_16_bit<T: KvElem>(tol: f32) {
        let mut rng = StdRng::seed_from_u64(17);
        let (nh, nkv, hd) = (6, 2, 64);
        for (tokens, pos0) in [(1, 700), (40, 0), (3, 1100)] {
            let total = pos0 + tokens;
            let q = rand_vec(&mut rng, tokens * nh * hd);
            let (k, v) = (
                rand_vec(&mut rng, total * nkv * hd),
                rand_vec(&mut rng, total * nkv * hd),
            );
            let round = |x: &[f32]| -> Vec<T> { x.iter().map(|&x| T::from_f32(x)).collect() };
            let (kt, vt) = (round(&k), round(&v));
            let widen = |x: &[T]| -> Vec<f32> { x.iter().map(|x| x.to_f32()).collect() };
            let (kw, vw) = (widen(&kt), widen(&vt));
            let shape = AttnShape {
                tokens,
                pos0,
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
            };
            let mut want = vec![0.0; tokens * nh * hd];
            attention(&q, &kw, &vw, &mut want, shape);
            let mut got = vec![0.0; tokens * nh * hd];
            attention(&q, &kt, &vt, &mut got, shape);
            assert_eq!(bits(&got), bits(&want), "{} at {pos0}", T::NAME);
            // Each kernel by name (the dispatcher above took the best one).
            let (heads, seq) = shape.batch_of_one();
            let seq = [seq];
            let rows = KvRows::from_slices(&kt, &vt);
            let mut out = vec![0.0; tokens * nh * hd];
            attention_with(BUILD_KERNEL, &q, rows, &mut out, heads, None, &seq);
            assert_eq!(bits(&out), bits(&want), "build kernel, {}", T::NAME);
            attention_with(
                super::super::dot::Portable,
                &q,
                rows,
                &mut out,
                heads,
                None,
                &seq,
            );
            assert_eq!(bits(&out), bits(&want), "portable kernel, {}", T::NAME);
            let naive = attention_naive(&q, &k, &v, shape);
            let err = naive
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err < tol, "{}: {err} from the unrounded values", T::NAME);
        }
    }

    #[test]
    fn attention_over_16_bit_kv_is_the_f32_attention_over_its_widened_values() {
        check_16_bit::<half::bf16>(2e-2);
        check_16_bit::<half::f16>(2e-3);
        check_16_bit::<f32>(1e-5);
    }

    #[test]
    fn linear_matches_naive() {
        let mut rng = StdRng::seed_from_u64(3);
        for &(m, k, n) in &[(1, 33, 70), (3, 64, 130), (17, 40, 9)] {
            let x = rand_vec(&mut rng, m * k);
            let w = rand_vec(&mut rng, n * k);
            let b = rand_vec(&mut rng, n);
            let mut out = vec![0.0; m * n];
            linear(&x, &w, Some(&b), &mut out, m, k, n);
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|t| x[i * k + t] * w[j * k + t]).sum::<f32>() + b[j];
                    assert!((out[i * n + j] - want).abs() < 1e-4);
                }
            }
        }
    }
}
