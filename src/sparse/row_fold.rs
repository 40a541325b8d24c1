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
use super::{BOXES, KEY_BITS};

/// One mask row of a page, with one KV head's query heads' terms (`RowFold`).
#[derive(Clone, Copy, Debug)]
pub struct Row<'a> {
    /// `[KEY_BITS, head_dim]`: bit `t` of plane `b`, channel `c`: key `t`'s bit `b` in that
    /// channel (`super::meta_rows`).
    pub masks: &'a [u16],
    /// `[group, BOXES, head_dim]`: each query head's term of each box of each channel.
    pub terms: &'a [f32],
    /// Keys in the row, 1 to 16: lanes past them are not keys.
    pub keys: usize,
    /// The page's first row: its first key's sum replaces the bound so far.
    pub first: bool,
}

impl Row<'_> {
    /// Panics unless the masks are `[KEY_BITS, head_dim]`, the terms `[best.len(), BOXES,
    /// head_dim]` and `keys` fits a row.
    fn check(&self, best: &[f32]) {
        let hd = self.masks.len() / KEY_BITS;
        assert!(
            self.masks.len() == KEY_BITS * hd && self.terms.len() == best.len() * BOXES * hd,
            "fold_row: masks [KEY_BITS, head_dim], terms [group, BOXES, head_dim]"
        );
        assert!(
            (1..=KEYS).contains(&self.keys),
            "fold_row: 1 to {KEYS} keys"
        );
    }
}

/// A kernel of the row fold: the row's key sums folded into `best[group]`, each query
/// head's page bound so far.
pub trait RowFold: Copy {
    fn fold_row(self, row: &Row, best: &mut [f32]);
}

/// The portable loop (`row_sums` and `fold_keys`).
#[derive(Clone, Copy, Debug)]
pub struct Portable;

impl RowFold for Portable {
    #[inline(always)]
    fn fold_row(self, row: &Row, best: &mut [f32]) {
        row.check(best);
        let hd = row.masks.len() / KEY_BITS;
        for (terms, best) in row.terms.chunks_exact(BOXES * hd).zip(best) {
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
    fn fold_row(self, row: &Row, best: &mut [f32]) {
        row.check(best);
        // SAFETY: an `Avx512` exists only once AVX-512F was detected; lengths checked.
        unsafe { fold_row_avx512(row, best) }
    }
}

/// One query head's 16 key sums (the definition): `masks[KEY_BITS, head_dim]`, `terms[BOXES,
/// head_dim]`; per channel, each key adds the term of the box its bits name.
#[inline(always)]
fn row_sums(masks: &[u16], terms: &[f32]) -> [f32; KEYS] {
    let hd = masks.len() / KEY_BITS;
    let mut s = [0.0f32; KEYS];
    for c in 0..hd {
        for (t, s) in s.iter_mut().enumerate() {
            let j = (0..KEY_BITS).fold(0, |j, b| j << 1 | (masks[b * hd + c] >> t & 1) as usize);
            *s += terms[j * hd + c];
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
            terms: &row.terms[head * BOXES * hd..][..n * BOXES * hd],
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

/// `N` query heads' row fold (`RowFold`), one 16-lane register of sums each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn heads_avx512<const N: usize>(row: &Row, best: &mut [f32]) {
    use std::arch::x86_64::{
        __m512, _mm512_add_ps, _mm512_cmp_ps_mask, _mm512_mask_blend_ps, _mm512_mask_reduce_max_ps,
        _mm512_set1_ps, _mm512_setzero_ps, _CMP_EQ_OQ, _CMP_UNORD_Q,
    };
    let Row {
        masks,
        terms,
        keys,
        first,
    } = *row;
    let hd = masks.len() / KEY_BITS;
    assert!(masks.len() == KEY_BITS * hd && terms.len() >= N * BOXES * hd);
    // Raw pointers: slices' bounds checks and lengths would double the loop's
    // instructions and spill its registers.
    let terms: [*const f32; N] = std::array::from_fn(|j| terms[j * BOXES * hd..].as_ptr());
    let mut acc = [_mm512_setzero_ps(); N];
    for c in 0..hd {
        let bits: [u16; KEY_BITS] = std::array::from_fn(|b| masks[b * hd + c]);
        for j in 0..N {
            // SAFETY: c < hd and x < BOXES: inside head j's [BOXES, hd] terms (asserted).
            let mut v: [__m512; BOXES] =
                std::array::from_fn(|x| _mm512_set1_ps(unsafe { *terms[j].add(x * hd + c) }));
            // The last plane picks within each pair of boxes (lane t takes the upper box
            // where key t's bit is set), then each earlier plane within the pairs left.
            let mut n = BOXES;
            for &bits in bits.iter().rev() {
                for i in 0..n / 2 {
                    v[i] = _mm512_mask_blend_ps(bits, v[2 * i], v[2 * i + 1]);
                }
                n /= 2;
            }
            acc[j] = _mm512_add_ps(acc[j], v[0]);
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

    /// The kernel this machine runs gives the portable loop's bits, for every group width
    /// the chunking of 4 produces, partial rows, first and later rows, on terms of mixed
    /// sign and magnitude (rounding shows), with rows whose sums hold NaNs, zeros of
    /// either sign and ties. Without AVX-512 on the test machine only the portable loop's
    /// definition is checked.
    #[test]
    fn the_kernel_reproduces_the_portable_fold_bitwise() {
        let mut rng = StdRng::seed_from_u64(5);
        for case in 0..600 {
            let (group, hd) = [(1, 64), (2, 128), (3, 64), (4, 64), (5, 32), (9, 8)][case % 6];
            let keys = [16, 16, 1, 7, 15][case % 5];
            let first = case % 3 != 0;
            let masks: Vec<u16> = (0..KEY_BITS * hd)
                .map(|_| match case % 4 {
                    0 => rng.random::<u16>() & 0x00ff, // half the keys tie
                    _ => rng.random(),
                })
                .collect();
            let special = case % 7; // 0: a NaN term, 1: all-zero terms, 2: -0.0 terms
            let terms: Vec<f32> = (0..group * BOXES * hd) // [group, BOXES, hd]
                .map(|i| match special {
                    0 if i == hd + 3 => f32::NAN,
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
                        s += terms[(j * BOXES + x) * hd + c];
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
