//! The inner loop of the CPU halves bound (`page_head_bounds`): for one mask row (16 keys
//! of a page) and one KV head's query heads, each key's sum over the channels of its
//! half's term. The portable loop defines the arithmetic: per key, in channel order from
//! 0.0, add the lower half's term where the key's mask bit is clear, the upper half's
//! where it is set. The AVX-512 kernel does the same operations (a blend picks the term,
//! exactly; one add per channel, in order) with the 16 keys in one register, the mask
//! row's bits as the blend's mask, and up to 4 query heads' sums side by side (a KV head's
//! query heads read the same bits; independent sums hide the adds' latency). A test
//! checks they agree bitwise.

/// Keys one mask row covers (`sparse::MASK_TOKENS`).
pub const KEYS: usize = super::MASK_TOKENS;

/// A kernel of `row_sums`: `masks[head_dim]` (bit `t` of channel `c`: key `t` lies in
/// the channel's upper half), `lower`, `upper` `[group, head_dim]` (each query head's
/// terms of the two halves) → `sums[group]`, each the 16 keys' sums.
pub trait RowSums: Copy {
    fn row_sums(self, masks: &[u16], lower: &[f32], upper: &[f32], sums: &mut [[f32; KEYS]]);
}

/// The portable loop (`row_sums_portable`).
#[derive(Clone, Copy, Debug)]
pub struct Portable;

impl RowSums for Portable {
    #[inline(always)]
    fn row_sums(self, masks: &[u16], lower: &[f32], upper: &[f32], sums: &mut [[f32; KEYS]]) {
        row_sums_portable(masks, lower, upper, sums)
    }
}

#[cfg(target_arch = "x86_64")]
pub use crate::device::cpu::dot::Avx512;

#[cfg(target_arch = "x86_64")]
impl RowSums for Avx512 {
    #[inline(always)]
    fn row_sums(self, masks: &[u16], lower: &[f32], upper: &[f32], sums: &mut [[f32; KEYS]]) {
        check_lengths(masks, lower, upper, sums);
        // SAFETY: an `Avx512` exists only once AVX-512F was detected; lengths checked.
        unsafe { row_sums_avx512(masks, lower, upper, sums) }
    }
}

fn check_lengths(masks: &[u16], lower: &[f32], upper: &[f32], sums: &[[f32; KEYS]]) {
    let hd = masks.len();
    assert!(
        lower.len() == sums.len() * hd && upper.len() == lower.len(),
        "row_sums: terms [group, head_dim]"
    );
}

/// The definition (and the kernel without AVX-512): one head at a time, the 16 sums kept
/// in registers across the channels (9 instructions a channel with AVX2).
pub fn row_sums_portable(masks: &[u16], lower: &[f32], upper: &[f32], sums: &mut [[f32; KEYS]]) {
    check_lengths(masks, lower, upper, sums);
    let hd = masks.len();
    for ((lower, upper), out) in lower.chunks_exact(hd).zip(upper.chunks_exact(hd)).zip(sums) {
        let mut s = [0.0f32; KEYS];
        for ((&bits, &lo), &up) in masks.iter().zip(lower).zip(upper) {
            // Key t's bit moved to the sign bit of lane t: a blend reads just that.
            let lanes: [i32; KEYS] = std::array::from_fn(|t| ((bits as u32) << (31 - t)) as i32);
            for (s, &l) in s.iter_mut().zip(&lanes) {
                *s += if l < 0 { up } else { lo };
            }
        }
        *out = s;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_sums_avx512(masks: &[u16], lower: &[f32], upper: &[f32], sums: &mut [[f32; KEYS]]) {
    let hd = masks.len();
    let mut head = 0;
    while head < sums.len() {
        let n = (sums.len() - head).min(4);
        let (lo, up) = (&lower[head * hd..][..n * hd], &upper[head * hd..][..n * hd]);
        let out = &mut sums[head..head + n];
        // Monomorphized per group width: the sums stay in registers.
        match n {
            4 => heads_avx512::<4>(masks, lo, up, out),
            3 => heads_avx512::<3>(masks, lo, up, out),
            2 => heads_avx512::<2>(masks, lo, up, out),
            _ => heads_avx512::<1>(masks, lo, up, out),
        }
        head += n;
    }
}

/// `N` query heads' sums (`row_sums`), one 16-lane register each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn heads_avx512<const N: usize>(
    masks: &[u16],
    lower: &[f32],
    upper: &[f32],
    sums: &mut [[f32; KEYS]],
) {
    use std::arch::x86_64::{
        _mm512_add_ps, _mm512_mask_blend_ps, _mm512_set1_ps, _mm512_setzero_ps,
    };
    let hd = masks.len();
    let lower: [&[f32]; N] = std::array::from_fn(|j| &lower[j * hd..][..hd]);
    let upper: [&[f32]; N] = std::array::from_fn(|j| &upper[j * hd..][..hd]);
    let mut acc = [_mm512_setzero_ps(); N];
    for (c, &bits) in masks.iter().enumerate() {
        for j in 0..N {
            // Lane t takes the upper term where bit t is set: key t's half.
            let term = _mm512_mask_blend_ps(
                bits,
                _mm512_set1_ps(lower[j][c]),
                _mm512_set1_ps(upper[j][c]),
            );
            acc[j] = _mm512_add_ps(acc[j], term);
        }
    }
    for (out, acc) in sums.iter_mut().zip(acc) {
        // SAFETY: a __m512 is 16 f32 lanes in memory order.
        *out = unsafe { std::mem::transmute::<std::arch::x86_64::__m512, [f32; KEYS]>(acc) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// The kernel this machine runs gives the portable loop's bits, for every group width
    /// the chunking of 4 produces, on terms of mixed sign and magnitude (rounding shows).
    /// Without AVX-512 on the test machine only the portable loop's definition is checked.
    #[test]
    fn the_kernel_reproduces_the_portable_sums_bitwise() {
        let mut rng = StdRng::seed_from_u64(5);
        for (group, hd) in [(1, 64), (2, 128), (3, 64), (4, 64), (5, 32), (9, 64)] {
            let masks: Vec<u16> = (0..hd).map(|_| rng.random()).collect();
            let mut terms = || -> Vec<f32> {
                (0..group * hd)
                    .map(|_| rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-3..4)))
                    .collect()
            };
            let (lower, upper) = (terms(), terms());
            let (mut want, mut got) = (vec![[0.0; KEYS]; group], vec![[0.0; KEYS]; group]);
            row_sums_portable(&masks, &lower, &upper, &mut want);
            #[cfg(target_arch = "x86_64")]
            if let Some(kernel) = Avx512::detect() {
                kernel.row_sums(&masks, &lower, &upper, &mut got);
            } else {
                got.clone_from(&want);
            }
            let bits = |v: &[[f32; KEYS]]| -> Vec<u32> {
                v.iter().flatten().map(|x| x.to_bits()).collect()
            };
            assert_eq!(bits(&got), bits(&want), "group {group}, head_dim {hd}");
            // And the portable loop is the definition: key t of head j, channel order.
            let (j, t) = (group - 1, 13);
            let mut s = 0.0f32;
            for c in 0..hd {
                s += if masks[c] >> t & 1 == 1 {
                    upper[j * hd + c]
                } else {
                    lower[j * hd + c]
                };
            }
            assert_eq!(
                want[j][t].to_bits(),
                s.to_bits(),
                "group {group}, head_dim {hd}"
            );
        }
    }
}
