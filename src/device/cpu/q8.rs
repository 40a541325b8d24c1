//! Integer dot products of quantised activations (two 8-bit planes) with weight rows in
//! Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K: the `--dtype q8` mode's `linear`
//! (llama.cpp's scheme, Q8_1-style blocks, per-block integer dots, one float multiply-add
//! per block, with a second plane).
//!
//! **Activations.** An input row is cut into blocks of 32; each block `x` becomes a step
//! `d = max|x| / 32258` and integers `q = round_ties_even(x · 32258 / max|x|)` in
//! `[-32258, 32258]` (`32258 = 127 · 254`: about 15 bits), stored as two signed-byte
//! planes `q = 254 · qs + ql` (`qs`, `ql` in `[-127, 127]`) so that the byte-dot
//! instructions take them; and `ds = d · Σq` (the min terms need the block's sum).
//! Exact IEEE operations in one written order, so every kernel sees the same bytes. Unlike
//! llama.cpp's one 8-bit plane (`d = max|x| / 127`), the second plane makes the rounding of
//! the activations 254× finer: one plane moved greedy decoding off the f32 reference at
//! near-ties (docs/cpu.md, "Accuracy"); a byte dot more per block costs little where decode
//! is bound by reading the weights.
//!
//! **Weights as integer blocks.** Every format is read as 32-value blocks ([`IntBlock`]):
//! integer values `v`, two integer sub-scales `s` (one per 16 values), a float scale `dw` and
//! a float min `mw`. Q4_0: `v` = nibble − 8; Q4_1: nibble, `mw` its min; Q5_0 / Q5_1: the
//! same with the fifth bit (− 16 for Q5_0); Q8_0: the byte; all with `s = (1, 1)` and `dw`
//! their f16 scale. The K-quants' super-blocks of 256 are 8 such blocks: Q4_K / Q5_K `v` =
//! the 4- / 5-bit value, `s` = the block's 6-bit scale (both halves), `dw` = the super-block's
//! `d`, `mw = −(dmin · min)` (exact in f32: an 11-bit times a 6-bit integer); Q6_K `v` = the
//! 6-bit value − 32, `s` = its two 16-value halves' signed 8-bit scales, `dw` = `d`. The
//! integer scales stay integers: `dw · sc` is not representable in f16 and a product per
//! block in f32 would be one more rounding; `s · Σ v·q` is exact in i32.
//!
//! **The one reduction order** of a dot `x · w` over `nb` blocks:
//!
//! ```text
//! acc[0..4] = 0, mins = 0
//! for b in 0..nb:
//!     p[l]   = s[0] · (254 · Σ_{i ∈ A_l} v[i]·qs[i] + Σ_{i ∈ A_l} v[i]·ql[i])
//!            + s[1] · (254 · Σ_{i ∈ B_l} v[i]·qs[i] + Σ_{i ∈ B_l} v[i]·ql[i])
//!              A_l = 4l..4l+4, B_l = 16+4l..16+4l+4    (4 exact i32 lane sums)
//!     acc[l] = fma(dw·d, p[l] as f32, acc[l])       (l = 0..4)
//!     mins   = fma(mw, ds, mins)                    (Q4_1, Q5_1, Q4_K, Q5_K)
//! result = ((acc0 + acc2) + (acc1 + acc3)) + mins
//! ```
//!
//! Each lane sums eight products, two four-byte groups 16 bytes apart: what a byte-dot
//! instruction gives per 32-bit lane when a register holds four rows' values 0–15 and a
//! second one the same rows' values 16–31 (`packed.rs`), accumulated into one register. So
//! a 512-bit register carries four rows' lanes: a group block of 8 rows is 2 registers of
//! byte dots, conversions and multiply-adds (it was 4 with 8 lanes of four products).
//!
//! The integer part is exact whatever instructions compute it (no product or partial sum
//! can overflow: |p| ≤ 8 · 128 · 32258 for Q8_0, 8 · 31 · 32258 · 63 for Q5_K, 2 · 4 · 32 ·
//! 32258 · 128 for Q6_K, all below 2^31); `p as f32` is exact below 2^24 (Q4_0 … Q5_1) and
//! rounds to nearest even above (Q8_0, the K-quants), which every kernel's conversion does
//! alike. The float part is a fixed sequence per output, so
//! the portable, AVX2 and AVX-512 VNNI kernels agree bitwise (tests check it) and a row's
//! result never depends on the batch size or on the rows it is batched with. It is *not*
//! the f32 path's result: the activations lost bits. Tolerance against the f32 reference
//! is tested here; model-level agreement is measured (docs/cpu.md).

use half::f16;

use super::packed::{self, PackedGroup, PACK};
use super::quant::{scale_min_k4, Format};

/// Values per activation block (and per weight block of every format this file reads).
pub const QK: usize = 32;

/// Integer levels of a block's largest value: `127 · PLANE`.
pub const LEVELS: i32 = 127 * PLANE;

/// What one step of the coarse plane is worth in steps of `d`.
pub const PLANE: i32 = 254;

/// One block of 32 activations as two 8-bit planes: `x[i] ≈ d · (254 · qs[i] + ql[i])`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct Q8Block {
    /// The coarse plane, in `[-127, 127]`.
    pub qs: [i8; QK],
    /// The fine plane (what the coarse one leaves), in `[-127, 127]`.
    pub ql: [i8; QK],
    /// The step, `max|x| / 32258` (0 for an all-zero block).
    pub d: f32,
    /// `d · Σ (254 · qs + ql)`, rounded once (Q4_1's min term).
    pub ds: f32,
}

impl Q8Block {
    pub const ZERO: Self = Self {
        qs: [0; QK],
        ql: [0; QK],
        d: 0.0,
        ds: 0.0,
    };

    /// Value `i` in steps of `d`: `254 · qs[i] + ql[i]`.
    pub fn level(&self, i: usize) -> i32 {
        PLANE * self.qs[i] as i32 + self.ql[i] as i32
    }
}

/// Whether `linear` can take the integer path on rows of `format` (repacked: `packed.rs`).
pub fn supports(format: Format) -> bool {
    packed::supports(format)
}

/// Whether the format's blocks carry a min term (`mw`).
pub const fn has_min(format: Format) -> bool {
    matches!(
        format,
        Format::Q4_1 | Format::Q5_1 | Format::Q4K | Format::Q5K
    )
}

/// What a 32-value format's unsigned stored values lose to be its values (Q4_0: nibble − 8,
/// Q5_0: − 16); the kernels subtract it as `offset · Σ x`.
pub const fn value_offset(format: Format) -> i8 {
    match format {
        Format::Q4_0 => 8,
        Format::Q5_0 => 16,
        _ => 0,
    }
}

/// One 32-value weight block as the integer kernels compute with it (the module's order).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IntBlock {
    /// The integer values, in `[-128, 127]` (`[0, 31]` where unsigned).
    pub v: [i32; QK],
    /// The integer scales of values 0–15 and 16–31.
    pub s: [i32; 2],
    /// The float scale.
    pub dw: f32,
    /// The float min (0 where the format has none).
    pub mw: f32,
}

impl IntBlock {
    pub const ZERO: Self = Self {
        v: [0; QK],
        s: [0; 2],
        dw: 0.0,
        mw: 0.0,
    };
}

/// 32-value blocks in one stored block of `format` (a K-quant's super-block holds 8).
pub const fn blocks_per_unit(format: Format) -> usize {
    format.block_elems() / QK
}

/// The integer blocks of one stored block `x` of `format` (`out`: `blocks_per_unit`).
pub fn int_blocks(format: Format, x: &[u8], out: &mut [IntBlock]) {
    assert!(supports(format), "q8 dot: no integer kernel for {format}");
    assert_eq!(
        x.len(),
        format.block_bytes(),
        "int_blocks: not one {format} block"
    );
    assert_eq!(out.len(), blocks_per_unit(format), "int_blocks: out");
    let o = &mut out[0];
    match format {
        Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q5_1 => {
            let at = packed::stored32(format);
            let high = at.qh.map_or(0, |h| {
                u32::from_le_bytes([x[h], x[h + 1], x[h + 2], x[h + 3]])
            });
            let off = value_offset(format) as i32;
            let fifth = |i: usize| (((high >> i) & 1) << 4) as i32;
            for (j, &q) in x[at.qs..at.qs + 16].iter().enumerate() {
                o.v[j] = (q & 0x0F) as i32 + fifth(j) - off;
                o.v[j + 16] = (q >> 4) as i32 + fifth(j + 16) - off;
            }
            o.s = [1, 1];
            o.dw = half_at(x, 0);
            o.mw = at.m.map_or(0.0, |m| half_at(x, m));
        }
        Format::Q8_0 => {
            for (v, &b) in o.v.iter_mut().zip(&x[2..34]) {
                *v = b as i8 as i32;
            }
            o.s = [1, 1];
            o.dw = half_at(x, 0);
            o.mw = 0.0;
        }
        Format::Q4K | Format::Q5K | Format::Q6K => {
            let (qs, qh, sc) = packed::k_stored(format);
            let six = format == Format::Q6K;
            let (d, dmin) = if six {
                (half_at(x, 208), 0.0)
            } else {
                (half_at(x, 0), half_at(x, 2))
            };
            for (b, o) in out.iter_mut().enumerate() {
                for (i, v) in o.v.iter_mut().enumerate() {
                    let (at, shift) = packed::k_nibble_at(format, b, i);
                    let low = ((x[qs + at] >> shift) & 0x0F) as i32;
                    *v = match format {
                        // Q6_K: two high bits of 128 values' chunk b / 4, block b % 4.
                        Format::Q6K => {
                            let high = (x[qh + 32 * (b / 4) + i] >> (2 * (b % 4))) & 3;
                            (low | (high << 4) as i32) - 32
                        }
                        Format::Q5K => low | (((x[qh + i] >> b) & 1) << 4) as i32,
                        _ => low,
                    };
                }
                o.dw = d;
                if six {
                    o.s = [x[sc + 2 * b] as i8 as i32, x[sc + 2 * b + 1] as i8 as i32];
                    o.mw = 0.0;
                } else {
                    let (s, m) = scale_min_k4(b, &x[sc..sc + 12]);
                    o.s = [s as i32; 2];
                    o.mw = -(dmin * m as f32);
                }
            }
        }
        _ => unreachable!("checked above"),
    }
}

/// Quantises `x[k]` (k a multiple of 32) into `out[k / 32]`: per block, the module's
/// scheme (`d`, `q = round_ties_even(x · 32258 / max|x|)`, the two planes, `ds`).
///
/// Written so the compiler vectorises it (a block is 4 AVX2 registers): the planes come
/// from float operations that are exact on these integers (`⌊(q + 127) / 254⌋`: `q + 127`
/// is exact and a quotient `m − 1/254` cannot round up to `m`), and a NaN value becomes
/// level 0 as the saturating `as i32` of the scalar definition made it. The scalar
/// loop (in the tests) ran at ~3 µs a 576-wide row, a few percent of a decode step that
/// one thread spends while the other waits. Same bytes (tested against it).
pub fn quantize_row(x: &[f32], out: &mut [Q8Block]) {
    assert_eq!(
        x.len(),
        out.len() * QK,
        "quantize_row: x is not out.len() blocks"
    );
    let (levels, plane) = (LEVELS as f32, PLANE as f32);
    for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        // max is exact and order-free (`max` skips a NaN): eight running maxima, then
        // theirs (one fold over the block stayed a scalar chain).
        let mut m8 = [0.0f32; 8];
        for c in xb.chunks_exact(8) {
            for (m, v) in m8.iter_mut().zip(c) {
                *m = m.max(v.abs());
            }
        }
        let amax = m8.iter().fold(0.0f32, |m, &v| m.max(v));
        let d = amax / levels;
        let id = if amax != 0.0 { levels / amax } else { 0.0 };
        let mut q = [0.0f32; QK]; // the levels, integers in [-32258, 32258]
        for (q, &v) in q.iter_mut().zip(xb) {
            let r = (v * id).round_ties_even();
            // |v · id| ≤ 32258 up to rounding: the clamp only guards that last ulp.
            *q = if r.is_nan() {
                0.0
            } else {
                r.max(-levels).min(levels)
            };
        }
        let mut sum = 0i32;
        for ((q, qs), ql) in q.iter().zip(&mut o.qs).zip(&mut o.ql) {
            // q = 254 · hi + lo with lo in [-127, 126]: hi = ⌊(q + 127) / 254⌋ in [-127, 127].
            let hi = ((q + (PLANE / 2) as f32) / plane).floor();
            let lo = q - plane * hi;
            // SAFETY (both): finite integers in [-127, 127] (above).
            let (hi, lo) = unsafe { (hi.to_int_unchecked::<i32>(), lo.to_int_unchecked::<i32>()) };
            (*qs, *ql) = (hi as i8, lo as i8);
            sum += PLANE * hi + lo;
        }
        o.d = d;
        o.ds = d * sum as f32; // |sum| ≤ 32 · 32258 < 2^24: exact before this rounding
    }
}

/// f32 lanes of one dot (`p[l]` above).
const LANES: usize = 4;

/// The canonical end of every dot: the lane tree, then the min term.
#[inline(always)]
fn finish(acc: &[f32; LANES], mins: f32) -> f32 {
    ((acc[0] + acc[2]) + (acc[1] + acc[3])) + mins
}

/// Value `i`'s lane: `I_l` above.
#[inline(always)]
fn lane_of(i: usize) -> usize {
    (i % (QK / 2)) / 4
}

#[inline(always)]
fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// `R × C` integer dots `xs[r] · ws[c]`: quantised activation rows (`nb` blocks each)
/// against stored weight rows of one supported format (`nb` blocks of 32 values each).
pub trait Q8Dot: Copy + Send + Sync {
    fn q8_block<const R: usize, const C: usize>(
        self,
        format: Format,
        xs: &[&[Q8Block]; R],
        ws: &[&[u8]; C],
    ) -> [[f32; C]; R];

    /// `R × PACK` dots: the rows `xs` against the `PACK` rows of one repacked group
    /// (`packed.rs`), bitwise `q8_block` on those rows as stored (the same order above).
    fn packed_block<const R: usize>(
        self,
        xs: &[&[Q8Block]; R],
        g: PackedGroup<'_>,
    ) -> [[f32; PACK]; R];
}

fn check<const R: usize, const C: usize>(
    format: Format,
    xs: &[&[Q8Block]; R],
    ws: &[&[u8]; C],
) -> usize {
    assert!(supports(format), "q8 dot: no integer kernel for {format}");
    let nb = if R > 0 { xs[0].len() } else { 0 };
    let row = format.row_bytes(nb * QK);
    assert!(
        xs.iter().all(|x| x.len() == nb) && ws.iter().all(|w| Some(w.len()) == row),
        "q8 dot: rows of different lengths"
    );
    nb
}

/// `check` for a repacked group: blocks per row.
fn check_packed<const R: usize>(xs: &[&[Q8Block]; R], g: PackedGroup<'_>) -> usize {
    assert!(
        supports(g.format),
        "q8 dot: no integer kernel for {}",
        g.format
    );
    let units = g.nb * QK / g.format.block_elems();
    assert!(
        (g.nb * QK).is_multiple_of(g.format.block_elems())
            && xs.iter().all(|x| x.len() == g.nb)
            && g.data.len() == units * PACK * packed::unit_bytes(g.format),
        "q8 dot: rows of different lengths"
    );
    g.nb
}

/// Stored bytes of the largest block read here (Q6_K's).
const MAX_BLOCK: usize = 210;

/// The reference dot of `x` with one weight row of `format`, whose stored block (unit) `u`
/// `unit(u, out)` writes: the order above, lane by lane.
fn reference_dot(format: Format, x: &[Q8Block], mut unit: impl FnMut(usize, &mut [u8])) -> f32 {
    let mut buf = [0u8; MAX_BLOCK];
    let wb = &mut buf[..format.block_bytes()];
    let per = blocks_per_unit(format);
    let mut blocks = [IntBlock::ZERO; packed::K_BLOCKS];
    let (mut acc, mut mins) = ([0.0f32; LANES], 0.0f32);
    for (u, xu) in x.chunks_exact(per).enumerate() {
        unit(u, wb);
        int_blocks(format, wb, &mut blocks[..per]);
        for (w, x) in blocks.iter().zip(xu) {
            let mut p = [0i32; LANES];
            for (i, v) in w.v.iter().enumerate() {
                p[lane_of(i)] += w.s[i / (QK / 2)] * v * x.level(i);
            }
            let s = w.dw * x.d;
            for (a, p) in acc.iter_mut().zip(p) {
                *a = s.mul_add(p as f32, *a);
            }
            if has_min(format) {
                mins = w.mw.mul_add(x.ds, mins);
            }
        }
    }
    finish(&acc, mins)
}

/// The reference: the order above, lane by lane, on any target.
#[derive(Clone, Copy, Debug)]
pub struct Portable;

impl Q8Dot for Portable {
    fn q8_block<const R: usize, const C: usize>(
        self,
        format: Format,
        xs: &[&[Q8Block]; R],
        ws: &[&[u8]; C],
    ) -> [[f32; C]; R] {
        check(format, xs, ws);
        let bb = format.block_bytes();
        std::array::from_fn(|r| {
            std::array::from_fn(|c| {
                reference_dot(format, xs[r], |u, out| {
                    out.copy_from_slice(&ws[c][u * bb..(u + 1) * bb])
                })
            })
        })
    }

    fn packed_block<const R: usize>(
        self,
        xs: &[&[Q8Block]; R],
        g: PackedGroup<'_>,
    ) -> [[f32; PACK]; R] {
        check_packed(xs, g);
        std::array::from_fn(|r| {
            std::array::from_fn(|c| reference_dot(g.format, xs[r], |u, out| g.block(c, u, out)))
        })
    }
}

#[cfg(target_arch = "x86_64")]
pub use x86::{Avx2, Vnni};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{
        check, check_packed, finish, has_min, value_offset, Format, PackedGroup, Portable, Q8Block,
        Q8Dot, LANES, PACK, PLANE, QK,
    };
    use crate::device::cpu::packed::{
        k_parts, q4_row_at, q8_half_at, qh_offset, qs_offset, unit_bytes, K_BLOCKS, MINS_AT,
    };
    use std::arch::x86_64::*;

    /// AVX2 (+ FMA, F16C), detected at run time: `maddubs` then `madd` for the lane sums.
    #[derive(Clone, Copy, Debug)]
    pub struct Avx2 {
        /// Whether the repacked kernel asks for the weights ahead (`prefetch_ahead`).
        prefetch: bool,
    }

    impl Avx2 {
        pub fn detect() -> Option<Self> {
            (is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c"))
            .then(|| Self {
                prefetch: intel_cpu(),
            })
        }
    }

    /// AVX-512 VNNI, detected at run time: `vpdpbusd` computes the four-product lane sums
    /// in one instruction; rows as stored on 256-bit registers (AVX-512VL), repacked groups
    /// on 512-bit ones (`packed_with_512`).
    #[derive(Clone, Copy, Debug)]
    pub struct Vnni {
        /// Whether the repacked kernel asks for the weights ahead (`prefetch_ahead`).
        prefetch: bool,
    }

    impl Vnni {
        pub fn detect() -> Option<Self> {
            (Avx2::detect().is_some()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni"))
            .then(|| Self {
                prefetch: intel_cpu(),
            })
        }
    }

    /// How far ahead of the block it reads a repacked kernel prefetches the weights, where
    /// it does (`intel_cpu`): 2 KiB, about a dozen blocks (1K decode on an Intel Xeon,
    /// SmolLM2, 0, 1, 2 and 4 KiB alternated: 2 and 4 alike and best; docs/cpu.md).
    const PREFETCH_BYTES: usize = 2048;

    /// Asks for the lines `PREFETCH_BYTES` past each of the `bytes` from `p` (a group
    /// block about to be read): one request per line, into L1.
    #[inline(always)]
    unsafe fn prefetch_ahead(p: *const u8, bytes: usize) {
        for line in (0..bytes).step_by(64) {
            // SAFETY: a prefetch is a hint: past the matrix it reads nothing and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES + line).cast()) };
        }
    }

    /// Whether this is an Intel CPU, whose decode matmuls run faster when they prefetch
    /// their weights in software: a layer's matrices are short streams (100–300 KB per
    /// thread), over before the hardware prefetchers reach full rate (measured on a Xeon
    /// of the Emerald Rapids generation, 1K decode: ≈ +27% with the VNNI kernel, ≈ +21%
    /// with the AVX2 one). On AMD Zen 4 the same kind of prefetch made decode slower, so
    /// other vendors keep to the hardware's (docs/cpu.md).
    fn intel_cpu() -> bool {
        static INTEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *INTEL.get_or_init(|| {
            let id = __cpuid(0); // leaf 0: the vendor string, on every x86-64 CPU
            let vendor = [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes).concat();
            vendor == b"GenuineIntel"
        })
    }

    /// The 8 lane sums `Σ_{i = 4l..4l+4} u[i]·x[i]` of unsigned bytes `u` and signed `x`.
    /// Exact when every pair sum fits i16 (AVX2's `maddubs` saturates): `u ≤ 128`,
    /// `|x| ≤ 127` gives at most 2·128·127 = 32512.
    trait MulSum {
        /// `acc` plus the lane sums of `u` and `x`.
        unsafe fn acc_us(acc: __m256i, u: __m256i, x: __m256i) -> __m256i;

        /// The lane sums of `u` against an activation block's two planes, as its levels:
        /// `254 · (lane sums with qs) + (lane sums with ql)`, exact (each at most
        /// 4 · 128 · 127: the whole below 2^24).
        #[inline(always)]
        unsafe fn levels(u: __m256i, qs: __m256i, ql: __m256i) -> __m256i {
            // SAFETY: the caller's contract (AVX2 at least).
            unsafe {
                let coarse = Self::acc_us(_mm256_setzero_si256(), u, qs);
                let coarse = _mm256_mullo_epi32(coarse, _mm256_set1_epi32(PLANE));
                Self::acc_us(coarse, u, ql)
            }
        }

        /// `levels` of two rows held as their values 0–15 (`u[0]`) and 16–31 (`u[1]`), 16
        /// bytes a row, against the planes' halves broadcast to both rows' places: the
        /// canonical lanes, four a row (each |lane sum| at most 8 · 128 · 127 · 255 < 2^31).
        #[inline(always)]
        unsafe fn levels2(u: [__m256i; 2], qs: [__m256i; 2], ql: [__m256i; 2]) -> __m256i {
            // SAFETY: the caller's contract (AVX2 at least).
            unsafe {
                let coarse = Self::acc_us(_mm256_setzero_si256(), u[0], qs[0]);
                let coarse = Self::acc_us(coarse, u[1], qs[1]);
                let coarse = _mm256_mullo_epi32(coarse, _mm256_set1_epi32(PLANE));
                Self::acc_us(Self::acc_us(coarse, u[0], ql[0]), u[1], ql[1])
            }
        }
    }

    /// A block's 8 lane sums in value order (lane `l`: values `4l..4l + 4`) as the canonical
    /// 4 (lane `l` + lane `l + 4`: values `4l..` and `16 + 4l..`), in f32.
    #[inline(always)]
    unsafe fn canonical(lanes: __m256i) -> __m128 {
        // SAFETY: inlined into AVX2 kernels (their contract).
        unsafe {
            let lo = _mm256_castsi256_si128(lanes);
            _mm_cvtepi32_ps(_mm_add_epi32(lo, _mm256_extracti128_si256::<1>(lanes)))
        }
    }

    /// An activation plane's values `16h..16h + 16` in both 128-bit halves (each row's slot).
    #[inline(always)]
    unsafe fn half_x2(plane: &[i8; QK], h: usize) -> __m256i {
        // SAFETY: 16 bytes from 16h of a 32-byte plane; AVX2 is the caller's contract.
        unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(plane.as_ptr().add(16 * h).cast())) }
    }

    struct Maddubs;
    impl MulSum for Maddubs {
        #[inline(always)]
        unsafe fn acc_us(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
            // SAFETY: inlined only into the AVX2 kernel (its caller's contract).
            unsafe {
                let s = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
                _mm256_add_epi32(acc, s)
            }
        }
    }

    struct Dpbusd;
    impl MulSum for Dpbusd {
        #[inline(always)]
        unsafe fn acc_us(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
            // SAFETY: inlined only into the VNNI kernel (its caller's contract).
            unsafe { _mm256_dpbusd_epi32(acc, u, x) }
        }
    }

    /// A weight block's 32 values as bytes in value order: nibbles `j` (low) and `j + 16`
    /// (high) of `qs[j]`.
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: the caller's pointer has 16 bytes; AVX2 is its contract.
        unsafe {
            let lo = _mm_loadu_si128(p.cast());
            let hi = _mm_srli_epi16::<4>(lo);
            _mm256_and_si256(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(0x0F))
        }
    }

    #[inline(always)]
    unsafe fn half_at(p: *const u8) -> f32 {
        // SAFETY: the caller's pointer has 2 bytes.
        let b = unsafe { p.cast::<[u8; 2]>().read_unaligned() };
        half::f16::from_le_bytes(b).to_f32()
    }

    /// A weight format as a type, so that each kernel is compiled for one format (the
    /// `match` on `FORMAT` folds away and the block loop keeps its accumulators in
    /// registers).
    trait Fmt {
        const FORMAT: Format;
    }
    struct Q40;
    impl Fmt for Q40 {
        const FORMAT: Format = Format::Q4_0;
    }
    struct Q41;
    impl Fmt for Q41 {
        const FORMAT: Format = Format::Q4_1;
    }
    struct Q80;
    impl Fmt for Q80 {
        const FORMAT: Format = Format::Q8_0;
    }
    struct Q50;
    impl Fmt for Q50 {
        const FORMAT: Format = Format::Q5_0;
    }
    struct Q51;
    impl Fmt for Q51 {
        const FORMAT: Format = Format::Q5_1;
    }
    struct Q4k;
    impl Fmt for Q4k {
        const FORMAT: Format = Format::Q4K;
    }
    struct Q5k;
    impl Fmt for Q5k {
        const FORMAT: Format = Format::Q5K;
    }
    struct Q6k;
    impl Fmt for Q6k {
        const FORMAT: Format = Format::Q6K;
    }

    /// Whether a 32-value format has a fifth bit (`qh`).
    const fn five_bit(format: Format) -> bool {
        matches!(format, Format::Q5_0 | Format::Q5_1)
    }

    /// 0x10 in byte `i` where bit `i` of `bits` is set (two rows' 16-bit `qh` halves, as
    /// `packed.rs` keeps them), else 0.
    #[inline(always)]
    unsafe fn fifth_bits(bits: u32) -> __m256i {
        // SAFETY: inlined into AVX2 kernels (their contract).
        unsafe {
            // Byte i takes byte i / 8 of `bits` (shuffles stay in their 128-bit lane: the
            // upper lane's indices 2, 3 are its own copy's bytes 2, 3), then tests bit i % 8.
            #[rustfmt::skip]
            let spread = _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
            );
            let v = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), spread);
            let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
            let on = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
            _mm256_and_si256(on, _mm256_set1_epi8(0x10))
        }
    }

    /// Whether rows of `format` *as stored* have a SIMD kernel here. The others (Q5_0, Q5_1
    /// and the K-quants) are met as stored only where a matrix was not repacked (tests): the
    /// model repacks every matrix of the q8 mode at load, so their production path is the
    /// repacked kernels, and as stored they take the portable reference (same bits).
    const fn stored_kernel(format: Format) -> bool {
        matches!(format, Format::Q4_0 | Format::Q4_1 | Format::Q8_0)
    }

    /// `block_with` for `format` (one of `stored_kernel`'s).
    ///
    /// # Safety
    /// As `block_with`.
    #[inline(always)]
    unsafe fn by_format<M: MulSum, const R: usize, const C: usize>(
        format: Format,
        xs: &[&[Q8Block]; R],
        ws: &[&[u8]; C],
    ) -> [[f32; C]; R] {
        // SAFETY: the caller's contract.
        unsafe {
            match format {
                Format::Q4_0 => block_with::<M, Q40, R, C>(xs, ws),
                Format::Q4_1 => block_with::<M, Q41, R, C>(xs, ws),
                _ => block_with::<M, Q80, R, C>(xs, ws),
            }
        }
    }

    /// `R × C` dots in the canonical order with lane sums from `M`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present (and whatever `M` needs); lengths are checked here.
    #[inline(always)]
    unsafe fn block_with<M: MulSum, F: Fmt, const R: usize, const C: usize>(
        xs: &[&[Q8Block]; R],
        ws: &[&[u8]; C],
    ) -> [[f32; C]; R] {
        let format = F::FORMAT;
        let nb = check(format, xs, ws);
        let bb = format.block_bytes();
        // SAFETY: the features are the caller's contract; every pointer is block `b < nb`
        // of a row checked to hold `nb` blocks.
        unsafe {
            let mut acc = [[_mm_setzero_ps(); C]; R];
            let mut mins = [[0.0f32; C]; R];
            for b in 0..nb {
                // No closures: they would not inherit the caller's target features.
                let mut xv = [_mm256_setzero_si256(); R]; // coarse planes
                let mut xl = [_mm256_setzero_si256(); R]; // fine planes
                let mut xd = [0.0f32; R];
                for r in 0..R {
                    let x = xs[r].as_ptr().add(b);
                    xv[r] = _mm256_loadu_si256((*x).qs.as_ptr().cast());
                    xl[r] = _mm256_loadu_si256((*x).ql.as_ptr().cast());
                    xd[r] = (*x).d;
                }
                for c in 0..C {
                    let p = ws[c].as_ptr().add(b * bb);
                    let dw = half_at(p);
                    match format {
                        Format::Q4_1 => {
                            // Nibbles 0..15 are unsigned already.
                            let w = nibbles(p.add(4));
                            let mw = half_at(p.add(2));
                            for r in 0..R {
                                let s = canonical(M::levels(w, xv[r], xl[r]));
                                let d = _mm_set1_ps(dw * xd[r]);
                                acc[r][c] = _mm_fmadd_ps(d, s, acc[r][c]);
                                mins[r][c] = mw.mul_add((*xs[r].as_ptr().add(b)).ds, mins[r][c]);
                            }
                        }
                        _ => {
                            // Signed weights (Q4_0: nibble − 8 in [-8, 7]; Q8_0: the byte):
                            // |w| · (x signed as w), |w| ≤ 128.
                            let w = if format == Format::Q4_0 {
                                _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8))
                            } else {
                                _mm256_loadu_si256(p.add(2).cast())
                            };
                            let aw = _mm256_abs_epi8(w);
                            for r in 0..R {
                                let (sx, sl) =
                                    (_mm256_sign_epi8(xv[r], w), _mm256_sign_epi8(xl[r], w));
                                let s = canonical(M::levels(aw, sx, sl));
                                let d = _mm_set1_ps(dw * xd[r]);
                                acc[r][c] = _mm_fmadd_ps(d, s, acc[r][c]);
                            }
                        }
                    }
                }
            }
            let mut out = [[0.0f32; C]; R];
            for r in 0..R {
                for c in 0..C {
                    let a = std::mem::transmute::<__m128, [f32; LANES]>(acc[r][c]);
                    out[r][c] = finish(&a, mins[r][c]);
                }
            }
            out
        }
    }

    /// A group block's 8 scales (`d[8]` f16 at its start, `packed.rs`), after asking for
    /// the lines ahead when `prefetch` (`prefetch_ahead`).
    ///
    /// # Safety
    /// `p` is a group block of `gbb` bytes; AVX2 and F16C are present.
    #[inline(always)]
    unsafe fn group_scales(p: *const u8, gbb: usize, prefetch: bool) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            if prefetch {
                prefetch_ahead(p, gbb);
            }
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        }
    }

    /// `mins` (a Q4_1 or Q5_1 group's 8 rows) plus each row's min times `ds`:
    /// `fma(m, ds, mins)`.
    ///
    /// # Safety
    /// `p` is a Q4_1 or Q5_1 group block (`m[8]` f16 after the scales); AVX2, FMA and F16C are
    /// present.
    #[inline(always)]
    unsafe fn add_mins(p: *const u8, ds: f32, mins: __m256) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            let m8 = _mm256_cvtph_ps(_mm_loadu_si128(p.add(MINS_AT).cast()));
            _mm256_fmadd_ps(m8, _mm256_set1_ps(ds), mins)
        }
    }

    /// `packed_with` for the group's format.
    ///
    /// # Safety
    /// As `packed_with`.
    #[inline(always)]
    unsafe fn packed_by_format<M: MulSum, const R: usize>(
        xs: &[&[Q8Block]; R],
        g: PackedGroup<'_>,
        prefetch: bool,
    ) -> [[f32; PACK]; R] {
        // SAFETY: the caller's contract.
        unsafe {
            match g.format {
                Format::Q4_0 => packed_with::<M, Q40, R>(xs, g, prefetch),
                Format::Q4_1 => packed_with::<M, Q41, R>(xs, g, prefetch),
                Format::Q5_0 => packed_with::<M, Q50, R>(xs, g, prefetch),
                Format::Q5_1 => packed_with::<M, Q51, R>(xs, g, prefetch),
                Format::Q8_0 => packed_with::<M, Q80, R>(xs, g, prefetch),
                Format::Q4K => packed_k::<M, Q4k, R>(xs, g, prefetch),
                Format::Q5K => packed_k::<M, Q5k, R>(xs, g, prefetch),
                _ => packed_k::<M, Q6k, R>(xs, g, prefetch),
            }
        }
    }

    /// `R` rows × one repacked group (`packed.rs`) in the canonical order: a register holds
    /// two of the group's rows, four lanes each; per block, the group's 8 scales are converted
    /// at once, and a 32-byte load gives two rows' values 0–15 (4-bit: masked) and 16–31
    /// (shifted; Q8_0: a second load).
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present (and whatever `M` needs); lengths are checked here.
    #[inline(always)]
    unsafe fn packed_with<M: MulSum, F: Fmt, const R: usize>(
        xs: &[&[Q8Block]; R],
        g: PackedGroup<'_>,
        prefetch: bool,
    ) -> [[f32; PACK]; R] {
        /// Registers a group block's rows take: rows `2k` and `2k + 1` in register `k`.
        const REGS: usize = PACK / 2;
        let format = F::FORMAT;
        let nb = check_packed(xs, g);
        let gbb = PACK * format.block_bytes();
        let qs = qs_offset(format);
        // SAFETY: the features are the caller's contract; every pointer is inside group
        // block `b < nb` (checked to be `gbb` bytes each) or activation block `b`.
        unsafe {
            // Register k's scales: row 2k's in lanes 0..4, row 2k + 1's above.
            let pick: [__m256i; REGS] = std::array::from_fn(|k| {
                let (lo, hi) = (2 * k as i32, 2 * k as i32 + 1);
                _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi)
            });
            let mut acc = [[_mm256_setzero_ps(); REGS]; R]; // [R][register]: 2 rows × 4 lanes
            let mut mins = [_mm256_setzero_ps(); R]; // [R]: the group's 8 rows
            let low = _mm256_set1_epi8(0x0F);
            for b in 0..nb {
                let p = g.data.as_ptr().add(b * gbb);
                // The 8 rows' scales.
                let d8 = group_scales(p, gbb, prefetch);
                // Each register's two rows (2k, 2k + 1): values 0–15, then 16–31.
                let mut w = [[_mm256_setzero_si256(); 2]; REGS];
                for (k, wk) in w.iter_mut().enumerate() {
                    if format == Format::Q8_0 {
                        // Quad k / 2, its rows' low halves, then their high halves.
                        wk[0] = _mm256_loadu_si256(p.add(qs + q8_half_at(2 * k, 0)).cast());
                        wk[1] = _mm256_loadu_si256(p.add(qs + q8_half_at(2 * k, 1)).cast());
                    } else {
                        let v = _mm256_loadu_si256(p.add(qs + q4_row_at(2 * k)).cast());
                        wk[0] = _mm256_and_si256(v, low);
                        wk[1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                        if five_bit(format) {
                            // Rows 2k, 2k + 1's qh_lo (then qh_hi): one u32 each.
                            let qh = p.add(qh_offset(format) + 4 * k);
                            let lo = qh.cast::<u32>().read_unaligned();
                            let hi = qh.add(2 * PACK).cast::<u32>().read_unaligned();
                            wk[0] = _mm256_or_si256(wk[0], fifth_bits(lo));
                            wk[1] = _mm256_or_si256(wk[1], fifth_bits(hi));
                        }
                    }
                }
                for r in 0..R {
                    let x = &*xs[r].as_ptr().add(b);
                    let xv = [half_x2(&x.qs, 0), half_x2(&x.qs, 1)];
                    let xl = [half_x2(&x.ql, 0), half_x2(&x.ql, 1)];
                    // dw · d, each of the group's rows.
                    let s8 = _mm256_mul_ps(d8, _mm256_set1_ps(x.d));
                    // Q4_0's values are nibble − 8: Σ (n − 8)·x = Σ n·x − 8·Σ x, lane by
                    // lane, exact in i32 (|8·Σ x| ≤ 8·8·32258); Q5_0's − 16 alike.
                    let eight = if value_offset(format) != 0 {
                        let e = _mm256_set1_epi8(value_offset(format));
                        M::levels2([e, e], xv, xl)
                    } else {
                        _mm256_setzero_si256()
                    };
                    for (k, wk) in w.iter().enumerate() {
                        let lanes = if format == Format::Q8_0 {
                            // Signed weights: |w| · (x signed as w), |w| ≤ 128.
                            let sx = [
                                _mm256_sign_epi8(xv[0], wk[0]),
                                _mm256_sign_epi8(xv[1], wk[1]),
                            ];
                            let sl = [
                                _mm256_sign_epi8(xl[0], wk[0]),
                                _mm256_sign_epi8(xl[1], wk[1]),
                            ];
                            M::levels2([_mm256_abs_epi8(wk[0]), _mm256_abs_epi8(wk[1])], sx, sl)
                        } else {
                            _mm256_sub_epi32(M::levels2(*wk, xv, xl), eight)
                        };
                        let s = _mm256_permutevar8x32_ps(s8, pick[k]);
                        acc[r][k] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(lanes), acc[r][k]);
                    }
                    if has_min(format) {
                        mins[r] = add_mins(p, x.ds, mins[r]);
                    }
                }
            }
            let mut out = [[0.0f32; PACK]; R];
            for r in 0..R {
                let m = std::mem::transmute::<__m256, [f32; 8]>(mins[r]);
                for k in 0..REGS {
                    let a = std::mem::transmute::<__m256, [[f32; LANES]; 2]>(acc[r][k]);
                    out[r][2 * k] = finish(&a[0], m[2 * k]);
                    out[r][2 * k + 1] = finish(&a[1], m[2 * k + 1]);
                }
            }
            out
        }
    }

    /// `packed_with` on 512-bit registers, for the VNNI kernel: each register holds four of
    /// the group's rows (a 64-byte load of four rows' 16 nibble bytes, masked and shifted,
    /// or Q8_0's quad of low and high halves: `packed.rs`), so a group block is two
    /// registers of byte dots, conversions and multiply-adds. Lane by lane it computes what
    /// `packed_with` does, so its bits are the same: a quarter's 4 lanes are one row's lane
    /// sums of one block (the activation planes' halves are broadcast to every quarter),
    /// scaled by that row's `dw · d` and added into that row's accumulator. Q8_0's signed
    /// weights take the `|w| · (x signed as w)` form of the 256-bit kernels, the sign applied
    /// by a masked negation (AVX-512 has no 512-bit `vpsignb`; where `w` = 0 the product is
    /// 0 either way).
    ///
    /// # Safety
    /// AVX-512F, BW, VNNI, F16C and FMA are present; lengths are checked here.
    #[inline(always)]
    unsafe fn packed_with_512<F: Fmt, const R: usize>(
        xs: &[&[Q8Block]; R],
        g: PackedGroup<'_>,
        prefetch: bool,
    ) -> [[f32; PACK]; R] {
        /// Registers a group block's rows take: rows `4k..4k + 4` in register `k`.
        const REGS: usize = PACK / 4;
        let format = F::FORMAT;
        let nb = check_packed(xs, g);
        let gbb = PACK * format.block_bytes();
        let qs = qs_offset(format);
        // SAFETY: the features are the caller's contract; every pointer is inside group
        // block `b < nb` (checked to be `gbb` bytes each) or activation block `b`.
        unsafe {
            // Register k's scales: row 4k + j's in lanes 4j..4j + 4.
            let pick: [__m512i; REGS] = std::array::from_fn(|k| {
                let r = |j: i32| 4 * k as i32 + j;
                #[rustfmt::skip]
                let v = _mm512_setr_epi32(
                    r(0), r(0), r(0), r(0), r(1), r(1), r(1), r(1),
                    r(2), r(2), r(2), r(2), r(3), r(3), r(3), r(3),
                );
                v
            });
            let mut acc = [[_mm512_setzero_ps(); REGS]; R]; // [R][register]: 4 rows × 4 lanes
            let mut mins = [_mm256_setzero_ps(); R]; // [R]: the group's 8 rows
            let low = _mm512_set1_epi8(0x0F);
            for b in 0..nb {
                let p = g.data.as_ptr().add(b * gbb);
                // The 8 rows' scales.
                let d8 = group_scales(p, gbb, prefetch);
                // Each register's four rows (4k..4k + 4): values 0–15, then 16–31.
                let mut w = [[_mm512_setzero_si512(); 2]; REGS];
                for (k, wk) in w.iter_mut().enumerate() {
                    if format == Format::Q8_0 {
                        wk[0] = _mm512_loadu_si512(p.add(qs + q8_half_at(4 * k, 0)).cast());
                        wk[1] = _mm512_loadu_si512(p.add(qs + q8_half_at(4 * k, 1)).cast());
                    } else {
                        let v = _mm512_loadu_si512(p.add(qs + q4_row_at(4 * k)).cast());
                        wk[0] = _mm512_and_si512(v, low);
                        wk[1] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                        if five_bit(format) {
                            // Rows 4k..4k + 4's qh_lo (then qh_hi) are the byte masks.
                            let qh = p.add(qh_offset(format) + 8 * k);
                            let lo = qh.cast::<u64>().read_unaligned();
                            let hi = qh.add(2 * PACK).cast::<u64>().read_unaligned();
                            let sixteen = _mm512_set1_epi8(0x10);
                            wk[0] = _mm512_or_si512(wk[0], _mm512_maskz_mov_epi8(lo, sixteen));
                            wk[1] = _mm512_or_si512(wk[1], _mm512_maskz_mov_epi8(hi, sixteen));
                        }
                    }
                }
                for r in 0..R {
                    let x = &*xs[r].as_ptr().add(b);
                    let xv = [half_x4(&x.qs, 0), half_x4(&x.qs, 1)];
                    let xl = [half_x4(&x.ql, 0), half_x4(&x.ql, 1)];
                    // dw · d, each of the group's rows (lanes 0..8).
                    let s8 = _mm512_castps256_ps512(_mm256_mul_ps(d8, _mm256_set1_ps(x.d)));
                    // Q4_0: Σ (n − 8)·x = Σ n·x − 8·Σ x, as in `packed_with` (Q5_0: 16).
                    let eight = if value_offset(format) != 0 {
                        let e = _mm512_set1_epi8(value_offset(format));
                        levels_512([e, e], xv, xl)
                    } else {
                        _mm512_setzero_si512()
                    };
                    for (k, wk) in w.iter().enumerate() {
                        let lanes = if format == Format::Q8_0 {
                            let sx = [signed_as(xv[0], wk[0]), signed_as(xv[1], wk[1])];
                            let sl = [signed_as(xl[0], wk[0]), signed_as(xl[1], wk[1])];
                            levels_512([_mm512_abs_epi8(wk[0]), _mm512_abs_epi8(wk[1])], sx, sl)
                        } else {
                            _mm512_sub_epi32(levels_512(*wk, xv, xl), eight)
                        };
                        let s = _mm512_permutexvar_ps(pick[k], s8);
                        acc[r][k] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(lanes), acc[r][k]);
                    }
                    if has_min(format) {
                        mins[r] = add_mins(p, x.ds, mins[r]);
                    }
                }
            }
            let mut out = [[0.0f32; PACK]; R];
            for r in 0..R {
                let m = std::mem::transmute::<__m256, [f32; 8]>(mins[r]);
                for k in 0..REGS {
                    let a = std::mem::transmute::<__m512, [[f32; LANES]; 4]>(acc[r][k]);
                    for (j, a) in a.iter().enumerate() {
                        out[r][4 * k + j] = finish(a, m[4 * k + j]);
                    }
                }
            }
            out
        }
    }

    /// Whether block `t` of a K-quant group unit starts new high bits (`packed.rs`), and
    /// which 128-value chunk's: Q5_K's serve the whole super-block (loaded at `t` = 0),
    /// Q6_K's the chunk `t` is in (at `t` = 0 and 4).
    #[inline(always)]
    fn k_high_bits_due(format: Format, t: usize) -> Option<usize> {
        match format {
            Format::Q5K if t == 0 => Some(0),
            Format::Q6K if t.is_multiple_of(4) => Some(t / 4),
            _ => None,
        }
    }

    /// `R` rows × one repacked K-quant group (`packed.rs`) in the canonical order, on 256-bit
    /// registers (two rows each, as `packed_with`): per super-block the 8 rows' `d` (and
    /// `dmin`) are converted once; per block, its nibbles (with Q5_K's fifth and Q6_K's
    /// two high bits), its sub-scales widened to each row's four i32 lanes and multiplied
    /// into the lane sums (Q6_K: each half's by its own scale), then the one multiply-add.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present (and whatever `M` needs); lengths are checked here.
    #[inline(always)]
    unsafe fn packed_k<M: MulSum, F: Fmt, const R: usize>(
        xs: &[&[Q8Block]; R],
        g: PackedGroup<'_>,
        prefetch: bool,
    ) -> [[f32; PACK]; R] {
        /// Registers a group block's rows take: rows `2k` and `2k + 1` in register `k`.
        const REGS: usize = PACK / 2;
        let format = F::FORMAT;
        let nb = check_packed(xs, g);
        let gub = PACK * unit_bytes(format);
        let parts = k_parts(format);
        let six = format == Format::Q6K;
        // SAFETY: the features are the caller's contract; every pointer is inside group
        // unit `u < nb / 8` (checked to be `gub` bytes each) or activation block `8u + t`.
        unsafe {
            let pick: [__m256i; REGS] = std::array::from_fn(|k| {
                let (lo, hi) = (2 * k as i32, 2 * k as i32 + 1);
                _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi)
            });
            let mut acc = [[_mm256_setzero_ps(); REGS]; R];
            let mut mins = [_mm256_setzero_ps(); R];
            let low = _mm256_set1_epi8(0x0F);
            let mut qh = [[_mm256_setzero_si256(); REGS]; 2]; // [half][register]
            for u in 0..nb / K_BLOCKS {
                let p = g.data.as_ptr().add(u * gub);
                let d8 = group_scales(p, gub, prefetch);
                let dmin8 = if has_min(format) {
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(MINS_AT).cast()))
                } else {
                    _mm256_setzero_ps() // Q6_K: no mins
                };
                for t in 0..K_BLOCKS {
                    if let Some(chunk) = k_high_bits_due(format, t) {
                        for (h, qh) in qh.iter_mut().enumerate() {
                            for (k, q) in qh.iter_mut().enumerate() {
                                let at = parts.qh + ((2 * chunk + h) * PACK + 2 * k) * 16;
                                *q = _mm256_loadu_si256(p.add(at).cast());
                            }
                        }
                    }
                    let mut w = [[_mm256_setzero_si256(); 2]; REGS];
                    for (k, wk) in w.iter_mut().enumerate() {
                        let at = parts.qs + t * PACK * 16 + q4_row_at(2 * k);
                        let v = _mm256_loadu_si256(p.add(at).cast());
                        wk[0] = _mm256_and_si256(v, low);
                        wk[1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                        for (h, wh) in wk.iter_mut().enumerate() {
                            if format == Format::Q5K {
                                let bit = _mm256_set1_epi8((1u8 << t) as i8);
                                let on = _mm256_cmpeq_epi8(_mm256_and_si256(qh[h][k], bit), bit);
                                let fifth = _mm256_and_si256(on, _mm256_set1_epi8(0x10));
                                *wh = _mm256_or_si256(*wh, fifth);
                            } else if six {
                                let shift = _mm_cvtsi32_si128(2 * (t % 4) as i32);
                                let two = _mm256_and_si256(
                                    _mm256_srl_epi16(qh[h][k], shift),
                                    _mm256_set1_epi8(3),
                                );
                                *wh = _mm256_or_si256(*wh, _mm256_slli_epi16::<4>(two));
                            }
                        }
                    }
                    // The block's sub-scales, row r's in its register's lanes: [half][k].
                    let halves = if six { 2 } else { 1 };
                    let mut sc = [[_mm256_setzero_si256(); REGS]; 2];
                    for (h, sc) in sc.iter_mut().enumerate().take(halves) {
                        let v = _mm_loadl_epi64(p.add(parts.sc + (halves * t + h) * PACK).cast());
                        let s8 = if six {
                            _mm256_cvtepi8_epi32(v)
                        } else {
                            _mm256_cvtepu8_epi32(v)
                        };
                        for (k, sc) in sc.iter_mut().enumerate() {
                            *sc = _mm256_permutevar8x32_epi32(s8, pick[k]);
                        }
                    }
                    // The block's mins as dmin · m (mw = −dmin · m: subtracted below).
                    let m8 = if has_min(format) {
                        let v = _mm_loadl_epi64(p.add(parts.mins + t * PACK).cast());
                        _mm256_mul_ps(dmin8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)))
                    } else {
                        _mm256_setzero_ps()
                    };
                    for r in 0..R {
                        let x = &*xs[r].as_ptr().add(u * K_BLOCKS + t);
                        let xv = [half_x2(&x.qs, 0), half_x2(&x.qs, 1)];
                        let xl = [half_x2(&x.ql, 0), half_x2(&x.ql, 1)];
                        let s8 = _mm256_mul_ps(d8, _mm256_set1_ps(x.d));
                        // Q6_K's values are q − 32: per half, Σ q·x − 32·Σ x.
                        let e32 = if six {
                            let e = _mm256_set1_epi8(32);
                            [M::levels(e, xv[0], xl[0]), M::levels(e, xv[1], xl[1])]
                        } else {
                            [_mm256_setzero_si256(); 2]
                        };
                        for (k, wk) in w.iter().enumerate() {
                            let lanes = if six {
                                let a = _mm256_sub_epi32(M::levels(wk[0], xv[0], xl[0]), e32[0]);
                                let b = _mm256_sub_epi32(M::levels(wk[1], xv[1], xl[1]), e32[1]);
                                _mm256_add_epi32(
                                    _mm256_mullo_epi32(a, sc[0][k]),
                                    _mm256_mullo_epi32(b, sc[1][k]),
                                )
                            } else {
                                _mm256_mullo_epi32(M::levels2(*wk, xv, xl), sc[0][k])
                            };
                            let s = _mm256_permutevar8x32_ps(s8, pick[k]);
                            acc[r][k] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(lanes), acc[r][k]);
                        }
                        if has_min(format) {
                            // fma(−dmin·m, ds, mins), one rounding as the reference's.
                            mins[r] = _mm256_fnmadd_ps(m8, _mm256_set1_ps(x.ds), mins[r]);
                        }
                    }
                }
            }
            let mut out = [[0.0f32; PACK]; R];
            for r in 0..R {
                let m = std::mem::transmute::<__m256, [f32; 8]>(mins[r]);
                for k in 0..REGS {
                    let a = std::mem::transmute::<__m256, [[f32; LANES]; 2]>(acc[r][k]);
                    out[r][2 * k] = finish(&a[0], m[2 * k]);
                    out[r][2 * k + 1] = finish(&a[1], m[2 * k + 1]);
                }
            }
            out
        }
    }

    /// `packed_k` on 512-bit registers, for the VNNI kernel: four rows a register, as
    /// `packed_with_512`; the same lanes, so the same bits.
    ///
    /// # Safety
    /// AVX-512F, BW, VNNI, F16C and FMA are present; lengths are checked here.
    #[inline(always)]
    unsafe fn packed_k_512<F: Fmt, const R: usize>(
        xs: &[&[Q8Block]; R],
        g: PackedGroup<'_>,
        prefetch: bool,
    ) -> [[f32; PACK]; R] {
        /// Registers a group block's rows take: rows `4k..4k + 4` in register `k`.
        const REGS: usize = PACK / 4;
        let format = F::FORMAT;
        let nb = check_packed(xs, g);
        let gub = PACK * unit_bytes(format);
        let parts = k_parts(format);
        let six = format == Format::Q6K;
        // SAFETY: the features are the caller's contract; every pointer is inside group
        // unit `u < nb / 8` (checked to be `gub` bytes each) or activation block `8u + t`.
        unsafe {
            let pick: [__m512i; REGS] = std::array::from_fn(|k| {
                let r = |j: i32| 4 * k as i32 + j;
                #[rustfmt::skip]
                let v = _mm512_setr_epi32(
                    r(0), r(0), r(0), r(0), r(1), r(1), r(1), r(1),
                    r(2), r(2), r(2), r(2), r(3), r(3), r(3), r(3),
                );
                v
            });
            let mut acc = [[_mm512_setzero_ps(); REGS]; R];
            let mut mins = [_mm256_setzero_ps(); R];
            let low = _mm512_set1_epi8(0x0F);
            let mut qh = [[_mm512_setzero_si512(); REGS]; 2]; // [half][register]
            for u in 0..nb / K_BLOCKS {
                let p = g.data.as_ptr().add(u * gub);
                let d8 = group_scales(p, gub, prefetch);
                let dmin8 = if has_min(format) {
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(MINS_AT).cast()))
                } else {
                    _mm256_setzero_ps() // Q6_K: no mins
                };
                for t in 0..K_BLOCKS {
                    if let Some(chunk) = k_high_bits_due(format, t) {
                        for (h, qh) in qh.iter_mut().enumerate() {
                            for (k, q) in qh.iter_mut().enumerate() {
                                let at = parts.qh + ((2 * chunk + h) * PACK + 4 * k) * 16;
                                *q = _mm512_loadu_si512(p.add(at).cast());
                            }
                        }
                    }
                    let mut w = [[_mm512_setzero_si512(); 2]; REGS];
                    for (k, wk) in w.iter_mut().enumerate() {
                        let at = parts.qs + t * PACK * 16 + q4_row_at(4 * k);
                        let v = _mm512_loadu_si512(p.add(at).cast());
                        wk[0] = _mm512_and_si512(v, low);
                        wk[1] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                        for (h, wh) in wk.iter_mut().enumerate() {
                            if format == Format::Q5K {
                                let bit = _mm512_set1_epi8((1u8 << t) as i8);
                                let on = _mm512_test_epi8_mask(qh[h][k], bit);
                                let fifth = _mm512_maskz_mov_epi8(on, _mm512_set1_epi8(0x10));
                                *wh = _mm512_or_si512(*wh, fifth);
                            } else if six {
                                let shift = _mm_cvtsi32_si128(2 * (t % 4) as i32);
                                let two = _mm512_and_si512(
                                    _mm512_srl_epi16(qh[h][k], shift),
                                    _mm512_set1_epi8(3),
                                );
                                *wh = _mm512_or_si512(*wh, _mm512_slli_epi16::<4>(two));
                            }
                        }
                    }
                    let halves = if six { 2 } else { 1 };
                    let mut sc = [[_mm512_setzero_si512(); REGS]; 2];
                    for (h, sc) in sc.iter_mut().enumerate().take(halves) {
                        let v = _mm_loadl_epi64(p.add(parts.sc + (halves * t + h) * PACK).cast());
                        let s8 = if six {
                            _mm256_cvtepi8_epi32(v)
                        } else {
                            _mm256_cvtepu8_epi32(v)
                        };
                        for (k, sc) in sc.iter_mut().enumerate() {
                            *sc = _mm512_permutexvar_epi32(pick[k], _mm512_castsi256_si512(s8));
                        }
                    }
                    let m8 = if has_min(format) {
                        let v = _mm_loadl_epi64(p.add(parts.mins + t * PACK).cast());
                        _mm256_mul_ps(dmin8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)))
                    } else {
                        _mm256_setzero_ps()
                    };
                    for r in 0..R {
                        let x = &*xs[r].as_ptr().add(u * K_BLOCKS + t);
                        let xv = [half_x4(&x.qs, 0), half_x4(&x.qs, 1)];
                        let xl = [half_x4(&x.ql, 0), half_x4(&x.ql, 1)];
                        let s8 = _mm512_castps256_ps512(_mm256_mul_ps(d8, _mm256_set1_ps(x.d)));
                        let e32 = if six {
                            let e = _mm512_set1_epi8(32);
                            [level_512(e, xv[0], xl[0]), level_512(e, xv[1], xl[1])]
                        } else {
                            [_mm512_setzero_si512(); 2]
                        };
                        for (k, wk) in w.iter().enumerate() {
                            let lanes = if six {
                                let a = _mm512_sub_epi32(level_512(wk[0], xv[0], xl[0]), e32[0]);
                                let b = _mm512_sub_epi32(level_512(wk[1], xv[1], xl[1]), e32[1]);
                                _mm512_add_epi32(
                                    _mm512_mullo_epi32(a, sc[0][k]),
                                    _mm512_mullo_epi32(b, sc[1][k]),
                                )
                            } else {
                                _mm512_mullo_epi32(levels_512(*wk, xv, xl), sc[0][k])
                            };
                            let s = _mm512_permutexvar_ps(pick[k], s8);
                            acc[r][k] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(lanes), acc[r][k]);
                        }
                        if has_min(format) {
                            mins[r] = _mm256_fnmadd_ps(m8, _mm256_set1_ps(x.ds), mins[r]);
                        }
                    }
                }
            }
            let mut out = [[0.0f32; PACK]; R];
            for r in 0..R {
                let m = std::mem::transmute::<__m256, [f32; 8]>(mins[r]);
                for k in 0..REGS {
                    let a = std::mem::transmute::<__m512, [[f32; LANES]; 4]>(acc[r][k]);
                    for (j, a) in a.iter().enumerate() {
                        out[r][4 * k + j] = finish(a, m[4 * k + j]);
                    }
                }
            }
            out
        }
    }

    /// One register's lane sums against an activation block's two planes, as its levels,
    /// on 512-bit registers (`MulSum::levels` with `vpdpbusd`).
    #[inline(always)]
    unsafe fn level_512(u: __m512i, qs: __m512i, ql: __m512i) -> __m512i {
        // SAFETY: inlined only into the 512-bit kernels (AVX-512F and VNNI, their contract).
        unsafe {
            let coarse = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, qs);
            let coarse = _mm512_mullo_epi32(coarse, _mm512_set1_epi32(PLANE));
            _mm512_dpbusd_epi32(coarse, u, ql)
        }
    }

    /// `x` negated where `w` is negative (byte by byte): `vpsignb` on 512 bits, but for
    /// `w` = 0, whose product is 0 either way.
    #[inline(always)]
    unsafe fn signed_as(x: __m512i, w: __m512i) -> __m512i {
        // SAFETY: inlined only into the 512-bit kernel (AVX-512BW, its contract).
        unsafe { _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x) }
    }

    /// An activation plane's values `16h..16h + 16` in every 128-bit quarter (each row slot).
    #[inline(always)]
    unsafe fn half_x4(plane: &[i8; QK], h: usize) -> __m512i {
        // SAFETY: 16 bytes from 16h of a 32-byte plane; AVX-512F is the caller's contract.
        unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(plane.as_ptr().add(16 * h).cast())) }
    }

    /// `MulSum::levels2` with `vpdpbusd` on 512-bit registers: four rows' lanes.
    #[inline(always)]
    unsafe fn levels_512(u: [__m512i; 2], qs: [__m512i; 2], ql: [__m512i; 2]) -> __m512i {
        // SAFETY: inlined only into the 512-bit kernel (AVX-512F and VNNI, its contract).
        unsafe {
            let coarse = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], qs[0]);
            let coarse = _mm512_dpbusd_epi32(coarse, u[1], qs[1]);
            let coarse = _mm512_mullo_epi32(coarse, _mm512_set1_epi32(PLANE));
            _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(coarse, u[0], ql[0]), u[1], ql[1])
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_packed<const R: usize>(
        xs: &[&[Q8Block]; R],
        g: PackedGroup<'_>,
        prefetch: bool,
    ) -> [[f32; PACK]; R] {
        // SAFETY: this function runs only with AVX2, FMA and F16C (its caller's contract).
        unsafe { packed_by_format::<Maddubs, R>(xs, g, prefetch) }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn vnni_packed<const R: usize>(
        xs: &[&[Q8Block]; R],
        g: PackedGroup<'_>,
        prefetch: bool,
    ) -> [[f32; PACK]; R] {
        // SAFETY: this function runs only with those features (its caller's contract).
        unsafe {
            match g.format {
                Format::Q4_0 => packed_with_512::<Q40, R>(xs, g, prefetch),
                Format::Q4_1 => packed_with_512::<Q41, R>(xs, g, prefetch),
                Format::Q5_0 => packed_with_512::<Q50, R>(xs, g, prefetch),
                Format::Q5_1 => packed_with_512::<Q51, R>(xs, g, prefetch),
                Format::Q8_0 => packed_with_512::<Q80, R>(xs, g, prefetch),
                Format::Q4K => packed_k_512::<Q4k, R>(xs, g, prefetch),
                Format::Q5K => packed_k_512::<Q5k, R>(xs, g, prefetch),
                _ => packed_k_512::<Q6k, R>(xs, g, prefetch),
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_block<const R: usize, const C: usize>(
        format: Format,
        xs: &[&[Q8Block]; R],
        ws: &[&[u8]; C],
    ) -> [[f32; C]; R] {
        // SAFETY: this function runs only with AVX2, FMA and F16C (its caller's contract).
        unsafe { by_format::<Maddubs, R, C>(format, xs, ws) }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn vnni_block<const R: usize, const C: usize>(
        format: Format,
        xs: &[&[Q8Block]; R],
        ws: &[&[u8]; C],
    ) -> [[f32; C]; R] {
        // SAFETY: this function runs only with those features (its caller's contract).
        unsafe { by_format::<Dpbusd, R, C>(format, xs, ws) }
    }

    impl Q8Dot for Avx2 {
        #[inline(always)]
        fn q8_block<const R: usize, const C: usize>(
            self,
            format: Format,
            xs: &[&[Q8Block]; R],
            ws: &[&[u8]; C],
        ) -> [[f32; C]; R] {
            if !stored_kernel(format) {
                return Portable.q8_block(format, xs, ws);
            }
            // SAFETY: an `Avx2` exists only once AVX2, FMA and F16C were detected.
            unsafe { avx2_block(format, xs, ws) }
        }

        #[inline(always)]
        fn packed_block<const R: usize>(
            self,
            xs: &[&[Q8Block]; R],
            g: PackedGroup<'_>,
        ) -> [[f32; PACK]; R] {
            // SAFETY: an `Avx2` exists only once AVX2, FMA and F16C were detected.
            unsafe { avx2_packed(xs, g, self.prefetch) }
        }
    }

    impl Q8Dot for Vnni {
        #[inline(always)]
        fn q8_block<const R: usize, const C: usize>(
            self,
            format: Format,
            xs: &[&[Q8Block]; R],
            ws: &[&[u8]; C],
        ) -> [[f32; C]; R] {
            if !stored_kernel(format) {
                return Portable.q8_block(format, xs, ws);
            }
            // SAFETY: a `Vnni` exists only once its features were detected.
            unsafe { vnni_block(format, xs, ws) }
        }

        #[inline(always)]
        fn packed_block<const R: usize>(
            self,
            xs: &[&[Q8Block]; R],
            g: PackedGroup<'_>,
        ) -> [[f32; PACK]; R] {
            // SAFETY: a `Vnni` exists only once its features were detected.
            unsafe { vnni_packed(xs, g, self.prefetch) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cpu::packed::{Packed, FORMATS};
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Row lengths (in 32-value blocks) to test `format` at: 1, 3 and 18 stored blocks of
    /// the 32-value formats, 1 and 3 super-blocks of the K-quants.
    fn block_counts(format: Format) -> &'static [usize] {
        if blocks_per_unit(format) == 1 {
            &[1, 3, 18]
        } else {
            &[8, 24]
        }
    }

    /// `n` rows of `k` values in `format`, by candle's quantizer.
    fn stored(values: &[f32], format: Format, n: usize, k: usize) -> Vec<u8> {
        let t = Tensor::from_vec(values.to_vec(), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, format.ggml().unwrap()).unwrap();
        q.data().unwrap().into_owned()
    }

    fn quantized(x: &[f32]) -> Vec<Q8Block> {
        let mut q = vec![Q8Block::ZERO; x.len() / QK];
        quantize_row(x, &mut q);
        q
    }

    /// Blocks whose bytes are the extremes the kernels must not overflow or saturate on:
    /// every value bit set (or clear), Q8_0 bytes −128 (or 127), the largest K-quant
    /// sub-scales (Q6_K's −128), next to activations ±127. `nb` blocks of 32 a row.
    fn extreme_rows(format: Format, c: usize, nb: usize, rng: &mut StdRng) -> Vec<u8> {
        let bb = format.block_bytes();
        let units = nb / blocks_per_unit(format);
        let mut out = vec![0u8; c * units * bb];
        for (i, blk) in out.chunks_exact_mut(bb).enumerate() {
            let d = f16::from_f32(rng.random_range(0.5..2.0)).to_le_bytes();
            let even = i.is_multiple_of(2);
            match format {
                Format::Q8_0 => blk[2..].fill(if even { 0x80 } else { 0x7F }),
                Format::Q6K => {
                    blk[..192].fill(if even { 0xFF } else { 0x00 });
                    blk[192..208].fill(0x80);
                }
                _ => blk.fill(if even { 0xFF } else { 0x00 }),
            }
            match format {
                Format::Q4_1 | Format::Q5_1 => {
                    blk[2..4].copy_from_slice(&f16::from_f32(-1.5).to_le_bytes())
                }
                Format::Q4K | Format::Q5K => {
                    blk[2..4].copy_from_slice(&f16::from_f32(1.5).to_le_bytes());
                    blk[4..16].fill(0xFF); // scales and mins 63
                }
                _ => {}
            }
            let at = if format == Format::Q6K { 208 } else { 0 };
            blk[at..at + 2].copy_from_slice(&d);
        }
        out
    }

    /// Blocks whose first value is the maximum and the rest sit at levels `±(32258 − 127)`
    /// (coarse plane ±127, fine plane ∓127): both planes at their extremes.
    fn extreme_levels(k: usize) -> Vec<Q8Block> {
        let near = (LEVELS - 127) as f32 / LEVELS as f32;
        let x: Vec<f32> = (0..k)
            .map(|i| {
                let sign = if (i / QK).is_multiple_of(2) {
                    1.0
                } else {
                    -1.0
                };
                sign * if i % QK == 0 { 1e3 } else { 1e3 * near }
            })
            .collect();
        let q = quantized(&x);
        assert_eq!((q[0].qs[1], q[0].ql[1]), (127, -127), "{:?}", q[0]);
        q
    }

    fn bits<const C: usize>(v: &[[f32; C]]) -> Vec<u32> {
        v.iter().flatten().map(|x| x.to_bits()).collect()
    }

    /// Every kernel on this machine against the portable one, on `R × C` blocks.
    fn check_kernels<const R: usize, const C: usize>(
        format: Format,
        xs: &[Vec<Q8Block>],
        ws: &[u8],
        what: &str,
    ) {
        let nb = xs[0].len();
        let rb = format.row_bytes(nb * QK).unwrap();
        let xr: [&[Q8Block]; R] = std::array::from_fn(|r| xs[r].as_slice());
        let wr: [&[u8]; C] = std::array::from_fn(|c| &ws[c * rb..(c + 1) * rb]);
        let want = Portable.q8_block(format, &xr, &wr);
        assert!(want.iter().flatten().all(|v| v.is_finite()), "{what}");
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(k) = Avx2::detect() {
                let got = k.q8_block(format, &xr, &wr);
                assert_eq!(bits(&got), bits(&want), "AVX2 {R}×{C}: {format} {what}");
            }
            if let Some(k) = Vnni::detect() {
                let got = k.q8_block(format, &xr, &wr);
                assert_eq!(bits(&got), bits(&want), "VNNI {R}×{C}: {format} {what}");
            }
        }
    }

    fn check_all_shapes(format: Format, xs: &[Vec<Q8Block>], ws: &[u8], what: &str) {
        check_kernels::<1, 1>(format, xs, ws, what);
        check_kernels::<1, 4>(format, xs, ws, what);
        check_kernels::<2, 3>(format, xs, ws, what);
        check_kernels::<4, 4>(format, xs, ws, what);
    }

    /// Random rows, all-zero rows, and the extreme bytes: every kernel gives the portable
    /// kernel's bits. (A kernel this CPU lacks is not checked here.)
    #[test]
    fn every_integer_kernel_gives_the_portable_bits() {
        let mut rng = StdRng::seed_from_u64(41);
        for format in FORMATS {
            for &nb in block_counts(format) {
                let k = nb * QK;
                let w: Vec<f32> = (0..4 * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let ws = stored(&w, format, 4, k);
                let xs: Vec<Vec<Q8Block>> = (0..4)
                    .map(|_| {
                        let x: Vec<f32> = (0..k).map(|_| rng.random_range(-3.0..3.0)).collect();
                        quantized(&x)
                    })
                    .collect();
                check_all_shapes(format, &xs, &ws, &format!("random, nb {nb}"));

                let zero = vec![quantized(&vec![0.0; k]); 4];
                check_all_shapes(format, &zero, &ws, &format!("zero x, nb {nb}"));
                let zw = stored(&vec![0.0; 4 * k], format, 4, k);
                check_all_shapes(format, &xs, &zw, &format!("zero w, nb {nb}"));

                // ±127 everywhere (alternating signs per block) against the extreme bytes.
                let ext: Vec<Vec<Q8Block>> = (0..4)
                    .map(|r| {
                        let x: Vec<f32> = (0..k)
                            .map(|i| {
                                if (i / QK + r).is_multiple_of(2) {
                                    1e3
                                } else {
                                    -1e3
                                }
                            })
                            .collect();
                        quantized(&x)
                    })
                    .collect();
                assert!(ext[0][0].qs.iter().all(|&q| q == 127));
                let ew = extreme_rows(format, 4, nb, &mut rng);
                check_all_shapes(format, &ext, &ew, &format!("extremes, nb {nb}"));
                // The fine plane at its extreme too: levels 32258 − 127 (qs 127, ql −127).
                let fine = vec![extreme_levels(k); 4];
                check_all_shapes(format, &fine, &ew, &format!("fine extremes, nb {nb}"));
            }
        }
    }

    /// Every kernel's `packed_block` (the portable one's too) over every group of `ws`'s
    /// `n` rows repacked, for the first `R` rows of `xs`: the portable `q8_block`'s bits on
    /// the rows as stored.
    fn check_packed<const R: usize>(format: Format, xs: &[Vec<Q8Block>], ws: &[u8], what: &str) {
        let nb = xs[0].len();
        let rb = format.row_bytes(nb * QK).unwrap();
        let n = ws.len() / rb;
        let p = Packed::pack(format, ws, n, nb * QK);
        let xr: [&[Q8Block]; R] = std::array::from_fn(|r| xs[r].as_slice());
        type Kernel<'a, const R: usize> = Box<dyn Fn(PackedGroup<'_>) -> [[f32; PACK]; R] + 'a>;
        let mut kernels: Vec<(&str, Kernel<'_, R>)> =
            vec![("portable", Box::new(|g| Portable.packed_block(&xr, g)))];
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(k) = Avx2::detect() {
                kernels.push(("AVX2", Box::new(move |g| k.packed_block(&xr, g))));
            }
            if let Some(k) = Vnni::detect() {
                kernels.push(("VNNI", Box::new(move |g| k.packed_block(&xr, g))));
            }
        }
        let rows = p.as_rows();
        for g in 0..rows.groups() {
            for (name, kern) in &kernels {
                let got = kern(rows.group(g));
                for c in 0..PACK.min(n - g * PACK) {
                    let j = g * PACK + c;
                    let want = Portable.q8_block(format, &xr, &[&ws[j * rb..(j + 1) * rb]]);
                    for (r, (got, want)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            got[c].to_bits(),
                            want[0].to_bits(),
                            "{name} packed, {R} rows: {format} {what}, input row {r}, weight row {j}"
                        );
                    }
                }
            }
        }
    }

    fn check_packed_shapes(format: Format, xs: &[Vec<Q8Block>], ws: &[u8], what: &str) {
        check_packed::<1>(format, xs, ws, what);
        check_packed::<2>(format, xs, ws, what);
        check_packed::<3>(format, xs, ws, what);
        check_packed::<4>(format, xs, ws, what);
    }

    /// The repacked kernels on random, all-zero and extreme rows, 13 weight rows (a full
    /// group and a padded one): the portable kernel's bits on the rows as stored.
    #[test]
    fn every_packed_kernel_gives_the_portable_bits() {
        let mut rng = StdRng::seed_from_u64(53);
        let n = 13;
        for format in FORMATS {
            for &nb in block_counts(format) {
                let k = nb * QK;
                let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let ws = stored(&w, format, n, k);
                let xs: Vec<Vec<Q8Block>> = (0..4)
                    .map(|_| {
                        let x: Vec<f32> = (0..k).map(|_| rng.random_range(-3.0..3.0)).collect();
                        quantized(&x)
                    })
                    .collect();
                check_packed_shapes(format, &xs, &ws, &format!("random, nb {nb}"));
                let zero = vec![quantized(&vec![0.0; k]); 4];
                check_packed_shapes(format, &zero, &ws, &format!("zero x, nb {nb}"));
                let zw = stored(&vec![0.0; n * k], format, n, k);
                check_packed_shapes(format, &xs, &zw, &format!("zero w, nb {nb}"));
                let ext: Vec<Vec<Q8Block>> = (0..4)
                    .map(|r| {
                        let sign = |i: usize| {
                            if (i / QK + r).is_multiple_of(2) {
                                1e3
                            } else {
                                -1e3
                            }
                        };
                        quantized(&(0..k).map(sign).collect::<Vec<f32>>())
                    })
                    .collect();
                let ew = extreme_rows(format, n, nb, &mut rng);
                check_packed_shapes(format, &ext, &ew, &format!("extremes, nb {nb}"));
                let fine = vec![extreme_levels(k); 4];
                check_packed_shapes(format, &fine, &ew, &format!("fine extremes, nb {nb}"));
            }
        }
    }

    /// The integer blocks are the format's values: `dw · s · v + mw` (in f64) is what the
    /// dequantizer (checked bitwise against candle's) gives, value for value, on random
    /// blocks and on the extremes.
    #[test]
    fn integer_blocks_are_the_dequantized_values() {
        let mut rng = StdRng::seed_from_u64(61);
        for format in FORMATS {
            let nb = 3 * blocks_per_unit(format);
            let k = nb * QK;
            let w: Vec<f32> = (0..2 * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut rows = stored(&w, format, 2, k);
            rows.extend(extreme_rows(format, 2, nb, &mut rng));
            let mut deq = vec![0.0f32; rows.len() / format.block_bytes() * format.block_elems()];
            super::super::quant::dequantize_generic(format, &rows, &mut deq);
            let mut blocks = vec![IntBlock::ZERO; blocks_per_unit(format)];
            let per = format.block_elems();
            for (u, unit) in rows.chunks_exact(format.block_bytes()).enumerate() {
                int_blocks(format, unit, &mut blocks);
                for (b, blk) in blocks.iter().enumerate() {
                    for (i, &v) in blk.v.iter().enumerate() {
                        let s = blk.s[i / 16] as f64;
                        let scaled = blk.dw as f64 * s * v as f64;
                        let got = scaled + blk.mw as f64;
                        let want = deq[u * per + b * QK + i] as f64;
                        // The dequantizer rounds its product and its difference in f32.
                        let tol = 2.0 * f32::EPSILON as f64 * (scaled.abs() + blk.mw.abs() as f64);
                        assert!(
                            (got - want).abs() <= tol,
                            "{format} unit {u} block {b} value {i}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The portable kernel's integer part on the extremes equals a plain i64 sum (nothing
    /// saturates or wraps): Q8_0 bytes −128 against activations at the top level (32258),
    /// 32 per block.
    #[test]
    fn the_extreme_blocks_sum_exactly() {
        let nb = 2;
        let mut ws = vec![0u8; nb * 34];
        for blk in ws.chunks_exact_mut(34) {
            blk[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
            blk[2..].fill(0x80);
        }
        let x = quantized(&vec![5.0; nb * QK]);
        assert!(x.iter().all(|b| b.qs == [127; QK]));
        let [[got]] = Portable.q8_block(Format::Q8_0, &[&x], &[&ws]);
        let want = -128.0 * LEVELS as f64 * (nb * QK) as f64 * x[0].d as f64;
        assert!(
            (got as f64 - want).abs() < 1e-3 * want.abs(),
            "{got} vs {want}"
        );
    }

    /// The scheme as first written, one value at a time in integers: `quantize_row` must
    /// give its bytes.
    fn quantize_row_scalar(x: &[f32], out: &mut [Q8Block]) {
        for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let levels = LEVELS as f32;
            let d = amax / levels;
            let id = if amax != 0.0 { levels / amax } else { 0.0 };
            let mut sum = 0i32;
            for (i, &v) in xb.iter().enumerate() {
                let q = (v * id).round_ties_even().clamp(-levels, levels) as i32;
                let qs = (q + PLANE / 2).div_euclid(PLANE);
                o.qs[i] = qs as i8;
                o.ql[i] = (q - PLANE * qs) as i8;
                sum += q;
            }
            o.d = d;
            o.ds = d * sum as f32;
        }
    }

    /// Same bytes as the scalar definition: random blocks of many scales, zeros, values at
    /// every plane boundary (`q + 127` a multiple of 254, and one level either side), ties
    /// of the rounding, NaN, ±∞, subnormals and `f32::MAX`.
    #[test]
    fn the_vectorised_quantiser_gives_the_scalar_bytes() {
        let mut rng = StdRng::seed_from_u64(59);
        let mut x: Vec<f32> = Vec::new();
        for b in 0..400 {
            let scale = 10f32.powi(rng.random_range(-30..30));
            x.extend((0..QK).map(|_| scale * rng.random_range(-1.0..1.0f32)));
            let n = x.len();
            let blk = &mut x[n - QK..]; // the block just added
            match b % 8 {
                // Block max 32258 so that value = level: boundaries and ties exactly.
                1 | 2 => {
                    blk[0] = LEVELS as f32;
                    for (i, v) in blk.iter_mut().enumerate().skip(1) {
                        let m = rng.random_range(-127..=126) * PLANE - PLANE / 2;
                        let off = [-1.0, -0.5, 0.0, 0.5, 1.0][i % 5];
                        *v = (m as f32 + off).clamp(-LEVELS as f32, LEVELS as f32);
                    }
                }
                3 => {
                    let specials = [f32::NAN, 0.0, -0.0, f32::MIN_POSITIVE / 4.0];
                    for (i, v) in blk.iter_mut().enumerate().step_by(3) {
                        *v = specials[i % specials.len()];
                    }
                }
                4 => {
                    blk[QK - 5] = if b % 16 == 4 {
                        f32::INFINITY
                    } else {
                        f32::NEG_INFINITY
                    };
                }
                5 => {
                    blk[QK - 7] = f32::MAX;
                    blk[QK - 8] = -f32::MAX;
                }
                6 => blk.fill(0.0),
                _ => {}
            }
        }
        let blocks = x.len() / QK;
        let (mut fast, mut scalar) = (vec![Q8Block::ZERO; blocks], vec![Q8Block::ZERO; blocks]);
        quantize_row(&x, &mut fast);
        quantize_row_scalar(&x, &mut scalar);
        for (b, (f, s)) in fast.iter().zip(&scalar).enumerate() {
            assert_eq!(
                (f.qs, f.ql),
                (s.qs, s.ql),
                "block {b}: {:?}",
                &x[b * QK..][..QK]
            );
            assert_eq!(
                (f.d.to_bits(), f.ds.to_bits()),
                (s.d.to_bits(), s.ds.to_bits()),
                "block {b}"
            );
        }
    }

    /// Quantisation: exact zeros, the maximum maps to the top level (coarse plane ±127),
    /// finite huge and tiny scales, both planes in range, and the round trip within half a
    /// step.
    #[test]
    fn activations_quantise_within_half_a_step() {
        let mut rng = StdRng::seed_from_u64(43);
        let mut x: Vec<f32> = (0..4 * QK).map(|_| rng.random_range(-2.0..2.0)).collect();
        x[..QK].fill(0.0); // an all-zero block
        x[QK] = f32::MAX / 2.0; // a huge block: its scale is finite
        for v in &mut x[2 * QK..3 * QK] {
            *v *= 1e-30; // a tiny one
        }
        let q = quantized(&x);
        assert_eq!(q[0], Q8Block::ZERO);
        for (b, blk) in q.iter().enumerate() {
            assert!(blk.d.is_finite() && blk.ds.is_finite(), "block {b}");
            let xb = &x[b * QK..(b + 1) * QK];
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if amax > 0.0 {
                assert!((0..QK).any(|i| blk.level(i).abs() == LEVELS), "block {b}");
                assert!(blk.qs.iter().any(|&v| v.abs() == 127), "block {b}");
            }
            assert!(
                blk.qs.iter().chain(&blk.ql).all(|&v| v != i8::MIN),
                "block {b}"
            );
            for (i, v) in xb.iter().enumerate() {
                let q = blk.level(i);
                let err = (*v as f64 - q as f64 * blk.d as f64).abs();
                assert!(err <= 0.5001 * blk.d as f64, "block {b}: {v} vs {q}");
            }
            let sum: i32 = (0..QK).map(|i| blk.level(i)).sum();
            assert_eq!(blk.ds, blk.d * sum as f32, "block {b}");
        }
    }

    /// Against the f32 reference (the dequantised weights dotted with the unquantised
    /// activations, in f64): the error is what quantised activations cost, bounded by
    /// `Σ_blocks (d_x / 2) · Σ|w|` (half a step per value) plus the float part's roundings,
    /// and in practice far below it. Stated tolerance: within that bound, and a relative
    /// error under 1e-4 of `Σ|x·w|` (one 8-bit plane needed 2%).
    #[test]
    fn integer_dots_are_within_the_activation_rounding_of_the_f32_dot() {
        let mut rng = StdRng::seed_from_u64(47);
        for format in FORMATS {
            let (n, k) = (16, 768);
            let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let ws = stored(&w, format, n, k);
            let rb = format.row_bytes(k).unwrap();
            let mut deq = vec![0.0f32; k];
            let x: Vec<f32> = (0..k).map(|_| rng.random_range(-2.0..2.0)).collect();
            let xq = quantized(&x);
            for c in 0..n {
                let row = &ws[c * rb..(c + 1) * rb];
                super::super::quant::dequantize_generic(format, row, &mut deq);
                let exact: f64 = x.iter().zip(&deq).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = x
                    .iter()
                    .zip(&deq)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                let bound: f64 = xq
                    .iter()
                    .enumerate()
                    .map(|(b, blk)| {
                        let wsum: f64 = deq[b * QK..(b + 1) * QK]
                            .iter()
                            .map(|v| v.abs() as f64)
                            .sum();
                        0.5 * blk.d as f64 * wsum
                    })
                    .sum();
                let [[got]] = Portable.q8_block(format, &[&xq], &[row]);
                let err = (got as f64 - exact).abs();
                assert!(
                    err <= bound * 1.001 + 1e-5,
                    "{format} row {c}: {err} > {bound}"
                );
                assert!(err <= 1e-4 * mag, "{format} row {c}: {err} vs |x·w| {mag}");
            }
        }
    }
}
