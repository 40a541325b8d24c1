//! The inner loop of the CPU halves bound (`page_head_bounds`): for one mask row (up to 16
//! keys of a page) and one KV head's query heads, each key's sum over the channels of its
//! half's term, and the largest of them folded into each head's page bound.
//!
//! The portable loop defines the arithmetic: per key, in channel order from 0.0, add the
//! lower half's term where the key's mask bit is clear, the upper half's where it is set;
//! then, key by key, a sum replaces the bound when it is larger (`>`), starting from the
//! page's first key. The AVX-512 kernel does the same operations (a blend picks the term,
//! exactly; one add per channel, in order) with the 16 keys in one register, the mask
//! row's bits as the blend's mask, and up to 4 query heads' sums side by side (a KV head's
//! query heads read the same bits; independent sums hide the adds' latency). Its maximum
//! is a tree over the lanes, which gives the sequential fold's bits whenever no sum is a
//! NaN or a zero (then equal sums are equal bits); otherwise it runs the fold itself. A
//! test checks the kernels agree bitwise, NaNs and zeros included.

use super::MASK_TOKENS as KEYS; // keys one mask row covers

/// One mask row of a page, with one KV head's query heads' terms (`RowFold`).
#[derive(Clone, Copy, Debug)]
pub struct Row<'a> {
    /// `[head_dim]`: bit `t` of channel `c` set when key `t` lies in the channel's upper
    /// half.
    pub masks: &'a [u16],
    /// `[group, head_dim]`: each query head's term of the channel's lower half.
    pub lower: &'a [f32],
    /// `[group, head_dim]`: and of its upper half.
    pub upper: &'a [f32],
    /// Keys in the row, 1 to 16: lanes past them are not keys.
    pub keys: usize,
    /// The page's first row: its first key's sum replaces the bound so far.
    pub first: bool,
}

impl Row<'_> {
    /// Panics unless the terms are `[best.len(), head_dim]` and `keys` fits a row.
    fn check(&self, best: &[f32]) {
        let hd = self.masks.len();
        assert!(
            self.lower.len() == best.len() * hd && self.upper.len() == self.lower.len(),
            "fold_row: terms [group, head_dim]"
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
        let hd = row.masks.len();
        let terms = row.lower.chunks_exact(hd).zip(row.upper.chunks_exact(hd));
        for ((lower, upper), best) in terms.zip(best) {
            let sums = row_sums(row.masks, lower, upper);
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

/// One query head's 16 key sums (the definition): the 16 sums kept in registers across
/// the channels (9 instructions a channel with AVX2).
#[inline(always)]
fn row_sums(masks: &[u16], lower: &[f32], upper: &[f32]) -> [f32; KEYS] {
    let mut s = [0.0f32; KEYS];
    for ((&bits, &lo), &up) in masks.iter().zip(lower).zip(upper) {
        // Key t's bit moved to the sign bit of lane t: a blend reads just that.
        let lanes: [i32; KEYS] = std::array::from_fn(|t| ((bits as u32) << (31 - t)) as i32);
        for (s, &l) in s.iter_mut().zip(&lanes) {
            *s += if l < 0 { up } else { lo };
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
    let hd = row.masks.len();
    let mut head = 0;
    while head < best.len() {
        let n = (best.len() - head).min(4);
        let heads = Row {
            lower: &row.lower[head * hd..][..n * hd],
            upper: &row.upper[head * hd..][..n * hd],
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
        lower,
        upper,
        keys,
        first,
    } = *row;
    let hd = masks.len();
    assert!(lower.len() >= N * hd && upper.len() >= N * hd);
    // Raw pointers: slices' bounds checks and lengths would double the loop's
    // instructions and spill its registers (the loop issues ~3N + 4 per channel).
    let lower: [*const f32; N] = std::array::from_fn(|j| lower[j * hd..].as_ptr());
    let upper: [*const f32; N] = std::array::from_fn(|j| upper[j * hd..].as_ptr());
    let mut acc = [_mm512_setzero_ps(); N];
    for (c, &bits) in masks.iter().enumerate() {
        for j in 0..N {
            // SAFETY: c < hd, and each head's terms are hd long (asserted above).
            let (lo, up) = unsafe { (*lower[j].add(c), *upper[j].add(c)) };
            // Lane t takes the upper term where bit t is set: key t's half.
            let term = _mm512_mask_blend_ps(bits, _mm512_set1_ps(lo), _mm512_set1_ps(up));
            acc[j] = _mm512_add_ps(acc[j], term);
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
            let masks: Vec<u16> = (0..hd)
                .map(|_| match case % 4 {
                    0 => rng.random::<u16>() & 0x00ff, // half the keys tie
                    _ => rng.random(),
                })
                .collect();
            let special = case % 7; // 0: a NaN term, 1: all-zero terms, 2: -0.0 terms
            let mut terms = |which: usize| -> Vec<f32> {
                (0..group * hd)
                    .map(|i| match special {
                        0 if i == 3 && which == 1 => f32::NAN,
                        1 => 0.0,
                        2 => -0.0,
                        _ => rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-3..4)),
                    })
                    .collect()
            };
            let (lower, upper) = (terms(0), terms(1));
            let start: Vec<f32> = (0..group)
                .map(|j| [f32::NAN, 0.0, -0.0, 1.5, -100.0][(case + j) % 5])
                .collect();
            let row = Row {
                masks: &masks,
                lower: &lower,
                upper: &upper,
                keys,
                first,
            };
            let mut want = start.clone();
            Portable.fold_row(&row, &mut want);
            // The portable loop is the definition: key by key, channel order.
            for (j, &w) in want.iter().enumerate() {
                let mut b = start[j];
                for t in 0..keys {
                    let mut s = 0.0f32;
                    for (c, m) in masks.iter().enumerate() {
                        let i = j * hd + c;
                        s += if m >> t & 1 == 1 { upper[i] } else { lower[i] };
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
