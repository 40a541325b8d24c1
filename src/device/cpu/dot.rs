//! The one reduction order of `linear` and attention scores, and the micro-kernels that
//! compute it: a dot product over `k` is 16 lanes, lane `l` accumulating `a[p]·b[p]` for
//! `p ≡ l (mod 16)` by fused multiply-adds in increasing `p`; then a fixed tree over the
//! lanes; then the tail (`k mod 16` elements) fused in, in order.
//!
//! The portable kernel defines that order lane by lane. The AVX2 (two 8-wide registers a
//! dot) and AVX-512 (one 16-wide register) kernels reproduce it exactly: a vector FMA is a
//! correctly rounded `mul_add` per lane, as the portable `f32::mul_add` is on every target.
//! Only the register blocking (how many dots share their loads) differs between them, and
//! it never changes a dot's operations. A test checks the kernels agree bitwise.

/// Lanes of every fixed-order dot.
pub const LANES: usize = 16;

/// `R × C` dot products `xs[r] · ws[c]` of slices of one length.
pub trait DotKernel: Copy + Send + Sync {
    fn block<const R: usize, const C: usize>(
        self,
        xs: &[&[f32]; R],
        ws: &[&[f32]; C],
    ) -> [[f32; C]; R];
}

/// `R × C` fixed-order dots with the best kernel the build targets (AVX2 on x86-64-v3).
#[inline(always)]
pub fn dot_block<const R: usize, const C: usize>(
    xs: &[&[f32]; R],
    ws: &[&[f32]; C],
) -> [[f32; C]; R] {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        Avx2.block(xs, ws)
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        Portable.block(xs, ws)
    }
}

/// One fixed-order dot product.
#[inline]
pub fn dot_fixed(a: &[f32], b: &[f32]) -> f32 {
    dot_block(&[a], &[b])[0][0]
}

fn check_lengths<const R: usize, const C: usize>(xs: &[&[f32]; R], ws: &[&[f32]; C]) -> usize {
    let k = if R > 0 { xs[0].len() } else { 0 };
    assert!(
        xs.iter().chain(ws.iter()).all(|s| s.len() == k),
        "dot_block: slices of different lengths"
    );
    k
}

#[inline(always)]
pub(super) fn sum_lanes(a: &[f32; LANES]) -> f32 {
    let h: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]))
}

/// The lane sums, then the tail fused in order: the end of every fixed-order dot.
#[inline(always)]
fn finish<const R: usize, const C: usize>(
    xs: &[&[f32]; R],
    ws: &[&[f32]; C],
    acc: &[[[f32; LANES]; C]; R],
    body: usize,
) -> [[f32; C]; R] {
    std::array::from_fn(|r| {
        std::array::from_fn(|c| {
            let mut s = sum_lanes(&acc[r][c]);
            for q in body..xs[r].len() {
                s = xs[r][q].mul_add(ws[c][q], s);
            }
            s
        })
    })
}

/// The reference order, lane by lane, on any target.
#[derive(Clone, Copy, Debug)]
pub struct Portable;

impl DotKernel for Portable {
    #[inline(always)]
    fn block<const R: usize, const C: usize>(
        self,
        xs: &[&[f32]; R],
        ws: &[&[f32]; C],
    ) -> [[f32; C]; R] {
        let k = check_lengths(xs, ws);
        let body = k - k % LANES;
        let mut acc = [[[0.0f32; LANES]; C]; R];
        for p in (0..body).step_by(LANES) {
            for c in 0..C {
                for r in 0..R {
                    for l in 0..LANES {
                        acc[r][c][l] = xs[r][p + l].mul_add(ws[c][p + l], acc[r][c][l]);
                    }
                }
            }
        }
        finish(xs, ws, &acc, body)
    }
}

/// AVX2 + FMA, enabled at compile time (the x86-64-v3 build): lanes 0–7 and 8–15 of a dot
/// in two registers (`linear` uses 2 × 3 blocks: 12 accumulators, 4 inputs, of 16).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[derive(Clone, Copy, Debug)]
pub struct Avx2;

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
impl DotKernel for Avx2 {
    #[inline(always)]
    fn block<const R: usize, const C: usize>(
        self,
        xs: &[&[f32]; R],
        ws: &[&[f32]; C],
    ) -> [[f32; C]; R] {
        use std::arch::x86_64::{__m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps};
        let k = check_lengths(xs, ws);
        let body = k - k % LANES;
        // SAFETY: the build enables AVX2 and FMA (cfg above); every load reads 8 floats
        // ending at or before `body <= k`, inside each slice (lengths checked).
        let acc: [[[f32; LANES]; C]; R] = unsafe {
            let mut acc = [[[_mm256_setzero_ps(); 2]; C]; R];
            let mut p = 0;
            while p < body {
                let xv: [[__m256; 2]; R] = std::array::from_fn(|r| {
                    let a = xs[r].as_ptr().add(p);
                    [_mm256_loadu_ps(a), _mm256_loadu_ps(a.add(8))]
                });
                for c in 0..C {
                    let b = ws[c].as_ptr().add(p);
                    let wv = [_mm256_loadu_ps(b), _mm256_loadu_ps(b.add(8))];
                    for r in 0..R {
                        for h in 0..2 {
                            acc[r][c][h] = _mm256_fmadd_ps(xv[r][h], wv[h], acc[r][c][h]);
                        }
                    }
                }
                p += LANES;
            }
            // [lanes 0..8, lanes 8..16] is the memory layout of [f32; 16].
            std::mem::transmute_copy(&acc)
        };
        finish(xs, ws, &acc, body)
    }
}

/// AVX-512F, detected at run time: one register a dot (`linear` uses 4 × 6 blocks: 24
/// accumulators, 4 inputs, of 32).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug)]
pub struct Avx512 {
    _detected: (),
}

#[cfg(target_arch = "x86_64")]
impl Avx512 {
    /// The kernel, if this CPU has AVX-512F.
    pub fn detect() -> Option<Self> {
        std::arch::is_x86_feature_detected!("avx512f").then_some(Self { _detected: () })
    }
}

#[cfg(target_arch = "x86_64")]
impl DotKernel for Avx512 {
    #[inline(always)]
    fn block<const R: usize, const C: usize>(
        self,
        xs: &[&[f32]; R],
        ws: &[&[f32]; C],
    ) -> [[f32; C]; R] {
        // SAFETY: an `Avx512` exists only once AVX-512F was detected.
        unsafe { avx512_block(xs, ws) }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_block<const R: usize, const C: usize>(
    xs: &[&[f32]; R],
    ws: &[&[f32]; C],
) -> [[f32; C]; R] {
    use std::arch::x86_64::{__m512, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_setzero_ps};
    let k = check_lengths(xs, ws);
    let body = k - k % LANES;
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let mut p = 0;
    while p < body {
        // No closures here: they would not inherit the target feature.
        let mut xv: [__m512; R] = [_mm512_setzero_ps(); R];
        for r in 0..R {
            // SAFETY: 16 floats ending at or before `body <= k`, inside the slice.
            xv[r] = unsafe { _mm512_loadu_ps(xs[r].as_ptr().add(p)) };
        }
        for c in 0..C {
            // SAFETY: as above.
            let wv = unsafe { _mm512_loadu_ps(ws[c].as_ptr().add(p)) };
            for r in 0..R {
                acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
            }
        }
        p += LANES;
    }
    // SAFETY: a __m512 is 16 f32 lanes in memory order.
    let acc: [[[f32; LANES]; C]; R] = unsafe { std::mem::transmute_copy(&acc) };
    finish(xs, ws, &acc, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn bits<const C: usize>(v: &[[f32; C]]) -> Vec<u32> {
        v.iter().flatten().map(|x| x.to_bits()).collect()
    }

    /// Every kernel on this machine gives the portable kernel's bits, on lengths with and
    /// without a tail. (Without AVX-512 on the test machine that kernel is not checked.)
    #[test]
    fn every_kernel_reproduces_the_portable_order_bitwise() {
        let mut rng = StdRng::seed_from_u64(11);
        for k in [1, 7, 15, 16, 17, 64, 100, 577] {
            let mut v = || -> Vec<f32> { (0..k).map(|_| rng.random_range(-1.0..1.0)).collect() };
            let x: Vec<Vec<f32>> = (0..4).map(|_| v()).collect();
            let w: Vec<Vec<f32>> = (0..6).map(|_| v()).collect();
            let xs: [&[f32]; 4] = std::array::from_fn(|i| x[i].as_slice());
            let ws: [&[f32]; 6] = std::array::from_fn(|i| w[i].as_slice());
            let want = Portable.block(&xs, &ws);
            assert_eq!(
                bits(&dot_block(&xs, &ws)),
                bits(&want),
                "compile-time kernel, k {k}"
            );
            #[cfg(target_arch = "x86_64")]
            if let Some(kern) = Avx512::detect() {
                assert_eq!(bits(&kern.block(&xs, &ws)), bits(&want), "AVX-512, k {k}");
            }
            // A plain sequential reference to catch a kernel that drops lanes.
            let naive: f64 = x[0]
                .iter()
                .zip(&w[0])
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            assert!((want[0][0] as f64 - naive).abs() < 1e-4, "k {k}");
        }
    }
}
