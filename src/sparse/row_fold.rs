//! The inner loop of the CPU box bound (`page_head_bounds`): for one mask row (up to 16
//! keys of a page) and one KV head's query heads, each key's sum over the channels of its
//! box's term, and the largest of them folded into each head's page bound.
//!
//! The portable loop defines the arithmetic: per key, in channel order from 0.0, add the
//! term of the box its bits in the mask planes name (`super::key_box`'s index: plane 0's
//! bit the most significant); then, key by key, a sum replaces the bound when it is larger
//! (`>`), starting from the page's first key. The AVX-512 kernel does the same operations
//! (a tree of blends picks the term, exactly: the last plane's bits choose within each
//! pair of boxes, plane 0's last; one add per channel, in order) with the 16 keys in one
//! register, the planes' bits as the blends' masks, and up to 4 query heads' sums side by
//! side (a KV head's query heads read the same bits; independent sums hide the adds'
//! latency). Its maximum
//! is a tree over the lanes, which gives the sequential fold's bits whenever no sum is a
//! NaN or a zero (then equal sums are equal bits); otherwise it runs the fold itself. A
//! test checks the kernels agree bitwise, NaNs and zeros included.

use super::MASK_TOKENS as KEYS; // keys one mask row covers
use super::{box_term, BOXES, KEY_BITS};

/// Channels whose terms of every box fill one 16-lane table (`Row::terms`' layout).
pub const TABLE_CHANNELS: usize = KEYS / BOXES;

/// Elements of one query head's terms in `Row::terms`: `head_dim` rounded up to whole
/// tables (a table's unused channels are never read).
pub fn head_terms(head_dim: usize) -> usize {
    head_dim.div_ceil(TABLE_CHANNELS) * TABLE_CHANNELS * BOXES
}

/// Where query head `j`'s term of box `b` of channel `c` lies in `Row::terms`:
/// `[group, ⌈head_dim / TABLE_CHANNELS⌉, BOXES, TABLE_CHANNELS]`, so the terms of channels
/// `TABLE_CHANNELS · g ..` are one table of 16, box-major: lane `b · TABLE_CHANNELS + c %
/// TABLE_CHANNELS`.
#[inline(always)]
pub fn term_index(head_dim: usize, j: usize, c: usize, b: usize) -> usize {
    let t = TABLE_CHANNELS;
    j * head_terms(head_dim) + (c / t) * BOXES * t + b * t + c % t
}

/// One mask row of a page, with one KV head's query heads' terms (`RowFold`).
#[derive(Clone, Copy, Debug)]
pub struct Row<'a> {
    /// `[KEY_BITS, head_dim]`: bit `t` of plane `b`, channel `c`: key `t`'s bit `b` in that
    /// channel (`super::meta_rows`).
    pub masks: &'a [u16],
    /// `[group, ⌈head_dim / TABLE_CHANNELS⌉, BOXES, TABLE_CHANNELS]` (`term_index`): each
    /// query head's term of each box of each channel.
    pub terms: &'a [f32],
    /// Keys in the row, 1 to 16: lanes past them are not keys.
    pub keys: usize,
    /// The page's first row: its first key's sum replaces the bound so far.
    pub first: bool,
}

impl Row<'_> {
    /// Panics unless the masks are `[KEY_BITS, head_dim]`, the terms `best.len()` heads'
    /// (`term_index`) and `keys` fits a row.
    fn check(&self, best: &[f32]) {
        let hd = self.masks.len() / KEY_BITS;
        assert!(
            self.masks.len() == KEY_BITS * hd && self.terms.len() == best.len() * head_terms(hd),
            "fold_row: masks [KEY_BITS, head_dim], terms [group, head_terms(head_dim)]"
        );
        assert!(
            (1..=KEYS).contains(&self.keys),
            "fold_row: 1 to {KEYS} keys"
        );
    }
}

/// A kernel of the row fold: the row's key sums folded into `best[group]`, each query
/// head's page bound so far; and the tables it reads.
pub trait RowFold: Copy {
    /// One query head's terms, `Row::terms` for `j` = 0: `q[head_dim]` and the page's
    /// `edges[BOXES + 1, head_dim]` (`super::box_edges_of_row`), box `b` of channel `c`
    /// term `box_term(q[c], edges[b][c], edges[b + 1][c])`.
    fn tables(self, q: &[f32], edges: &[f32], terms: &mut [f32]);
    fn fold_row(self, row: &Row, best: &mut [f32]);
}

/// Panics unless `q[head_dim]`, `edges[BOXES + 1, head_dim]` and `terms[head_terms]`.
fn check_tables(q: &[f32], edges: &[f32], terms: &[f32]) -> usize {
    let hd = q.len();
    assert!(
        edges.len() == (BOXES + 1) * hd && terms.len() == head_terms(hd),
        "tables: q [head_dim], edges [BOXES + 1, head_dim], terms [head_terms(head_dim)]"
    );
    hd
}

/// The portable loop (`row_sums` and `fold_keys`).
#[derive(Clone, Copy, Debug)]
pub struct Portable;

impl RowFold for Portable {
    #[inline(always)]
    fn tables(self, q: &[f32], edges: &[f32], terms: &mut [f32]) {
        let hd = check_tables(q, edges, terms);
        for b in 0..BOXES {
            let (lo, hi) = (&edges[b * hd..][..hd], &edges[(b + 1) * hd..][..hd]);
            for (c, ((&q, &lo), &hi)) in q.iter().zip(lo).zip(hi).enumerate() {
                terms[term_index(hd, 0, c, b)] = box_term(q, lo, hi);
            }
        }
    }

    #[inline(always)]
    fn fold_row(self, row: &Row, best: &mut [f32]) {
        row.check(best);
        let hd = row.masks.len() / KEY_BITS;
        for (terms, best) in row.terms.chunks_exact(head_terms(hd)).zip(best) {
            let sums = row_sums(row.masks, terms);
            *best = fold_keys(&sums[..row.keys], row.first, *best);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub use crate::device::cpu::dot::Avx512;

#[cfg(target_arch = "x86_64")]
impl RowFold for Avx512 {
    #[inline(always)]
    fn tables(self, q: &[f32], edges: &[f32], terms: &mut [f32]) {
        let hd = check_tables(q, edges, terms);
        if BOXES != 4 || !hd.is_multiple_of(KEYS) {
            // The kernel transposes quarters of 16 channels: other shapes take the definition.
            return Portable.tables(q, edges, terms);
        }
        // SAFETY: AVX-512F was detected; lengths checked.
        unsafe { tables_avx512(q, edges, terms) }
    }

    #[inline(always)]
    fn fold_row(self, row: &Row, best: &mut [f32]) {
        row.check(best);
        if !(row.masks.len() / KEY_BITS).is_multiple_of(TABLE_CHANNELS) {
            // A last table holding fewer channels: rare head sizes, left to the definition.
            return Portable.fold_row(row, best);
        }
        // SAFETY: an `Avx512` exists only once AVX-512F was detected; lengths checked.
        unsafe { fold_row_avx512(row, best) }
    }
}

/// One query head's 16 key sums (the definition): `masks[KEY_BITS, head_dim]`, `terms` the
/// head's (`term_index` with `j` = 0); per channel, each key adds the term of the box its
/// bits name.
#[inline(always)]
fn row_sums(masks: &[u16], terms: &[f32]) -> [f32; KEYS] {
    let hd = masks.len() / KEY_BITS;
    let mut s = [0.0f32; KEYS];
    for c in 0..hd {
        for (t, s) in s.iter_mut().enumerate() {
            let j = (0..KEY_BITS).fold(0, |j, b| j << 1 | (masks[b * hd + c] >> t & 1) as usize);
            *s += terms[term_index(hd, 0, c, j)];
        }
    }
    s
}

/// The keys' sums folded into a head's bound (the definition): from the first sum when
/// `first`, each later one taken when it is larger (branch-free).
#[inline(always)]
fn fold_keys(sums: &[f32], first: bool, best: f32) -> f32 {
    let (start, rest) = match first {
        true => (sums[0], &sums[1..]),
        false => (best, sums),
    };
    rest.iter().fold(start, |b, &s| if s > b { s } else { b })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fold_row_avx512(row: &Row, best: &mut [f32]) {
    let hd = row.masks.len() / KEY_BITS;
    let mut head = 0;
    while head < best.len() {
        let n = (best.len() - head).min(4);
        let heads = Row {
            terms: &row.terms[head * head_terms(hd)..][..n * head_terms(hd)],
            ..*row
        };
        let best = &mut best[head..head + n];
        // Monomorphized per group width: the sums stay in registers.
        match n {
            4 => heads_avx512::<4>(&heads, best),
            3 => heads_avx512::<3>(&heads, best),
            2 => heads_avx512::<2>(&heads, best),
            _ => heads_avx512::<1>(&heads, best),
        }
        head += n;
    }
}

/// `RowFold::tables` with `BOXES` = 4, `head_dim` a multiple of 16: per 16 channels, each
/// box's 16 terms in one register (`box_term`'s operations lane by lane), then a 4 × 4
/// transpose of their 4-channel quarters makes the 4 tables (`term_index`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn tables_avx512(q: &[f32], edges: &[f32], terms: &mut [f32]) {
    use std::arch::x86_64::{
        __m512, _mm512_cmp_ps_mask, _mm512_loadu_ps, _mm512_mask_blend_ps, _mm512_mul_ps,
        _mm512_shuffle_f32x4, _mm512_storeu_ps, _CMP_GT_OQ,
    };
    const { assert!(BOXES == 4 && TABLE_CHANNELS == 4) };
    let hd = q.len();
    assert!(
        hd.is_multiple_of(KEYS) && edges.len() == (BOXES + 1) * hd && terms.len() == BOXES * hd
    );
    for k in (0..hd).step_by(KEYS) {
        // SAFETY (every load and store below): k + 16 ≤ hd, rows of hd (asserted above).
        let qv = unsafe { _mm512_loadu_ps(q.as_ptr().add(k)) };
        let edge = |b: usize| unsafe { _mm512_loadu_ps(edges.as_ptr().add(b * hd + k)) };
        let t: [__m512; BOXES] = std::array::from_fn(|b| {
            let (lo, hi) = (_mm512_mul_ps(qv, edge(b)), _mm512_mul_ps(qv, edge(b + 1)));
            // box_term: the product with lo where it is larger (`>`), else with hi.
            _mm512_mask_blend_ps(_mm512_cmp_ps_mask(lo, hi, _CMP_GT_OQ), hi, lo)
        });
        // Quarters [t0.m, t1.m, t2.m, t3.m] → table m (channels k + 4m ..).
        let a = _mm512_shuffle_f32x4::<0x44>(t[0], t[1]); // t0.0 t0.1 t1.0 t1.1
        let b = _mm512_shuffle_f32x4::<0x44>(t[2], t[3]); // t2.0 t2.1 t3.0 t3.1
        let c = _mm512_shuffle_f32x4::<0xEE>(t[0], t[1]); // t0.2 t0.3 t1.2 t1.3
        let d = _mm512_shuffle_f32x4::<0xEE>(t[2], t[3]); // t2.2 t2.3 t3.2 t3.3
        let tables = [
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
            _mm512_shuffle_f32x4::<0x88>(c, d),
            _mm512_shuffle_f32x4::<0xDD>(c, d),
        ];
        for (m, table) in tables.into_iter().enumerate() {
            // Table k / 4 + m starts at (k / 4 + m) · 16 = 4k + 16m.
            unsafe { _mm512_storeu_ps(terms.as_mut_ptr().add(4 * k + KEYS * m), table) };
        }
    }
}

/// `N` query heads' row fold (`RowFold`), one 16-lane register of sums each; `head_dim` a
/// multiple of `TABLE_CHANNELS`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn heads_avx512<const N: usize>(row: &Row, best: &mut [f32]) {
    use std::arch::x86_64::{
        __m512, __m512i, _mm512_add_ps, _mm512_cmp_ps_mask, _mm512_loadu_ps, _mm512_mask_add_epi32,
        _mm512_mask_reduce_max_ps, _mm512_permutexvar_ps, _mm512_set1_epi32, _mm512_setzero_ps,
        _CMP_EQ_OQ, _CMP_UNORD_Q,
    };
    let Row {
        masks,
        terms,
        keys,
        first,
    } = *row;
    let hd = masks.len() / KEY_BITS;
    let per_head = head_terms(hd);
    assert!(
        masks.len() == KEY_BITS * hd
            && hd.is_multiple_of(TABLE_CHANNELS)
            && terms.len() >= N * per_head
    );
    // Plane b's bit moves a lane's index by its box's weight, 2^(KEY_BITS − 1 − b) boxes.
    let steps: [__m512i; KEY_BITS] =
        std::array::from_fn(|b| _mm512_set1_epi32((TABLE_CHANNELS << (KEY_BITS - 1 - b)) as i32));
    let mut acc = [_mm512_setzero_ps(); N];
    for g in 0..hd / TABLE_CHANNELS {
        // SAFETY: table g of head j < N: 16 floats inside terms (asserted above).
        let tables: [__m512; N] = std::array::from_fn(|j| unsafe {
            _mm512_loadu_ps(terms.as_ptr().add(j * per_head + g * KEYS))
        });
        for i in 0..TABLE_CHANNELS {
            let c = g * TABLE_CHANNELS + i;
            // Lane t's index: its box · TABLE_CHANNELS + i (`term_index` within the table).
            let mut idx = _mm512_set1_epi32(i as i32);
            for (b, step) in steps.iter().enumerate() {
                idx = _mm512_mask_add_epi32(idx, masks[b * hd + c], idx, *step);
            }
            for (acc, table) in acc.iter_mut().zip(&tables) {
                *acc = _mm512_add_ps(*acc, _mm512_permutexvar_ps(idx, *table));
            }
        }
    }
    let valid = (((1u32 << keys) - 1) & 0xffff) as u16; // lanes of real keys
    for (best, acc) in best.iter_mut().zip(acc) {
        let special = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q)
            | _mm512_cmp_ps_mask(acc, _mm512_setzero_ps(), _CMP_EQ_OQ);
        if special & valid == 0 {
            // Distinct values or equal bits: any order of comparisons gives the fold's.
            let m = _mm512_mask_reduce_max_ps(valid, acc);
            *best = if first || m > *best { m } else { *best };
        } else {
            // SAFETY: a __m512 is 16 f32 lanes in memory order.
            let sums = unsafe { std::mem::transmute::<__m512, [f32; KEYS]>(acc) };
            *best = fold_keys(&sums[..keys], first, *best);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// The kernel's tables are the portable loop's bits, for head sizes the kernel
    /// transposes and ones it leaves to the definition, with NaN, infinite, zero (either
    /// sign) and mixed-sign values in the queries and edges; and the portable tables are
    /// `box_term` of each box's edges, at `term_index`.
    #[test]
    fn the_kernels_tables_are_the_definitions() {
        let mut rng = StdRng::seed_from_u64(6);
        let special = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1e-40];
        for case in 0..200 {
            let hd = [16, 32, 64, 128, 8, 12, 6][case % 7];
            let value = |rng: &mut StdRng| match rng.random_range(0..10) {
                0 => special[rng.random_range(0..special.len())],
                _ => rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-3..4)),
            };
            let q: Vec<f32> = (0..hd).map(|_| value(&mut rng)).collect();
            let edges: Vec<f32> = (0..(BOXES + 1) * hd).map(|_| value(&mut rng)).collect();
            let mut want = vec![0.0f32; head_terms(hd)];
            Portable.tables(&q, &edges, &mut want);
            for c in 0..hd {
                for b in 0..BOXES {
                    let t = box_term(q[c], edges[b * hd + c], edges[(b + 1) * hd + c]);
                    let got = want[term_index(hd, 0, c, b)];
                    assert_eq!(got.to_bits(), t.to_bits(), "case {case}: c {c}, box {b}");
                }
            }
            #[cfg(target_arch = "x86_64")]
            if let Some(kernel) = Avx512::detect() {
                let mut got = vec![0.0f32; head_terms(hd)];
                kernel.tables(&q, &edges, &mut got);
                for (c, b) in (0..hd).flat_map(|c| (0..BOXES).map(move |b| (c, b))) {
                    let i = term_index(hd, 0, c, b); // a padded table's unused lanes aside
                    assert_eq!(
                        got[i].to_bits(),
                        want[i].to_bits(),
                        "case {case}: {hd}, {c}, {b}"
                    );
                }
            }
        }
    }

    /// The kernel this machine runs gives the portable loop's bits, for every group width
    /// the chunking of 4 produces, partial rows, first and later rows, on terms of mixed
    /// sign and magnitude (rounding shows), with rows whose sums hold NaNs, zeros of
    /// either sign and ties. Without AVX-512 on the test machine only the portable loop's
    /// definition is checked.
    #[test]
    fn the_kernel_reproduces_the_portable_fold_bitwise() {
        let mut rng = StdRng::seed_from_u64(5);
        for case in 0..600 {
            let (group, hd) =
                [(1, 64), (2, 128), (3, 64), (4, 64), (5, 32), (9, 8), (3, 6)][case % 7];
            let keys = [16, 16, 1, 7, 15][case % 5];
            let first = case % 3 != 0;
            let masks: Vec<u16> = (0..KEY_BITS * hd)
                .map(|_| match case % 4 {
                    0 => rng.random::<u16>() & 0x00ff, // half the keys tie
                    _ => rng.random(),
                })
                .collect();
            let special = case % 7; // 0: a NaN term, 1: all-zero terms, 2: -0.0 terms
            let terms: Vec<f32> = (0..group * head_terms(hd)) // `term_index`
                .map(|i| match special {
                    0 if i == term_index(hd, 0, 3, 1) => f32::NAN,
                    1 => 0.0,
                    2 => -0.0,
                    _ => rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-3..4)),
                })
                .collect();
            let start: Vec<f32> = (0..group)
                .map(|j| [f32::NAN, 0.0, -0.0, 1.5, -100.0][(case + j) % 5])
                .collect();
            let row = Row {
                masks: &masks,
                terms: &terms,
                keys,
                first,
            };
            let mut want = start.clone();
            Portable.fold_row(&row, &mut want);
            // The portable loop is the definition: key by key, channel order, the box the
            // key's bits spell (plane 0 the most significant).
            for (j, &w) in want.iter().enumerate() {
                let mut b = start[j];
                for t in 0..keys {
                    let mut s = 0.0f32;
                    for c in 0..hd {
                        let mut x = 0;
                        for p in 0..KEY_BITS {
                            x = 2 * x + usize::from(masks[p * hd + c] >> t & 1 == 1);
                        }
                        s += terms[term_index(hd, j, c, x)];
                    }
                    if (first && t == 0) || s > b {
                        b = s;
                    }
                }
                assert_eq!(w.to_bits(), b.to_bits(), "case {case}, head {j}");
            }
            #[cfg(target_arch = "x86_64")]
            if let Some(kernel) = Avx512::detect() {
                let mut got = start.clone();
                kernel.fold_row(&row, &mut got);
                let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "case {case}: group {group}, keys {keys}"
                );
            }
        }
    }
}
