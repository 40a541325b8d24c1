//! Fixed-order dots straight off stored weight rows: each 16-value chunk of a row is
//! dequantized into registers and fused into the dot's 16 lane accumulators, with no f32
//! copy of the row in memory. This is `linear`'s small-batch (decode) path: there the cost
//! is reading and unpacking the weights once per token, and a scratch tile would be
//! written and read back for a single input row.
//!
//! **Bitwise equal to the f32 path.** A chunk's values are computed by the same IEEE
//! operations as `quant.rs` (same multiply-then-add, never fused, same order of scalar
//! scale products), and chunk `c` of a row feeds lanes `0..16` at positions
//! `16c..16c + 16`: exactly the sequence of `dot.rs`'s fixed order (then the same lane
//! tree, then the tail in order). So a row's result does not depend on whether `linear`
//! took this path or dequantized the tile first, i.e. on the batch size either.
//!
//! Each format is written once, over [`Lanes`]: 16 f32 and 16 i32 lanes with the few
//! operations the formats need. Three implementations: portable arrays (the reference,
//! any target), AVX2 (two 8-lane registers; the build's target) and AVX-512F (one
//! register; detected at run time).

use super::dot::{sum_lanes, Portable, LANES};
use super::quant::{self, Format};

/// Contiguous stored rows of one format: `bytes` holds `rows × row_bytes`.
#[derive(Clone, Copy)]
pub struct StoredRows<'a> {
    pub format: Format,
    pub bytes: &'a [u8],
    /// Values per row.
    pub cols: usize,
}

impl<'a> StoredRows<'a> {
    /// Row `r`'s bytes.
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self
            .format
            .row_bytes(self.cols)
            .expect("stored rows are whole blocks");
        &self.bytes[r * rb..(r + 1) * rb]
    }
}

/// `R × C` fixed-order dots `xs[r] · dequantize(ws[c])` of stored rows of one format.
pub trait StoredDot: Copy + Send + Sync {
    fn stored_block<const R: usize, const C: usize>(
        self,
        format: Format,
        xs: &[&[f32]; R],
        ws: &[&[u8]; C],
    ) -> [[f32; C]; R];
}

// ---------------------------------------------------------------------------------------
// the lanes

/// 16 lanes of f32 (`F`) and of i32 (`I`) and the operations the formats are built from.
///
/// # Safety
/// Implementations use CPU features; only call the methods where those are present (the
/// kernels below are entered through a feature check or a compile-time target).
trait Lanes {
    type F: Copy;
    type I: Copy;
    unsafe fn zero() -> Self::F;
    unsafe fn splat(x: f32) -> Self::F;
    /// 16 f32 at `p`.
    unsafe fn load(p: *const f32) -> Self::F;
    /// `a · b + c`, one rounding (as `f32::mul_add`).
    unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn add(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn sub(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn to_array(a: Self::F) -> [f32; LANES];
    /// 16 bytes at `p`, zero-extended.
    unsafe fn u8s(p: *const u8) -> Self::I;
    /// 16 bytes at `p`, sign-extended.
    unsafe fn i8s(p: *const u8) -> Self::I;
    /// 16 little-endian bf16 at `p`, widened (exact).
    unsafe fn bf16s(p: *const u8) -> Self::F;
    /// 16 little-endian f16 at `p`, widened (exact).
    unsafe fn f16s(p: *const u8) -> Self::F;
    unsafe fn splat_i(x: i32) -> Self::I;
    /// `0, 1, …, 15`.
    unsafe fn iota() -> Self::I;
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn sub_i(a: Self::I, b: Self::I) -> Self::I;
    /// Logical shifts by per-lane counts.
    unsafe fn shr(a: Self::I, by: Self::I) -> Self::I;
    unsafe fn shl(a: Self::I, by: Self::I) -> Self::I;
    /// Exact for the small integers of the formats.
    unsafe fn to_f(a: Self::I) -> Self::F;
}

/// The reference lanes: plain arrays, any target.
struct PortableLanes;

impl Lanes for PortableLanes {
    type F = [f32; LANES];
    type I = [i32; LANES];
    #[inline(always)]
    unsafe fn zero() -> Self::F {
        [0.0; LANES]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::F {
        [x; LANES]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::F {
        // SAFETY: the caller's pointer has 16 floats.
        unsafe { p.cast::<[f32; LANES]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F {
        std::array::from_fn(|l| a[l].mul_add(b[l], c[l]))
    }
    #[inline(always)]
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F {
        std::array::from_fn(|l| a[l] * b[l])
    }
    #[inline(always)]
    unsafe fn add(a: Self::F, b: Self::F) -> Self::F {
        std::array::from_fn(|l| a[l] + b[l])
    }
    #[inline(always)]
    unsafe fn sub(a: Self::F, b: Self::F) -> Self::F {
        std::array::from_fn(|l| a[l] - b[l])
    }
    #[inline(always)]
    unsafe fn to_array(a: Self::F) -> [f32; LANES] {
        a
    }
    #[inline(always)]
    unsafe fn u8s(p: *const u8) -> Self::I {
        // SAFETY: the caller's pointer has 16 bytes.
        let b = unsafe { p.cast::<[u8; LANES]>().read_unaligned() };
        b.map(i32::from)
    }
    #[inline(always)]
    unsafe fn i8s(p: *const u8) -> Self::I {
        // SAFETY: as above.
        let b = unsafe { p.cast::<[u8; LANES]>().read_unaligned() };
        b.map(|x| x as i8 as i32)
    }
    #[inline(always)]
    unsafe fn bf16s(p: *const u8) -> Self::F {
        let mut out = [0.0; LANES];
        // SAFETY: the caller's pointer has 32 bytes.
        let b = unsafe { std::slice::from_raw_parts(p, 2 * LANES) };
        quant::dequantize_generic(Format::Bf16, b, &mut out);
        out
    }
    #[inline(always)]
    unsafe fn f16s(p: *const u8) -> Self::F {
        let mut out = [0.0; LANES];
        // SAFETY: as above.
        let b = unsafe { std::slice::from_raw_parts(p, 2 * LANES) };
        quant::dequantize_generic(Format::F16, b, &mut out);
        out
    }
    #[inline(always)]
    unsafe fn splat_i(x: i32) -> Self::I {
        [x; LANES]
    }
    #[inline(always)]
    unsafe fn iota() -> Self::I {
        std::array::from_fn(|l| l as i32)
    }
    #[inline(always)]
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I {
        std::array::from_fn(|l| a[l] & b[l])
    }
    #[inline(always)]
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I {
        std::array::from_fn(|l| a[l] | b[l])
    }
    #[inline(always)]
    unsafe fn sub_i(a: Self::I, b: Self::I) -> Self::I {
        std::array::from_fn(|l| a[l].wrapping_sub(b[l]))
    }
    #[inline(always)]
    unsafe fn shr(a: Self::I, by: Self::I) -> Self::I {
        std::array::from_fn(|l| ((a[l] as u32) >> by[l]) as i32)
    }
    #[inline(always)]
    unsafe fn shl(a: Self::I, by: Self::I) -> Self::I {
        std::array::from_fn(|l| ((a[l] as u32) << by[l]) as i32)
    }
    #[inline(always)]
    unsafe fn to_f(a: Self::I) -> Self::F {
        a.map(|x| x as f32)
    }
}

/// Lanes 0–7 and 8–15 in two AVX2 registers (the x86-64-v3 build's target; F16C too).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
mod avx2 {
    use super::{Lanes, LANES};
    use std::arch::x86_64::*;

    pub(super) struct Avx2Lanes;

    macro_rules! both {
        ($f:ident($($a:ident),*)) => {
            [$f($($a[0]),*), $f($($a[1]),*)]
        };
    }

    // SAFETY (every method): the build targets AVX2 and FMA (cfg above); pointers
    // are the caller's, valid for the bytes each method reads.
    impl Lanes for Avx2Lanes {
        type F = [__m256; 2];
        type I = [__m256i; 2];
        #[inline(always)]
        unsafe fn zero() -> Self::F {
            [_mm256_setzero_ps(); 2]
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self::F {
            [_mm256_set1_ps(x); 2]
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self::F {
            unsafe { [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))] }
        }
        #[inline(always)]
        unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F {
            both!(_mm256_fmadd_ps(a, b, c))
        }
        #[inline(always)]
        unsafe fn mul(a: Self::F, b: Self::F) -> Self::F {
            both!(_mm256_mul_ps(a, b))
        }
        #[inline(always)]
        unsafe fn add(a: Self::F, b: Self::F) -> Self::F {
            both!(_mm256_add_ps(a, b))
        }
        #[inline(always)]
        unsafe fn sub(a: Self::F, b: Self::F) -> Self::F {
            both!(_mm256_sub_ps(a, b))
        }
        #[inline(always)]
        unsafe fn to_array(a: Self::F) -> [f32; LANES] {
            unsafe { std::mem::transmute::<[__m256; 2], [f32; LANES]>(a) }
        }
        #[inline(always)]
        unsafe fn u8s(p: *const u8) -> Self::I {
            unsafe {
                let v = _mm_loadu_si128(p.cast());
                [
                    _mm256_cvtepu8_epi32(v),
                    _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v)),
                ]
            }
        }
        #[inline(always)]
        unsafe fn i8s(p: *const u8) -> Self::I {
            unsafe {
                let v = _mm_loadu_si128(p.cast());
                [
                    _mm256_cvtepi8_epi32(v),
                    _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v)),
                ]
            }
        }
        #[inline(always)]
        unsafe fn bf16s(p: *const u8) -> Self::F {
            unsafe {
                let w = |q: *const u8| {
                    let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(q.cast()));
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v))
                };
                [w(p), w(p.add(16))]
            }
        }
        #[inline(always)]
        unsafe fn f16s(p: *const u8) -> Self::F {
            #[cfg(target_feature = "f16c")]
            unsafe {
                [
                    _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast())),
                ]
            }
            #[cfg(not(target_feature = "f16c"))]
            unsafe {
                let v = super::PortableLanes::f16s(p);
                Self::load(v.as_ptr())
            }
        }
        #[inline(always)]
        unsafe fn splat_i(x: i32) -> Self::I {
            [_mm256_set1_epi32(x); 2]
        }
        #[inline(always)]
        unsafe fn iota() -> Self::I {
            [
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15),
            ]
        }
        #[inline(always)]
        unsafe fn and(a: Self::I, b: Self::I) -> Self::I {
            both!(_mm256_and_si256(a, b))
        }
        #[inline(always)]
        unsafe fn or(a: Self::I, b: Self::I) -> Self::I {
            both!(_mm256_or_si256(a, b))
        }
        #[inline(always)]
        unsafe fn sub_i(a: Self::I, b: Self::I) -> Self::I {
            both!(_mm256_sub_epi32(a, b))
        }
        #[inline(always)]
        unsafe fn shr(a: Self::I, by: Self::I) -> Self::I {
            both!(_mm256_srlv_epi32(a, by))
        }
        #[inline(always)]
        unsafe fn shl(a: Self::I, by: Self::I) -> Self::I {
            both!(_mm256_sllv_epi32(a, by))
        }
        #[inline(always)]
        unsafe fn to_f(a: Self::I) -> Self::F {
            both!(_mm256_cvtepi32_ps(a))
        }
    }
}

/// One AVX-512F register (detected at run time; entered through `avx512_block`).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Lanes, LANES};
    use std::arch::x86_64::*;

    pub(super) struct Avx512Lanes;

    // SAFETY (every method): only inlined into `avx512_block`, which runs once AVX-512F was
    // detected; pointers are the caller's, valid for the bytes each method reads.
    impl Lanes for Avx512Lanes {
        type F = __m512;
        type I = __m512i;
        #[inline(always)]
        unsafe fn zero() -> Self::F {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self::F {
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self::F {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn mul(a: Self::F, b: Self::F) -> Self::F {
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn add(a: Self::F, b: Self::F) -> Self::F {
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn sub(a: Self::F, b: Self::F) -> Self::F {
            unsafe { _mm512_sub_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn to_array(a: Self::F) -> [f32; LANES] {
            unsafe { std::mem::transmute::<__m512, [f32; LANES]>(a) }
        }
        #[inline(always)]
        unsafe fn u8s(p: *const u8) -> Self::I {
            unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())) }
        }
        #[inline(always)]
        unsafe fn i8s(p: *const u8) -> Self::I {
            unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())) }
        }
        #[inline(always)]
        unsafe fn bf16s(p: *const u8) -> Self::F {
            unsafe {
                let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
            }
        }
        #[inline(always)]
        unsafe fn f16s(p: *const u8) -> Self::F {
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
        }
        #[inline(always)]
        unsafe fn splat_i(x: i32) -> Self::I {
            unsafe { _mm512_set1_epi32(x) }
        }
        #[inline(always)]
        unsafe fn iota() -> Self::I {
            unsafe { _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) }
        }
        #[inline(always)]
        unsafe fn and(a: Self::I, b: Self::I) -> Self::I {
            unsafe { _mm512_and_si512(a, b) }
        }
        #[inline(always)]
        unsafe fn or(a: Self::I, b: Self::I) -> Self::I {
            unsafe { _mm512_or_si512(a, b) }
        }
        #[inline(always)]
        unsafe fn sub_i(a: Self::I, b: Self::I) -> Self::I {
            unsafe { _mm512_sub_epi32(a, b) }
        }
        #[inline(always)]
        unsafe fn shr(a: Self::I, by: Self::I) -> Self::I {
            unsafe { _mm512_srlv_epi32(a, by) }
        }
        #[inline(always)]
        unsafe fn shl(a: Self::I, by: Self::I) -> Self::I {
            unsafe { _mm512_sllv_epi32(a, by) }
        }
        #[inline(always)]
        unsafe fn to_f(a: Self::I) -> Self::F {
            unsafe { _mm512_cvtepi32_ps(a) }
        }
    }
}

// ---------------------------------------------------------------------------------------
// the formats, 16 values at a time

/// A row format read in chunks of 16 values: `ELEMS` values (a multiple of 16) in
/// `BYTES` bytes per block. Each chunk must be computed by `quant.rs`'s operations.
trait Chunks {
    const ELEMS: usize;
    const BYTES: usize;
    /// Values `16i..16i + 16` of the block at `b` (which holds `BYTES` bytes).
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F;
}

#[inline(always)]
unsafe fn half_at(b: *const u8, at: usize) -> f32 {
    // SAFETY: inside the caller's block.
    half::f16::from_le_bytes(unsafe { [*b.add(at), *b.add(at + 1)] }).to_f32()
}

/// Chunk `i` (0: values 0–15, 1: 16–31) of a 32-value block: the low, else the high
/// nibbles of the 16 bytes at `qs`.
#[inline(always)]
unsafe fn nibbles<V: Lanes>(qs: *const u8, high: bool) -> V::I {
    unsafe {
        let q = V::u8s(qs);
        if high {
            V::shr(q, V::splat_i(4))
        } else {
            V::and(q, V::splat_i(0x0F))
        }
    }
}

/// Bits `shift..` of the lane bytes at `p`, under `mask` (the K-quants' 2-bit values and
/// high bits).
#[inline(always)]
unsafe fn bits<V: Lanes>(p: *const u8, shift: usize, mask: i32) -> V::I {
    unsafe {
        V::and(
            V::shr(V::u8s(p), V::splat_i(shift as i32)),
            V::splat_i(mask),
        )
    }
}

/// The fifth bits of a Q5 block's chunk `i` from `qh`, at bit 4 (`quant::q5_0`'s `h0`/`h1`).
#[inline(always)]
unsafe fn fifth_bits<V: Lanes>(qh: u32, i: usize) -> V::I {
    unsafe {
        let qh = V::splat_i(qh as i32);
        let h = if i == 0 {
            V::shl(V::shr(qh, V::iota()), V::splat_i(4))
        } else {
            V::shr(qh, V::sub_i(V::iota(), V::splat_i(-12)))
        };
        V::and(h, V::splat_i(0x10))
    }
}

#[inline(always)]
unsafe fn u32_at(b: *const u8, at: usize) -> u32 {
    // SAFETY: inside the caller's block.
    u32::from_le_bytes(unsafe { [*b.add(at), *b.add(at + 1), *b.add(at + 2), *b.add(at + 3)] })
}

struct Q4_0;
impl Chunks for Q4_0 {
    const ELEMS: usize = 32;
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let d = half_at(b, 0);
            let q = V::sub_i(nibbles::<V>(b.add(2), i == 1), V::splat_i(8));
            V::mul(V::to_f(q), V::splat(d))
        }
    }
}

struct Q4_1;
impl Chunks for Q4_1 {
    const ELEMS: usize = 32;
    const BYTES: usize = 20;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let (d, m) = (half_at(b, 0), half_at(b, 2));
            let q = nibbles::<V>(b.add(4), i == 1);
            V::add(V::mul(V::to_f(q), V::splat(d)), V::splat(m))
        }
    }
}

struct Q5_0;
impl Chunks for Q5_0 {
    const ELEMS: usize = 32;
    const BYTES: usize = 22;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let d = half_at(b, 0);
            let q = V::or(
                nibbles::<V>(b.add(6), i == 1),
                fifth_bits::<V>(u32_at(b, 2), i),
            );
            V::mul(V::to_f(V::sub_i(q, V::splat_i(16))), V::splat(d))
        }
    }
}

struct Q5_1;
impl Chunks for Q5_1 {
    const ELEMS: usize = 32;
    const BYTES: usize = 24;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let (d, m) = (half_at(b, 0), half_at(b, 2));
            let q = V::or(
                nibbles::<V>(b.add(8), i == 1),
                fifth_bits::<V>(u32_at(b, 4), i),
            );
            V::add(V::mul(V::to_f(q), V::splat(d)), V::splat(m))
        }
    }
}

struct Q8_0;
impl Chunks for Q8_0 {
    const ELEMS: usize = 32;
    const BYTES: usize = 34;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let d = half_at(b, 0);
            V::mul(V::to_f(V::i8s(b.add(2 + 16 * i))), V::splat(d))
        }
    }
}

/// Q4_K: chunk `i` lies in 64-value group `i / 4`, whose first 32 values are the low
/// nibbles and last 32 the high nibbles of the group's 32 bytes (`quant::q4_k`).
struct Q4K;
impl Chunks for Q4K {
    const ELEMS: usize = 256;
    const BYTES: usize = 144;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let (group, within) = (i / 4, i % 4);
            let high = within >= 2;
            let scales = std::slice::from_raw_parts(b.add(4), 12);
            let (sc, mn) = quant::scale_min_k4(2 * group + high as usize, scales);
            let (d1, m1) = (d * sc as f32, dmin * mn as f32);
            let q = nibbles::<V>(b.add(16 + 32 * group + 16 * (within % 2)), high);
            V::sub(V::mul(V::splat(d1), V::to_f(q)), V::splat(m1))
        }
    }
}

/// Q2_K: chunk `i` lies in half `i / 8`, 32-value group `j = (i % 8) / 2` (bits `2j` of
/// the half's 32 bytes), sub-block `i % 2` (its first or last 16 bytes) (`quant::q2_k`).
struct Q2K;
impl Chunks for Q2K {
    const ELEMS: usize = 256;
    const BYTES: usize = 84;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let (d, dmin) = (half_at(b, 80), half_at(b, 82));
            let (h, j, s) = (i / 8, (i % 8) / 2, i % 2);
            let sc = *b.add(8 * h + 2 * j + s);
            let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
            let q = bits::<V>(b.add(16 + 32 * h + 16 * s), 2 * j, 3);
            V::sub(V::mul(V::splat(dl), V::to_f(q)), V::splat(ml))
        }
    }
}

/// Q3_K: Q2_K's 2-bit layout (after a 32-byte `hmask`), minus 4 where the value's high
/// bit (bit `4h + j` of `hmask[16s..16s + 16]`) is clear (`quant::q3_k`).
struct Q3K;
impl Chunks for Q3K {
    const ELEMS: usize = 256;
    const BYTES: usize = 110;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let d = half_at(b, 108);
            let (h, j, s) = (i / 8, (i % 8) / 2, i % 2);
            let scales = quant::q3_k_scales(std::slice::from_raw_parts(b.add(96), 12));
            let dl = d * (scales[8 * h + 2 * j + s] as f32 - 32.0);
            let q = bits::<V>(b.add(32 + 32 * h + 16 * s), 2 * j, 3);
            let high = bits::<V>(b.add(16 * s), 4 * h + j, 1);
            // q − 4·(1 − high) = q + 4·high − 4
            let q = V::sub_i(V::or(q, V::shl(high, V::splat_i(2))), V::splat_i(4));
            V::mul(V::splat(dl), V::to_f(q))
        }
    }
}

/// Q5_K: Q4_K's layout after a 32-byte `qh` whose bit `2·group + high` of byte `l` is the
/// fifth bit of value `l` of the group's low (high) 32 (`quant::q5_k`).
struct Q5K;
impl Chunks for Q5K {
    const ELEMS: usize = 256;
    const BYTES: usize = 176;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let (group, within) = (i / 4, i % 4);
            let high = within >= 2;
            let l0 = 16 * (within % 2);
            let scales = std::slice::from_raw_parts(b.add(4), 12);
            let (sc, mn) = quant::scale_min_k4(2 * group + high as usize, scales);
            let (d1, m1) = (d * sc as f32, dmin * mn as f32);
            let low4 = nibbles::<V>(b.add(48 + 32 * group + l0), high);
            let fifth = bits::<V>(b.add(16 + l0), 2 * group + high as usize, 1);
            let q = V::or(low4, V::shl(fifth, V::splat_i(4)));
            V::sub(V::mul(V::splat(d1), V::to_f(q)), V::splat(m1))
        }
    }
}

/// Q6_K: chunk `i` lies in 128-value half `i / 8`; within it, 32-value quarter `g` takes
/// the low (g < 2) or high nibbles of `ql[32·(g % 2)..]` and bits `2g..2g + 2` of `qh`,
/// each 16 values with their own scale (`quant::q6_k`).
struct Q6K;
impl Chunks for Q6K {
    const ELEMS: usize = 256;
    const BYTES: usize = 210;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let d = half_at(b, 208);
            let (half, c) = (i / 8, i % 8);
            let (g, l0) = (c / 2, 16 * (c % 2));
            let ql = nibbles::<V>(b.add(64 * half + 32 * (g % 2) + l0), g >= 2);
            let qh = V::u8s(b.add(128 + 32 * half + l0));
            let hi = V::shl(
                V::and(V::shr(qh, V::splat_i(2 * g as i32)), V::splat_i(3)),
                V::splat_i(4),
            );
            let q = V::sub_i(V::or(ql, hi), V::splat_i(32));
            let sc = *b.add(192 + 8 * half + c % 2 + 2 * g) as i8;
            V::mul(V::splat(d * sc as f32), V::to_f(q))
        }
    }
}

/// 16 indices of chunk `high` (the low or high nibbles of the 16 bytes at `qs`), looked
/// up in `table` (`quant::IQ4_VALUES`, `quant::MXFP4_VALUES`), as lanes. (A table lookup
/// has no lane op here; the scalar lookup keeps the values exactly `quant.rs`'s.)
#[inline(always)]
unsafe fn table_lanes<V: Lanes>(table: &[i8; 16], qs: *const u8, high: bool) -> V::I {
    let mut v = [0i8; 16];
    for (j, out) in v.iter_mut().enumerate() {
        // SAFETY: the caller's 16 index bytes.
        let q = unsafe { *qs.add(j) };
        *out = table[(if high { q >> 4 } else { q & 0x0F }) as usize];
    }
    // SAFETY: 16 bytes on the stack.
    unsafe { V::i8s(v.as_ptr().cast()) }
}

/// IQ4_NL: d × the looked-up values (`quant::iq4_nl`).
struct Iq4Nl;
impl Chunks for Iq4Nl {
    const ELEMS: usize = 32;
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let q = table_lanes::<V>(&quant::IQ4_VALUES, b.add(2), i == 1);
            V::mul(V::splat(half_at(b, 0)), V::to_f(q))
        }
    }
}

/// MXFP4: the E8M0 scale halved × the looked-up doubled E2M1 values (`quant::mxfp4`).
struct Mxfp4;
impl Chunks for Mxfp4 {
    const ELEMS: usize = 32;
    const BYTES: usize = 17;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let q = table_lanes::<V>(&quant::MXFP4_VALUES, b.add(1), i == 1);
            V::mul(V::splat(quant::e8m0_half(*b)), V::to_f(q))
        }
    }
}

/// IQ4_XS: chunk `i` lies in 32-value sub-block `i / 2`, its scale `quant::iq4_xs_scale`.
struct Iq4Xs;
impl Chunks for Iq4Xs {
    const ELEMS: usize = 256;
    const BYTES: usize = 136;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, i: usize) -> V::F {
        unsafe {
            let ib = i / 2;
            // SAFETY: the block's 136 bytes.
            let block = std::slice::from_raw_parts(b, Self::BYTES);
            let q = table_lanes::<V>(&quant::IQ4_VALUES, b.add(8 + 16 * ib), i % 2 == 1);
            V::mul(V::splat(quant::iq4_xs_scale(block, ib)), V::to_f(q))
        }
    }
}

/// 16-bit and f32 rows: a "block" is 16 values (rows need not be whole blocks: the
/// remainder is the dot's tail).
struct Bf16;
impl Chunks for Bf16 {
    const ELEMS: usize = 16;
    const BYTES: usize = 32;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, _: usize) -> V::F {
        unsafe { V::bf16s(b) }
    }
}

struct F16;
impl Chunks for F16 {
    const ELEMS: usize = 16;
    const BYTES: usize = 32;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, _: usize) -> V::F {
        unsafe { V::f16s(b) }
    }
}

struct F32;
impl Chunks for F32 {
    const ELEMS: usize = 16;
    const BYTES: usize = 64;
    #[inline(always)]
    unsafe fn chunk<V: Lanes>(b: *const u8, _: usize) -> V::F {
        unsafe { V::load(b.cast()) }
    }
}

// ---------------------------------------------------------------------------------------
// the kernel

/// The lane accumulators of `R × C` dots over the rows' whole blocks.
///
/// # Safety
/// `V`'s features are present; every `xs[r]` has `k` values and every `ws[c]` holds
/// `k / F::ELEMS` whole blocks (the caller checked).
#[inline(always)]
unsafe fn lanes_of<V: Lanes, F: Chunks, const R: usize, const C: usize>(
    xs: &[&[f32]; R],
    ws: &[&[u8]; C],
    blocks: usize,
) -> [[[f32; LANES]; C]; R] {
    unsafe {
        let mut acc = [[V::zero(); C]; R];
        for blk in 0..blocks {
            for i in 0..F::ELEMS / LANES {
                let p = blk * F::ELEMS + i * LANES;
                // No closures: they would not inherit the caller's target features.
                let mut xv = [V::zero(); R];
                for r in 0..R {
                    xv[r] = V::load(xs[r].as_ptr().add(p));
                }
                for c in 0..C {
                    let w = F::chunk::<V>(ws[c].as_ptr().add(blk * F::BYTES), i);
                    for r in 0..R {
                        acc[r][c] = V::fma(xv[r], w, acc[r][c]);
                    }
                }
            }
        }
        let mut out = [[[0.0; LANES]; C]; R];
        for r in 0..R {
            for c in 0..C {
                out[r][c] = V::to_array(acc[r][c]);
            }
        }
        out
    }
}

/// `R × C` dots in `dot.rs`'s order with lanes `V`: the format's whole 16-value chunks
/// in registers, then the lane tree, then the tail (16-bit and f32 rows only) in order.
///
/// # Safety
/// `V`'s features are present.
#[inline(always)]
unsafe fn block_with<V: Lanes, const R: usize, const C: usize>(
    format: Format,
    xs: &[&[f32]; R],
    ws: &[&[u8]; C],
) -> [[f32; C]; R] {
    let k = if R > 0 { xs[0].len() } else { 0 };
    assert!(
        xs.iter().all(|x| x.len() == k) && ws.iter().all(|w| Some(w.len()) == format.row_bytes(k)),
        "stored_block: rows of different lengths"
    );
    let body = k - k % LANES;
    // SAFETY: lengths checked above; `body / ELEMS` whole blocks lie inside each row (a
    // quantized row is whole blocks of a multiple of 16 values, so `body == k` there).
    let acc = unsafe {
        match format {
            Format::Q4_0 => lanes_of::<V, Q4_0, R, C>(xs, ws, k / Q4_0::ELEMS),
            Format::Q4_1 => lanes_of::<V, Q4_1, R, C>(xs, ws, k / Q4_1::ELEMS),
            Format::Q5_0 => lanes_of::<V, Q5_0, R, C>(xs, ws, k / Q5_0::ELEMS),
            Format::Q5_1 => lanes_of::<V, Q5_1, R, C>(xs, ws, k / Q5_1::ELEMS),
            Format::Q8_0 => lanes_of::<V, Q8_0, R, C>(xs, ws, k / Q8_0::ELEMS),
            Format::Q2K => lanes_of::<V, Q2K, R, C>(xs, ws, k / Q2K::ELEMS),
            Format::Q3K => lanes_of::<V, Q3K, R, C>(xs, ws, k / Q3K::ELEMS),
            Format::Q4K => lanes_of::<V, Q4K, R, C>(xs, ws, k / Q4K::ELEMS),
            Format::Q5K => lanes_of::<V, Q5K, R, C>(xs, ws, k / Q5K::ELEMS),
            Format::Q6K => lanes_of::<V, Q6K, R, C>(xs, ws, k / Q6K::ELEMS),
            Format::Iq4Nl => lanes_of::<V, Iq4Nl, R, C>(xs, ws, k / Iq4Nl::ELEMS),
            Format::Iq4Xs => lanes_of::<V, Iq4Xs, R, C>(xs, ws, k / Iq4Xs::ELEMS),
            Format::Mxfp4 => lanes_of::<V, Mxfp4, R, C>(xs, ws, k / Mxfp4::ELEMS),
            Format::Bf16 => lanes_of::<V, Bf16, R, C>(xs, ws, body / LANES),
            Format::F16 => lanes_of::<V, F16, R, C>(xs, ws, body / LANES),
            Format::F32 => lanes_of::<V, F32, R, C>(xs, ws, body / LANES),
        }
    };
    // The tail: dequantized as `quant.rs` does (exact widening), fused in order.
    let mut tails = [[0.0f32; LANES]; C];
    if body < k {
        // Only 16-bit and f32 rows have a tail: one value per `block_bytes`.
        let size = format.block_bytes();
        for c in 0..C {
            quant::dequantize_generic(format, &ws[c][body * size..], &mut tails[c][..k - body]);
        }
    }
    std::array::from_fn(|r| {
        std::array::from_fn(|c| {
            let mut s = sum_lanes(&acc[r][c]);
            for q in body..k {
                s = xs[r][q].mul_add(tails[c][q - body], s);
            }
            s
        })
    })
}

impl StoredDot for Portable {
    #[inline(always)]
    fn stored_block<const R: usize, const C: usize>(
        self,
        format: Format,
        xs: &[&[f32]; R],
        ws: &[&[u8]; C],
    ) -> [[f32; C]; R] {
        // SAFETY: the portable lanes need no CPU feature.
        unsafe { block_with::<PortableLanes, R, C>(format, xs, ws) }
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
impl StoredDot for super::dot::Avx2 {
    #[inline(always)]
    fn stored_block<const R: usize, const C: usize>(
        self,
        format: Format,
        xs: &[&[f32]; R],
        ws: &[&[u8]; C],
    ) -> [[f32; C]; R] {
        // SAFETY: the build targets AVX2 and FMA.
        unsafe { block_with::<avx2::Avx2Lanes, R, C>(format, xs, ws) }
    }
}

#[cfg(target_arch = "x86_64")]
impl StoredDot for super::dot::Avx512 {
    #[inline(always)]
    fn stored_block<const R: usize, const C: usize>(
        self,
        format: Format,
        xs: &[&[f32]; R],
        ws: &[&[u8]; C],
    ) -> [[f32; C]; R] {
        // SAFETY: an `Avx512` exists only once AVX-512F was detected.
        unsafe { avx512_block(format, xs, ws) }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_block<const R: usize, const C: usize>(
    format: Format,
    xs: &[&[f32]; R],
    ws: &[&[u8]; C],
) -> [[f32; C]; R] {
    // SAFETY: this function runs only with AVX-512F (its caller's contract).
    unsafe { block_with::<avx512::Avx512Lanes, R, C>(format, xs, ws) }
}

impl super::ops::WeightRows for StoredRows<'_> {
    fn out_in(&self) -> (usize, usize) {
        let rb = self.format.row_bytes(self.cols).expect("whole blocks");
        (self.bytes.len() / rb.max(1), self.cols)
    }

    fn rows_f32<'s>(
        &'s self,
        rows: std::ops::Range<usize>,
        scratch: &'s mut Vec<f32>,
    ) -> &'s [f32] {
        scratch.resize(rows.len() * self.cols, 0.0);
        for (r, out) in rows.zip(scratch.chunks_exact_mut(self.cols.max(1))) {
            quant::dequantize(self.format, self.row(r), out);
        }
        scratch
    }

    fn stored_rows(&self, rows: std::ops::Range<usize>) -> Option<StoredRows<'_>> {
        let rb = self.format.row_bytes(self.cols).expect("whole blocks");
        Some(StoredRows {
            bytes: &self.bytes[rows.start * rb..rows.end * rb],
            ..*self
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::dot::{DotKernel, Portable};
    use super::super::ops::{linear_tiles, WeightRows};
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Every format, with row widths that are whole blocks but not whole 64s (Q*_0/1: 3
    /// blocks) and, for 16-bit and f32 rows, widths with a tail and shorter than 16.
    fn cases() -> Vec<(Format, usize)> {
        use Format as F;
        let mut v = Vec::new();
        for f in [F::Q4_0, F::Q4_1, F::Q5_0, F::Q5_1, F::Q8_0] {
            v.extend([(f, 32), (f, 96)]);
        }
        for f in [F::Q2K, F::Q3K, F::Q4K, F::Q5K, F::Q6K, F::Iq4Xs] {
            v.extend([(f, 256), (f, 768)]);
        }
        v.extend([
            (F::Iq4Nl, 32),
            (F::Iq4Nl, 96),
            (F::Mxfp4, 32),
            (F::Mxfp4, 96),
        ]);
        for f in [F::Bf16, F::F16, F::F32] {
            v.extend([(f, 1), (f, 15), (f, 16), (f, 17), (f, 100), (f, 577)]);
        }
        v
    }

    /// `n` random rows of width `k` in `format`: 16-bit and f32 bytes written directly,
    /// block formats by candle's quantizer, IQ4 ones (candle has no quantizer for them) as
    /// random blocks with a small f16 scale.
    fn stored(rng: &mut StdRng, format: Format, n: usize, k: usize) -> Vec<u8> {
        let v: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.5..2.0)).collect();
        match format {
            Format::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Format::Bf16 => v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
            Format::F16 => v
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            Format::Iq4Nl | Format::Iq4Xs => {
                let mut bytes: Vec<u8> = (0..n * format.row_bytes(k).unwrap())
                    .map(|_| rng.random())
                    .collect();
                for block in bytes.chunks_exact_mut(format.block_bytes()) {
                    let d = half::f16::from_f32(rng.random_range(-0.05..0.05));
                    block[..2].copy_from_slice(&d.to_le_bytes());
                }
                bytes
            }
            // Random codes, scales 2^-9..2^2 (with the subnormal corner e < 2 once a row).
            Format::Mxfp4 => {
                let mut bytes: Vec<u8> = (0..n * format.row_bytes(k).unwrap())
                    .map(|_| rng.random())
                    .collect();
                for (i, block) in bytes.chunks_exact_mut(format.block_bytes()).enumerate() {
                    block[0] = if i % 3 == 0 {
                        rng.random_range(0..2)
                    } else {
                        rng.random_range(118..130)
                    };
                }
                bytes
            }
            _ => {
                let t = Tensor::from_vec(v, (n, k), &Device::Cpu).unwrap();
                let q = QTensor::quantize(&t, format.ggml().unwrap()).unwrap();
                q.data().unwrap().into_owned()
            }
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The reference: rows dequantized by `quant.rs` (itself checked bitwise against
    /// candle), then `dot.rs`'s portable fixed-order dot.
    fn reference(w: StoredRows<'_>, x: &[f32], m: usize) -> Vec<f32> {
        let (n, k) = w.out_in();
        let mut deq = vec![0.0f32; n * k];
        for (r, out) in deq.chunks_exact_mut(k).enumerate() {
            quant::dequantize_generic(w.format, w.row(r), out);
        }
        let mut out = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let [[v]] = Portable.block(&[&x[i * k..(i + 1) * k]], &[&deq[j * k..(j + 1) * k]]);
                out[i * n + j] = v;
            }
        }
        out
    }

    /// `R × C` blocks of each kernel on this machine (portable, the build's AVX2, AVX-512
    /// if detected) give the reference's bits.
    fn check_blocks<K: StoredDot, const R: usize, const C: usize>(kern: K, name: &str) {
        let mut rng = StdRng::seed_from_u64(17);
        for (f, k) in cases() {
            let bytes = stored(&mut rng, f, C, k);
            let w = StoredRows {
                format: f,
                bytes: &bytes,
                cols: k,
            };
            let x: Vec<f32> = (0..R * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let want = reference(w, &x, R);
            let xs: [&[f32]; R] = std::array::from_fn(|r| &x[r * k..(r + 1) * k]);
            let ws: [&[u8]; C] = std::array::from_fn(|c| w.row(c));
            let got = kern.stored_block(f, &xs, &ws);
            assert_eq!(
                bits(got.as_flattened()),
                bits(&want.chunks(C).flatten().copied().collect::<Vec<_>>()),
                "{name} {R}×{C}: {f}, k {k}"
            );
        }
    }

    fn check_kernel<K: StoredDot>(kern: K, name: &str) {
        check_blocks::<K, 1, 1>(kern, name);
        check_blocks::<K, 1, 4>(kern, name);
        check_blocks::<K, 2, 3>(kern, name);
        check_blocks::<K, 4, 4>(kern, name);
    }

    #[test]
    fn every_kernel_and_format_gives_the_reference_dot_bitwise() {
        check_kernel(Portable, "portable");
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma",
            target_feature = "f16c"
        ))]
        check_kernel(super::super::dot::Avx2, "AVX2");
        #[cfg(target_arch = "x86_64")]
        if let Some(kern) = super::super::dot::Avx512::detect() {
            check_kernel(kern, "AVX-512");
        }
    }

    /// Whole `linear` calls through each kernel's tile loop: batches small enough for the
    /// fused path (1, 2, 3) and larger ones that dequantize tiles (7, 16, 33), 53 weight
    /// rows (tiles and register blocks with edges): every element is the reference's.
    fn check_linear<K: DotKernel + StoredDot, const MR: usize, const NR: usize, const FC: usize>(
        kern: K,
        name: &str,
    ) {
        let mut rng = StdRng::seed_from_u64(23);
        let n = 53;
        for (f, k) in cases() {
            let bytes = stored(&mut rng, f, n, k);
            let w = StoredRows {
                format: f,
                bytes: &bytes,
                cols: k,
            };
            for m in [1, 2, 3, 7, 16, 33] {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut got = vec![f32::NAN; m * n];
                linear_tiles::<K, _, MR, NR, FC>(kern, &x, &w, &mut got, m);
                assert_eq!(
                    bits(&got),
                    bits(&reference(w, &x, m)),
                    "{name}: {f}, k {k}, m {m}"
                );
            }
        }
    }

    #[test]
    fn linear_on_stored_rows_gives_the_reference_bitwise_for_every_kernel_and_batch() {
        check_linear::<_, 2, 3, 3>(Portable, "portable");
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma",
            target_feature = "f16c"
        ))]
        check_linear::<_, 2, 3, 3>(super::super::dot::Avx2, "AVX2");
        #[cfg(target_arch = "x86_64")]
        if let Some(kern) = super::super::dot::Avx512::detect() {
            check_linear::<_, 4, 6, 4>(kern, "AVX-512");
        }
    }

    /// A plain f64 dot of the dequantized values: catches a reference and kernel wrong the
    /// same way (e.g. both reading the wrong nibble).
    #[test]
    fn the_reference_is_a_dot_product_of_the_dequantized_values() {
        let mut rng = StdRng::seed_from_u64(29);
        for (f, k) in cases() {
            let bytes = stored(&mut rng, f, 2, k);
            let w = StoredRows {
                format: f,
                bytes: &bytes,
                cols: k,
            };
            let x: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let got = reference(w, &x, 1);
            let mut deq = vec![0.0f32; k];
            quant::dequantize_generic(f, w.row(1), &mut deq);
            let naive: f64 = x.iter().zip(&deq).map(|(a, b)| *a as f64 * *b as f64).sum();
            assert!(
                (got[1] as f64 - naive).abs() < 1e-4 * k as f64,
                "{f}, k {k}"
            );
        }
    }
}
