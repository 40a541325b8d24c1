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
//!
//! The second operand may be any `KvElem` (attention scores over a 16-bit KV cache): each
//! element is widened to f32 in registers, exactly, so a dot over 16-bit keys is bitwise
//! the dot over the same keys widened to f32. `axpy` (attention's `P·V`) reads values the
//! same way.
//!
//! Attention's softmax step has its order here too (`max_of`, `sum_of`, `exp_nonpos`),
//! which each kernel's `row_max` and `exp_sum` reproduce bitwise, however wide.

use super::ops::exp_nonpos;
use std::ops::Range;

use crate::device::kv_elem::{KvDtype, KvElem};

/// Lanes of every fixed-order dot.
pub const LANES: usize = 16;

/// K or V rows seen through one window of columns: row `j` is `rows[j][start..start +
/// width]`. Attention hands the kernels a tile's whole rows (every KV head of its task)
/// and each head's window of them, so it builds no list of per-head slices per tile; the
/// window is checked once, when made, so the kernels read `width` elements from `ptr(j)`.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'r, 'a, W> {
    rows: &'r [&'a [W]],
    start: usize,
    width: usize,
}

impl<'r, 'a, W> Rows<'r, 'a, W> {
    /// Columns `cols` of every row; panics if a row ends before `cols.end`.
    pub fn new(rows: &'r [&'a [W]], cols: Range<usize>) -> Self {
        assert!(
            cols.start <= cols.end && rows.iter().all(|r| r.len() >= cols.end),
            "Rows: a row shorter than its window {cols:?}"
        );
        Self {
            rows,
            start: cols.start,
            width: cols.len(),
        }
    }

    /// Whole rows, all of one length (panics otherwise).
    pub fn whole(rows: &'r [&'a [W]]) -> Self {
        let width = rows.first().map_or(0, |r| r.len());
        assert!(
            rows.iter().all(|r| r.len() == width),
            "Rows::whole: rows of different lengths"
        );
        // Every row is `width` long: `new`'s check holds already.
        Self {
            rows,
            start: 0,
            width,
        }
    }

    /// Columns `cols` of this window, counted from its start.
    pub fn columns(self, cols: Range<usize>) -> Self {
        assert!(
            cols.start <= cols.end && cols.end <= self.width,
            "Rows: columns {cols:?} outside a window of {}",
            self.width
        );
        Self {
            start: self.start + cols.start,
            width: cols.len(),
            ..self
        }
    }

    /// Rows `range` of this window.
    pub fn range(self, range: Range<usize>) -> Self {
        Self {
            rows: &self.rows[range],
            ..self
        }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Elements of each row's window.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The width, if there is a row (the shape kernels take from their first row).
    fn first_width(&self) -> Option<usize> {
        (!self.is_empty()).then_some(self.width)
    }

    /// Row `j`'s window.
    pub fn row(&self, j: usize) -> &'a [W] {
        &self.rows[j][self.start..self.start + self.width]
    }

    /// The first element of row `j`'s window: `width` elements from it are inside the row
    /// (checked by `new`).
    fn ptr(&self, j: usize) -> *const W {
        self.rows[j][self.start..].as_ptr()
    }

    pub fn iter(&self) -> impl Iterator<Item = &'a [W]> + '_ {
        (0..self.len()).map(|j| self.row(j))
    }
}

/// `R × C` dot products `xs[r] · ws[c]` of slices of one length, and `axpy`.
pub trait DotKernel: Copy + Send + Sync {
    fn block<W: KvElem, const R: usize, const C: usize>(
        self,
        xs: &[&[f32]; R],
        ws: &[&[W]; C],
    ) -> [[f32; C]; R];
    /// `acc += Σ_j ps[j] · vs[j]`: for every element `i`, `acc[i] = fma(ps[j], vs[j][i],
    /// acc[i])` for `j` in increasing order (attention's `P·V` over one tile of keys).
    /// Each element is its own chain of correctly rounded operations, so every kernel
    /// gives the portable bits whatever its width; the SIMD ones keep `acc` in registers
    /// across the keys.
    fn accumulate<W: KvElem>(self, ps: &[f32], vs: Rows<'_, '_, W>, acc: &mut [f32]);

    /// Attention's score tile: `out[r * stride + c] = dot(q row r, ws[c])`, the fixed-order
    /// dot of `block`, for the `q.len() / k` query rows of `q[rows, k]` (`k` = the keys'
    /// length) and every key. Kernels may block it as they like; the bits are `block`'s.
    /// `ahead`: rows the caller reads next, which a kernel may prefetch as it goes (a hint).
    #[inline(always)]
    fn scores<W: KvElem>(
        self,
        q: &[f32],
        ws: Rows<'_, '_, W>,
        out: &mut [f32],
        stride: usize,
        ahead: &[&[W]],
    ) {
        scores_by_blocks(self, q, ws, out, stride, ahead);
    }

    /// The largest of a row of scores (−∞ for an empty row). A maximum is exact, so every
    /// kernel gives the portable value whatever its order.
    #[inline(always)]
    fn row_max(self, row: &[f32]) -> f32 {
        max_of(row)
    }

    /// Attention's softmax numerators: `row[i] = exp_nonpos(row[i] - m)` for every element,
    /// returning their sum in `sum_of`'s order. Each element is the portable scalar
    /// function's chain of operations and the sum the portable order, so every kernel
    /// gives the portable bits whatever its width.
    #[inline(always)]
    fn exp_sum(self, row: &mut [f32], m: f32) -> f32 {
        // Separate map and sum loops: each vectorizes, a fused one would not.
        for x in row.iter_mut() {
            *x = exp_nonpos(*x - m);
        }
        sum_of(row)
    }

    /// `accumulate` for several rows over the same values: row `r` of `acc[rows, hd]` (`hd`
    /// = the values' length) takes the weights `ps[r * p_stride..][..vs.len()]`. Each row
    /// gets `accumulate`'s bits; kernels may share the value loads between rows. `ahead`:
    /// as for `scores`.
    #[inline(always)]
    fn accumulate_rows<W: KvElem>(
        self,
        ps: &[f32],
        p_stride: usize,
        vs: Rows<'_, '_, W>,
        acc: &mut [f32],
        ahead: &[&[W]],
    ) {
        let Some(hd) = vs.first_width() else {
            return;
        };
        let kn = vs.len();
        for (r, acc) in acc.chunks_exact_mut(hd).enumerate() {
            let ps = &ps[r * p_stride..][..kn];
            if r > 0 || ahead.is_empty() {
                self.accumulate(ps, vs, acc);
                continue;
            }
            // The first row's pass asks for `ahead` as it goes, a few keys at a time:
            // `accumulate` over consecutive keys chains the same multiply-adds per element
            // as over all of them at once, so the bits are the same.
            let mut pacer = Pacer::new(ahead, kn);
            for j in (0..kn).step_by(PACED_KEYS) {
                let n = PACED_KEYS.min(kn - j);
                pacer.keys(n);
                self.accumulate(&ps[j..j + n], vs.range(j..j + n), acc);
            }
        }
    }
}

/// Largest element (−∞ for an empty slice), in 8 lanes so it vectorizes.
#[inline]
fn max_of(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] = acc[i].max(c[i]);
        }
    }
    rest.iter()
        .chain(&acc)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Sum in 8 lanes so it vectorizes: the order of attention's softmax sums, which every
/// kernel's `exp_sum` reproduces.
#[inline]
fn sum_of(x: &[f32]) -> f32 {
    sum_continued([0.0; 8], x)
}

/// `sum_of` of elements that follow a multiple of 8 others whose lane sums are `acc`.
#[inline(always)]
fn sum_continued(mut acc: [f32; 8], x: &[f32]) -> f32 {
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + rest.iter().sum::<f32>()
}

/// Query rows × keys per `block` of the default `scores` (the AVX2 kernel's register
/// blocking).
const SMR: usize = 2;
const SNR: usize = 3;

/// `DotKernel::scores` by `SMR × SNR` blocks (then single rows and keys).
/// The first pass over the keys asks for `ahead` as it goes (`Pacer`).
#[inline(always)]
fn scores_by_blocks<K: DotKernel, W: KvElem>(
    kern: K,
    q: &[f32],
    keys: Rows<'_, '_, W>,
    out: &mut [f32],
    stride: usize,
    ahead: &[&[W]],
) {
    let Some(hd) = keys.first_width() else {
        return;
    };
    let (rows, kn) = (q.len() / hd, keys.len());
    let qrow = |r: usize| &q[r * hd..(r + 1) * hd];
    let mut pacer = Pacer::new(ahead, kn);
    let mut r = 0;
    while r < rows {
        let mut j = 0;
        if r + SMR <= rows {
            let xs: [&[f32]; SMR] = std::array::from_fn(|i| qrow(r + i));
            while j + SNR <= kn {
                pacer.keys(SNR);
                let ws: [&[W]; SNR] = std::array::from_fn(|c| keys.row(j + c));
                let b = kern.block(&xs, &ws);
                for (i, row) in b.iter().enumerate() {
                    out[(r + i) * stride + j..][..SNR].copy_from_slice(row);
                }
                j += SNR;
            }
            while j < kn {
                pacer.keys(1);
                let b = kern.block(&xs, &[keys.row(j)]);
                for (i, row) in b.iter().enumerate() {
                    out[(r + i) * stride + j] = row[0];
                }
                j += 1;
            }
            r += SMR;
        } else {
            for (jj, key) in keys.iter().enumerate() {
                pacer.keys(1);
                out[r * stride + jj] = kern.block(&[qrow(r)], &[key])[0][0];
            }
            r += 1;
        }
    }
}

/// Keys per step of the paced first row in `DotKernel::accumulate_rows`' default: each
/// step reloads and stores the row's accumulators, so not every key (the AVX2 kernel, a
/// 4K f16 layer, one thread, a throwaway loop on an AMD EPYC: 8 keys 440 µs hot / 476
/// from memory, 16 keys 433 / 466).
const PACED_KEYS: usize = 16;

/// `R × C` fixed-order dots with the best kernel the build targets (AVX2 on x86-64-v3).
#[inline(always)]
pub fn dot_block<W: KvElem, const R: usize, const C: usize>(
    xs: &[&[f32]; R],
    ws: &[&[W]; C],
) -> [[f32; C]; R] {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    ))]
    {
        Avx2.block(xs, ws)
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
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

fn check_lengths<W, const R: usize, const C: usize>(xs: &[&[f32]; R], ws: &[&[W]; C]) -> usize {
    let k = if R > 0 { xs[0].len() } else { 0 };
    assert!(
        xs.iter().all(|s| s.len() == k) && ws.iter().all(|s| s.len() == k),
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
fn finish<W: KvElem, const R: usize, const C: usize>(
    xs: &[&[f32]; R],
    ws: &[&[W]; C],
    acc: &[[[f32; LANES]; C]; R],
    body: usize,
) -> [[f32; C]; R] {
    std::array::from_fn(|r| {
        std::array::from_fn(|c| {
            let mut s = sum_lanes(&acc[r][c]);
            for q in body..xs[r].len() {
                s = xs[r][q].mul_add(ws[c][q].to_f32(), s);
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
    fn block<W: KvElem, const R: usize, const C: usize>(
        self,
        xs: &[&[f32]; R],
        ws: &[&[W]; C],
    ) -> [[f32; C]; R] {
        let k = check_lengths(xs, ws);
        let body = k - k % LANES;
        let mut acc = [[[0.0f32; LANES]; C]; R];
        for p in (0..body).step_by(LANES) {
            for c in 0..C {
                for r in 0..R {
                    for l in 0..LANES {
                        acc[r][c][l] = xs[r][p + l].mul_add(ws[c][p + l].to_f32(), acc[r][c][l]);
                    }
                }
            }
        }
        finish(xs, ws, &acc, body)
    }

    #[inline(always)]
    fn accumulate<W: KvElem>(self, ps: &[f32], vs: Rows<'_, '_, W>, acc: &mut [f32]) {
        accumulate_from(0, ps, vs, acc);
    }
}

/// Checks `accumulate`'s shapes: a weight per row, every row as long as `acc`.
fn check_rows<W>(ps: &[f32], vs: Rows<'_, '_, W>, acc: &[f32]) {
    assert!(
        ps.len() == vs.len() && vs.width() == acc.len(),
        "accumulate: {} weights, rows of other lengths than {}",
        ps.len(),
        acc.len()
    );
}

/// The portable `accumulate` over elements `from..` (every kernel's tail).
#[inline(always)]
fn accumulate_from<W: KvElem>(from: usize, ps: &[f32], vs: Rows<'_, '_, W>, acc: &mut [f32]) {
    check_rows(ps, vs, acc);
    for (p, v) in ps.iter().zip(vs.iter()) {
        for (a, x) in acc[from..].iter_mut().zip(&v[from..]) {
            *a = p.mul_add(x.to_f32(), *a);
        }
    }
}

/// AVX2 + FMA + F16C, enabled at compile time (the x86-64-v3 build): lanes 0–7 and 8–15
/// of a dot in two registers (`linear` uses 2 × 3 blocks: 12 accumulators, 4 inputs, of 16).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
#[derive(Clone, Copy, Debug)]
pub struct Avx2;

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
impl DotKernel for Avx2 {
    #[inline(always)]
    fn block<W: KvElem, const R: usize, const C: usize>(
        self,
        xs: &[&[f32]; R],
        ws: &[&[W]; C],
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
                    let wv = [load8(b), load8(b.add(8))];
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

    #[inline(always)]
    fn accumulate<W: KvElem>(self, ps: &[f32], vs: Rows<'_, '_, W>, acc: &mut [f32]) {
        use std::arch::x86_64::*;
        check_rows(ps, vs, acc);
        // 4 registers (32 elements) of `acc` at a time, then single registers.
        let mut i = 0;
        // SAFETY: the build enables AVX2, FMA and F16C (cfg above); every access is 8
        // elements ending at or before `acc.len()`, inside `acc` and each row (checked).
        unsafe {
            while i + 32 <= acc.len() {
                let a = acc.as_mut_ptr().add(i);
                let mut r: [__m256; 4] = std::array::from_fn(|c| _mm256_loadu_ps(a.add(8 * c)));
                for (p, v) in ps.iter().zip(vs.iter()) {
                    let (pv, x) = (_mm256_set1_ps(*p), v.as_ptr().add(i));
                    for (c, r) in r.iter_mut().enumerate() {
                        *r = _mm256_fmadd_ps(pv, load8(x.add(8 * c)), *r);
                    }
                }
                for (c, r) in r.iter().enumerate() {
                    _mm256_storeu_ps(a.add(8 * c), *r);
                }
                i += 32;
            }
            while i + 8 <= acc.len() {
                let a = acc.as_mut_ptr().add(i);
                let mut r = _mm256_loadu_ps(a);
                for (p, v) in ps.iter().zip(vs.iter()) {
                    r = _mm256_fmadd_ps(_mm256_set1_ps(*p), load8(v.as_ptr().add(i)), r);
                }
                _mm256_storeu_ps(a, r);
                i += 8;
            }
        }
        accumulate_from(i, ps, vs, acc);
    }
}

/// 8 elements at `p` widened to f32: a load, or 8 halves converted (F16C), or 8 bf16
/// shifted into the high half of each lane (exact: a bf16 is an f32's upper 16 bits).
///
/// # Safety
/// 8 elements at `p` are readable; the CPU has AVX2 and F16C.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
#[inline(always)]
unsafe fn load8<W: KvElem>(p: *const W) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    match W::DTYPE {
        KvDtype::F32 => _mm256_loadu_ps(p as *const f32),
        KvDtype::Bf16 => {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
        KvDtype::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
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
    fn block<W: KvElem, const R: usize, const C: usize>(
        self,
        xs: &[&[f32]; R],
        ws: &[&[W]; C],
    ) -> [[f32; C]; R] {
        // SAFETY: an `Avx512` exists only once AVX-512F was detected.
        unsafe { avx512_block(xs, ws) }
    }

    #[inline(always)]
    fn accumulate<W: KvElem>(self, ps: &[f32], vs: Rows<'_, '_, W>, acc: &mut [f32]) {
        // SAFETY: as above.
        unsafe { avx512_accumulate(ps, vs, acc) }
    }

    #[inline(always)]
    fn scores<W: KvElem>(
        self,
        q: &[f32],
        ws: Rows<'_, '_, W>,
        out: &mut [f32],
        stride: usize,
        ahead: &[&[W]],
    ) {
        match ws.first_width() {
            Some(k) if k > 0 && k % LANES == 0 => {
                // SAFETY: as above.
                unsafe { avx512_scores(q, ws, out, stride, ahead) }
            }
            _ => scores_by_blocks(self, q, ws, out, stride, ahead),
        }
    }

    #[inline(always)]
    fn accumulate_rows<W: KvElem>(
        self,
        ps: &[f32],
        p_stride: usize,
        vs: Rows<'_, '_, W>,
        acc: &mut [f32],
        ahead: &[&[W]],
    ) {
        // SAFETY: as above.
        unsafe { avx512_accumulate_rows(ps, p_stride, vs, acc, ahead) }
    }

    #[inline(always)]
    fn row_max(self, row: &[f32]) -> f32 {
        // SAFETY: as above.
        unsafe { avx512_row_max(row) }
    }

    #[inline(always)]
    fn exp_sum(self, row: &mut [f32], m: f32) -> f32 {
        // SAFETY: as above.
        unsafe { avx512_exp_sum(row, m) }
    }
}

/// `Avx512::row_max`: 16 lanes, two registers (independent chains), then the lanes and
/// the tail; NaNs skipped, as `max_of` skips them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_row_max(row: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(f32::NEG_INFINITY); 2];
    let mut chunks = row.chunks_exact(2 * LANES);
    for c in &mut chunks {
        for (h, a) in acc.iter_mut().enumerate() {
            // SAFETY: 16 floats of the 32-float chunk from 16h.
            let x = unsafe { _mm512_loadu_ps(c.as_ptr().add(h * LANES)) };
            // `vmaxps` returns its second operand where either is a NaN: the running
            // maximum, so a NaN is skipped, as `f32::max` skips it.
            *a = _mm512_max_ps(x, *a);
        }
    }
    let lanes = _mm512_reduce_max_ps(_mm512_max_ps(acc[0], acc[1]));
    max_of(chunks.remainder()).max(lanes)
}

/// `exp_fast` on 16 lanes: the scalar function's operations in its order, one IEEE
/// operation per scalar one (it has no fused multiply-adds), so each lane is bitwise
/// `exp_nonpos` of its input. The clamp takes the bounds as first operands so that a NaN
/// stays a NaN, as `f32::clamp` leaves it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use super::ops::exp_consts::*;
    use std::arch::x86_64::*;
    let c = |v: f32| _mm512_set1_ps(v);
    let x = _mm512_min_ps(c(HI), _mm512_max_ps(c(LO), x));
    let t = _mm512_add_ps(_mm512_mul_ps(x, c(LOG2E)), c(MAGIC));
    let n = _mm512_sub_ps(t, c(MAGIC));
    let n_int = _mm512_sub_epi32(
        _mm512_castps_si512(t),
        _mm512_set1_epi32(MAGIC.to_bits() as i32),
    );
    let r = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(n, c(LN2_HI))),
        _mm512_mul_ps(n, c(LN2_LO)),
    );
    let mut p = c(POLY[0]);
    for &k in &POLY[1..] {
        p = _mm512_add_ps(c(k), _mm512_mul_ps(r, p));
    }
    let scale = _mm512_slli_epi32::<23>(_mm512_add_epi32(n_int, _mm512_set1_epi32(127)));
    _mm512_mul_ps(p, _mm512_castsi512_ps(scale))
}

/// `Avx512::exp_sum`: 16 elements a step, each step's two halves added to `sum_of`'s 8
/// lane sums in turn (its order: lane `l` takes elements `l`, `l + 8`, `l + 16`, …); the
/// last elements as the portable code does them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_exp_sum(row: &mut [f32], m: f32) -> f32 {
    use std::arch::x86_64::*;
    let mv = _mm512_set1_ps(m);
    let mut acc8 = _mm256_setzero_ps();
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        // SAFETY: 16 floats in the chunk, read and written in place.
        let e = unsafe { exp16(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), mv)) };
        unsafe { _mm512_storeu_ps(c.as_mut_ptr(), e) };
        acc8 = _mm256_add_ps(acc8, _mm512_castps512_ps256(e));
        // The upper half (`_mm512_extractf32x8_ps` needs AVX-512DQ, and a call to it
        // would not be inlined here).
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e)));
        acc8 = _mm256_add_ps(acc8, hi);
    }
    let mut acc = [0.0f32; 8];
    // SAFETY: 8 floats into an 8-float array.
    unsafe { _mm256_storeu_ps(acc.as_mut_ptr(), acc8) };
    let tail = chunks.into_remainder();
    for x in tail.iter_mut() {
        *x = exp_nonpos(*x - m);
    }
    sum_continued(acc, tail)
}

/// Keys per step of `avx512_scores`: one `reduce8` of their accumulators.
const S512_KEYS: usize = 8;

/// `Avx512::scores` for keys of a length `k`, a multiple of 16. 64- and 128-wide heads
/// (SmolLM2's; Llama's and Qwen's) keep the queries in registers
/// (`avx512_score_rows_qreg`); other sizes go by `avx512_score_rows`: query rows in threes
/// (a GQA group of 3 shares each key load; then the last one or two), keys in eights, up
/// to 24 accumulators, each eight's lane sums by `reduce8`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_scores<W: KvElem>(
    q: &[f32],
    keys: Rows<'_, '_, W>,
    out: &mut [f32],
    stride: usize,
    ahead: &[&[W]],
) {
    let k = keys.width();
    let (rows, kn) = (q.len() / k, keys.len());
    assert!(
        rows * k == q.len()
            && keys.width() == k
            && kn <= stride
            && (rows == 0 || (rows - 1) * stride + kn <= out.len()),
        "scores: shapes"
    );
    // SAFETY: checked above; the head size matches the S (16-element segments) given.
    unsafe {
        match k {
            64 => avx512_score_all_rows_qreg::<W, 4, 3>(q, keys, out, stride, ahead),
            128 => avx512_score_all_rows_qreg::<W, 8, 2>(q, keys, out, stride, ahead),
            _ => avx512_score_all_rows(q, keys, out, stride, ahead),
        }
    }
}

/// `avx512_scores` (which checked the shapes) for any head size.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_score_all_rows<W: KvElem>(
    q: &[f32],
    keys: Rows<'_, '_, W>,
    out: &mut [f32],
    stride: usize,
    ahead: &[&[W]],
) {
    let rows = q.len() / keys.width();
    let mut r = 0;
    let mut ahead = ahead; // prefetched during the first rows' pass
    while r + 3 <= rows {
        // SAFETY: rows r..r + 3 are inside `q` and `out` (checked).
        unsafe { avx512_score_rows::<W, 3>(q, r, keys, out, stride, ahead) };
        ahead = &[];
        r += 3;
    }
    // SAFETY: as above, for the last one or two rows.
    match rows - r {
        2 => unsafe { avx512_score_rows::<W, 2>(q, r, keys, out, stride, ahead) },
        1 => unsafe { avx512_score_rows::<W, 1>(q, r, keys, out, stride, ahead) },
        _ => {}
    }
}

/// `avx512_scores` (which checked the shapes) for heads of `S` × 16 elements whose queries
/// fit in registers: rows in blocks of `RB` (then the rest, one block size at a time) by
/// `avx512_score_rows_qreg`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_score_all_rows_qreg<W: KvElem, const S: usize, const RB: usize>(
    q: &[f32],
    keys: Rows<'_, '_, W>,
    out: &mut [f32],
    stride: usize,
    ahead: &[&[W]],
) {
    // The dispatch below has kernels for blocks of 1 to 3 rows.
    const {
        assert!(
            RB >= 1 && RB <= 3,
            "avx512_score_all_rows_qreg: RB is 1, 2 or 3"
        )
    };
    let rows = q.len() / (S * LANES);
    let mut r = 0;
    let mut ahead = ahead; // prefetched during the first rows' pass
    while r < rows {
        let n = RB.min(rows - r);
        // SAFETY: rows r..r + n are inside `q` and `out` (checked).
        unsafe {
            match n {
                3 => avx512_score_rows_qreg::<W, 3, S>(q, r, keys, out, stride, ahead),
                2 => avx512_score_rows_qreg::<W, 2, S>(q, r, keys, out, stride, ahead),
                _ => avx512_score_rows_qreg::<W, 1, S>(q, r, keys, out, stride, ahead),
            }
        }
        ahead = &[];
        r += n;
    }
}

/// Keys per step of `avx512_score_rows_qreg`: one `reduce4` per row.
const QREG_KEYS: usize = 4;

/// Scores of query rows `r0..r0 + R` over keys of `S` × 16 elements, the rows' queries
/// held in registers (`R · S` of them) for every key: keys go in fours (4 × `R`
/// accumulators, each a dot's 16 lanes), each four's lane sums by `reduce4`. With
/// `R · S + 4 · R + 1 ≤ 32` (64-wide heads in threes of rows, 128-wide in twos) nothing
/// spills. The general `avx512_score_rows` holds 24 accumulators and reloads the queries
/// for every key; on 64-wide heads it spilled and took ~4 ns a (query, key) pair in a hot
/// microbenchmark, against ~2.4 here and ~1.7 for `P·V`'s as many fused multiply-adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)] // as in avx512_score_rows
unsafe fn avx512_score_rows_qreg<W: KvElem, const R: usize, const S: usize>(
    q: &[f32],
    r0: usize,
    keys: Rows<'_, '_, W>,
    out: &mut [f32],
    stride: usize,
    ahead: &[&[W]],
) {
    use std::arch::x86_64::*;
    let hd = S * LANES;
    let mut qv = [[_mm512_setzero_ps(); S]; R];
    for r in 0..R {
        for s in 0..S {
            // SAFETY: row r0 + r is inside `q` (checked by the caller), `hd` floats.
            qv[r][s] = unsafe { _mm512_loadu_ps(q.as_ptr().add((r0 + r) * hd + s * LANES)) };
        }
    }
    let kn = keys.len();
    let mut ahead = Pacer::new(ahead, kn);
    let mut j = 0;
    while j < kn {
        let n = QREG_KEYS.min(kn - j);
        let kp: [*const W; QREG_KEYS] = score_step(keys, j, n, &mut ahead);
        let mut acc = [[_mm512_setzero_ps(); QREG_KEYS]; R];
        // Each accumulator's operations in the dot's order: lanes 0-15, 16-31, ...
        for c in 0..QREG_KEYS {
            for s in 0..S {
                // SAFETY: 16 elements of an `hd`-element key from 16s.
                let wv = unsafe { load16(kp[c].add(s * LANES)) };
                for r in 0..R {
                    acc[r][c] = _mm512_fmadd_ps(qv[r][s], wv, acc[r][c]);
                }
            }
        }
        for r in 0..R {
            // SAFETY: this function's features include reduce4's.
            let sums = unsafe { reduce4(&acc[r]) };
            let dst = &mut out[(r0 + r) * stride + j..][..n];
            if n == QREG_KEYS {
                // SAFETY: 4 floats into a 4-float slice.
                unsafe { _mm_storeu_ps(dst.as_mut_ptr(), sums) };
            } else {
                let mut s = [0.0f32; QREG_KEYS];
                // SAFETY: 4 floats into a 4-float array.
                unsafe { _mm_storeu_ps(s.as_mut_ptr(), sums) };
                dst.copy_from_slice(&s[..n]);
            }
        }
        j += n;
    }
}

/// `reduce8` for 4 dots: lane `c` of the result is `sum_lanes(a[c])`, bit for bit.
///
/// # Safety
/// As `reduce8`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce4(a: &[std::arch::x86_64::__m512; 4]) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    // t0 = [h0 | h1], t1 = [h2 | h3]: h_c = lanes 0-7 + lanes 8-15 of a[c] (as reduce8).
    let t0 = add_shuffled_f32x4::<0x44, 0xEE>(a[0], a[1]);
    let t1 = add_shuffled_f32x4::<0x44, 0xEE>(a[2], a[3]);
    // Quarter c: g_c = h_c lanes 0-3 + lanes 4-7.
    let w = add_shuffled_f32x4::<0x88, 0xDD>(t0, t1);
    // Per quarter: [g.0 + g.2, g.1 + g.3, ..] (the other two lanes the same sums swapped).
    let z = _mm512_add_ps(w, _mm512_permute_ps::<0x4E>(w));
    // Per quarter, lane 0: (g.0 + g.2) + (g.1 + g.3) = sum_lanes.
    let f = _mm512_add_ps(z, _mm512_permute_ps::<0xB1>(z));
    let order = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps128(_mm512_permutexvar_ps(order, f))
}

/// Scores of query rows `r0..r0 + R` (see `avx512_scores`, which checked the shapes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
// Indexed loops over register arrays: iterator adaptors take closures, which would not
// inherit the target feature.
#[allow(clippy::needless_range_loop)]
unsafe fn avx512_score_rows<W: KvElem, const R: usize>(
    q: &[f32],
    r0: usize,
    keys: Rows<'_, '_, W>,
    out: &mut [f32],
    stride: usize,
    ahead: &[&[W]],
) {
    use std::arch::x86_64::*;
    let (k, kn) = (keys.width(), keys.len());
    let mut ahead = Pacer::new(ahead, kn);
    let mut j = 0;
    while j < kn {
        let n = S512_KEYS.min(kn - j);
        let kp: [*const W; S512_KEYS] = score_step(keys, j, n, &mut ahead);
        let mut acc = [[_mm512_setzero_ps(); S512_KEYS]; R];
        // Key by key (each read start to end), 16 lanes at a time: the order of every
        // accumulator's operations is the dot's.
        for c in 0..S512_KEYS {
            let mut p = 0;
            while p < k {
                // SAFETY: 16 elements of a key from p + 16 <= k.
                let wv = unsafe { load16(kp[c].add(p)) };
                for r in 0..R {
                    // SAFETY: 16 floats of row r0 + r from p + 16 <= k: inside `q`.
                    let xv = unsafe { _mm512_loadu_ps(q.as_ptr().add((r0 + r) * k + p)) };
                    acc[r][c] = _mm512_fmadd_ps(xv, wv, acc[r][c]);
                }
                p += LANES;
            }
        }
        for r in 0..R {
            // SAFETY: this function's features include reduce8's.
            let sums = unsafe { reduce8(&acc[r]) };
            let mut s = [0.0f32; S512_KEYS];
            // SAFETY: 8 floats into an 8-float array.
            unsafe { _mm256_storeu_ps(s.as_mut_ptr(), sums) };
            out[(r0 + r) * stride + j..][..n].copy_from_slice(&s[..n]);
        }
        j += n;
    }
}

/// The start of a score kernel's step over keys `j..j + n` (`0 < n ≤ N`): asks for the
/// step's share of the rows ahead (`Pacer`) and returns the step's key pointers, a short
/// last step repeating its last key (the kernel stores only the first `n` scores).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn score_step<W, const N: usize>(
    keys: Rows<'_, '_, W>,
    j: usize,
    n: usize,
    ahead: &mut Pacer<'_, '_, W>,
) -> [*const W; N] {
    ahead.keys(n);
    std::array::from_fn(|c| keys.ptr(j + c.min(n - 1)))
}

/// Asks for `rows` (which the caller reads next) as a kernel walks its `kn` keys: spread
/// evenly over the keys, all asked for by the last, so the misses go out at a steady rate
/// while the kernel computes, not in a burst that stalls it. A running remainder, not a
/// division per step.
struct Pacer<'r, 'a, W> {
    rows: &'r [&'a [W]],
    asked: usize,
    owed: usize, // keys walked × rows, less kn per row asked for
    kn: usize,
}

impl<'r, 'a, W> Pacer<'r, 'a, W> {
    fn new(rows: &'r [&'a [W]], kn: usize) -> Self {
        Self {
            rows,
            asked: 0,
            owed: 0,
            kn,
        }
    }

    /// The next `n` keys are walked: ask for their share.
    #[inline(always)]
    fn keys(&mut self, n: usize) {
        for row in self.due(n) {
            prefetch_row(row);
        }
    }

    /// The rows due once the next `n` keys are walked: `⌊walked · rows / kn⌋` in all, so
    /// every row by the last key and at most `⌈n · rows / kn⌉` in one step.
    #[inline(always)]
    fn due(&mut self, n: usize) -> &'r [&'a [W]] {
        let first = self.asked;
        if first < self.rows.len() {
            self.owed += n * self.rows.len();
            while self.owed >= self.kn && self.asked < self.rows.len() {
                self.owed -= self.kn;
                self.asked += 1;
            }
        }
        &self.rows[first..self.asked]
    }
}

/// Asks for every cache line of `row` (K or V rows read next) to be brought into cache:
/// into L2, not L1 (`T1`). A miss that targets L1 holds one of L1's few miss buffers for
/// its whole trip from memory; with `T0` a chunk's prefetches queued behind them and
/// 4K decode attention over a cold cache took 300 µs a layer, with `T1` (or `T2`) 220–235
/// (`cargo bench --bench attention`, the hints alternated in one process). The next
/// chunk's lines then come from L2 in a dozen cycles. (Since the requests are paced,
/// `Pacer`, the three hints measure alike: docs/cpu.md.) Other targets ask for nothing.
#[inline(always)]
fn prefetch_row<W>(row: &[W]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let (p, bytes) = (row.as_ptr() as *const i8, std::mem::size_of_val(row));
        for at in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults; `at` is inside the row.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.add(at)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// The fixed lane tree of `sum_lanes` for 8 dots at once: lane `c` of the result is
/// `sum_lanes(a[c])`, bit for bit. Each level adds the same pairs as `sum_lanes` (lane
/// `l` and `l + 8`, then `l + 4`, `l + 2`, `l + 1`), with shuffles lining them up across
/// the 8 registers instead of 8 separate horizontal reductions.
///
/// # Safety
/// The CPU has AVX-512F; inlined into an `avx512f` function.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce8(a: &[std::arch::x86_64::__m512; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // 128-bit quarters: [q0 q1 q2 q3] = lanes 0-3, 4-7, 8-11, 12-15. No closures here:
    // they would not inherit the caller's target feature.
    // h_c = lanes 0-7 + lanes 8-15 of a[c]; t_i = [h_2i | h_2i+1].
    let t0 = add_shuffled_f32x4::<0x44, 0xEE>(a[0], a[1]); // [x.q0 x.q1 y.q0 y.q1] + [x.q2 x.q3 y.q2 y.q3]
    let t1 = add_shuffled_f32x4::<0x44, 0xEE>(a[2], a[3]);
    let t2 = add_shuffled_f32x4::<0x44, 0xEE>(a[4], a[5]);
    let t3 = add_shuffled_f32x4::<0x44, 0xEE>(a[6], a[7]);
    // g_c = h_c lanes 0-3 + lanes 4-7; w0 = [g0 g1 g2 g3], w1 = [g4 g5 g6 g7].
    let w0 = add_shuffled_f32x4::<0x88, 0xDD>(t0, t1); // [x.q0 x.q2 y.q0 y.q2] + [x.q1 x.q3 y.q1 y.q3]
    let w1 = add_shuffled_f32x4::<0x88, 0xDD>(t2, t3);
    // Per quarter i: [g_i.0 + g_i.2, g_i.1 + g_i.3, g_i+4.0 + g_i+4.2, g_i+4.1 + g_i+4.3].
    let z = _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(w0, w1), // [w0.0 w0.1 w1.0 w1.1] per quarter
        _mm512_shuffle_ps::<0xEE>(w0, w1), // [w0.2 w0.3 w1.2 w1.3]
    );
    // Per quarter i: [sum_i, sum_i+4, sum_i, sum_i+4].
    let f = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(z, z), // [z.0 z.2 z.0 z.2]
        _mm512_shuffle_ps::<0xDD>(z, z), // [z.1 z.3 z.1 z.3]
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps256(_mm512_permutexvar_ps(order, f))
}

/// `shuffle_f32x4::<A>(x, y) + shuffle_f32x4::<B>(x, y)`: one level of `reduce8`.
///
/// # Safety
/// As `reduce8`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn add_shuffled_f32x4<const A: i32, const B: i32>(
    x: std::arch::x86_64::__m512,
    y: std::arch::x86_64::__m512,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<A>(x, y),
        _mm512_shuffle_f32x4::<B>(x, y),
    )
}

/// Rows of `Avx512::accumulate_rows` that share each value load.
const A512_ROWS: usize = 4;

/// `Avx512::accumulate_rows`: rows in fours (then the rest), 64 elements of each at a
/// time in registers (16 accumulators), every value register loaded once for the rows.
/// A head size not a multiple of 64 goes row by row through `avx512_accumulate`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_accumulate_rows<W: KvElem>(
    ps: &[f32],
    p_stride: usize,
    vs: Rows<'_, '_, W>,
    acc: &mut [f32],
    ahead: &[&[W]],
) {
    let Some(hd) = vs.first_width() else {
        return;
    };
    let rows = acc.len() / hd;
    assert!(
        rows * hd == acc.len()
            && vs.width() == hd
            && vs.len() <= p_stride
            && (rows == 0 || (rows - 1) * p_stride + vs.len() <= ps.len()),
        "accumulate_rows: shapes"
    );
    let mut ahead = ahead; // prefetched during the first rows' pass
    if hd % (4 * LANES) != 0 {
        for (r, acc) in acc.chunks_exact_mut(hd).enumerate() {
            // SAFETY: this function's features include avx512_accumulate's.
            unsafe { avx512_accumulate(&ps[r * p_stride..][..vs.len()], vs, acc) };
        }
        return;
    }
    let mut r = 0;
    while r < rows {
        let n = A512_ROWS.min(rows - r);
        // SAFETY: rows r..r + n are inside `ps` and `acc` (checked).
        unsafe {
            match n {
                4 => avx512_accumulate_block::<W, 4>(ps, p_stride, vs, acc, r, ahead),
                3 => avx512_accumulate_block::<W, 3>(ps, p_stride, vs, acc, r, ahead),
                2 => avx512_accumulate_block::<W, 2>(ps, p_stride, vs, acc, r, ahead),
                _ => avx512_accumulate_block::<W, 1>(ps, p_stride, vs, acc, r, ahead),
            }
        }
        ahead = &[];
        r += n;
    }
}

/// Rows `r0..r0 + R` of `avx512_accumulate_rows` (which checked the shapes; the head size
/// is a multiple of 64): the same chain of fused multiply-adds per element as `accumulate`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
// Indexed loops over register arrays: iterator adaptors take closures, which would not
// inherit the target feature.
#[allow(clippy::needless_range_loop)]
unsafe fn avx512_accumulate_block<W: KvElem, const R: usize>(
    ps: &[f32],
    p_stride: usize,
    vs: Rows<'_, '_, W>,
    acc: &mut [f32],
    r0: usize,
    ahead: &[&[W]],
) {
    use std::arch::x86_64::*;
    let (hd, kn) = (vs.width(), vs.len());
    let mut ahead = Pacer::new(ahead, kn);
    let mut i = 0;
    while i + 4 * LANES <= hd {
        let mut a = [[_mm512_setzero_ps(); 4]; R];
        for r in 0..R {
            for c in 0..4 {
                // SAFETY: 16 floats from i + 16c + 16 <= hd in row r0 + r of `acc`.
                a[r][c] =
                    unsafe { _mm512_loadu_ps(acc.as_ptr().add((r0 + r) * hd + i + c * LANES)) };
            }
        }
        for j in 0..kn {
            if i == 0 {
                ahead.keys(1);
            }
            let mut pv = [_mm512_setzero_ps(); R];
            for r in 0..R {
                pv[r] = _mm512_set1_ps(ps[(r0 + r) * p_stride + j]);
            }
            for c in 0..4 {
                // SAFETY: 16 elements of value row j from i + 16c + 16 <= hd.
                let x = unsafe { load16(vs.ptr(j).add(i + c * LANES)) };
                for r in 0..R {
                    a[r][c] = _mm512_fmadd_ps(pv[r], x, a[r][c]);
                }
            }
        }
        for r in 0..R {
            for c in 0..4 {
                // SAFETY: as the loads.
                unsafe {
                    _mm512_storeu_ps(acc.as_mut_ptr().add((r0 + r) * hd + i + c * LANES), a[r][c])
                };
            }
        }
        i += 4 * LANES;
    }
}

/// 16 elements at `p` widened to f32 (see `load8`). Inlined into the `avx512f` functions
/// below, whose feature its intrinsics then inherit.
///
/// # Safety
/// 16 elements at `p` are readable; the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load16<W: KvElem>(p: *const W) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    match W::DTYPE {
        KvDtype::F32 => _mm512_loadu_ps(p as *const f32),
        KvDtype::Bf16 => {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        KvDtype::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
    }
}

/// `Avx512::accumulate`: 4 registers (64 elements: a 64-wide head in registers across
/// the whole tile) of `acc` at a time, then single registers, then the portable tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_accumulate<W: KvElem>(ps: &[f32], vs: Rows<'_, '_, W>, acc: &mut [f32]) {
    use std::arch::x86_64::*;
    check_rows(ps, vs, acc);
    let mut i = 0;
    while i + 4 * LANES <= acc.len() {
        // SAFETY: 64 elements from `i`, inside `acc` and each row (checked). No closures
        // or iterator adaptors over registers: they would not inherit the target feature.
        unsafe {
            let a = acc.as_mut_ptr().add(i);
            let mut r0 = _mm512_loadu_ps(a);
            let mut r1 = _mm512_loadu_ps(a.add(LANES));
            let mut r2 = _mm512_loadu_ps(a.add(2 * LANES));
            let mut r3 = _mm512_loadu_ps(a.add(3 * LANES));
            for (j, &p) in ps.iter().enumerate() {
                let (pv, x) = (_mm512_set1_ps(p), vs.ptr(j).add(i));
                r0 = _mm512_fmadd_ps(pv, load16(x), r0);
                r1 = _mm512_fmadd_ps(pv, load16(x.add(LANES)), r1);
                r2 = _mm512_fmadd_ps(pv, load16(x.add(2 * LANES)), r2);
                r3 = _mm512_fmadd_ps(pv, load16(x.add(3 * LANES)), r3);
            }
            _mm512_storeu_ps(a, r0);
            _mm512_storeu_ps(a.add(LANES), r1);
            _mm512_storeu_ps(a.add(2 * LANES), r2);
            _mm512_storeu_ps(a.add(3 * LANES), r3);
        }
        i += 4 * LANES;
    }
    while i + LANES <= acc.len() {
        // SAFETY: 16 elements from `i`, inside `acc` and each row.
        unsafe {
            let a = acc.as_mut_ptr().add(i);
            let mut r = _mm512_loadu_ps(a);
            for (j, &p) in ps.iter().enumerate() {
                r = _mm512_fmadd_ps(_mm512_set1_ps(p), load16(vs.ptr(j).add(i)), r);
            }
            _mm512_storeu_ps(a, r);
        }
        i += LANES;
    }
    accumulate_from(i, ps, vs, acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_block<W: KvElem, const R: usize, const C: usize>(
    xs: &[&[f32]; R],
    ws: &[&[W]; C],
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
            let wv = unsafe { load16(ws[c].as_ptr().add(p)) };
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

    /// The rows ahead go out evenly: each asked for once, in order, all of them by the last
    /// key, never more than a step's share at once (a burst stalls the kernel).
    #[test]
    fn the_pacer_asks_for_every_row_once_and_evenly() {
        let data: Vec<f32> = (0..64).map(|i| i as f32).collect();
        for rows_n in 0..40 {
            let rows: Vec<&[f32]> = data.chunks(1).take(rows_n).collect();
            for kn in 1..40 {
                for step in [1, 3, 4, 8] {
                    let mut pacer = Pacer::new(&rows, kn);
                    let mut asked: Vec<f32> = Vec::new();
                    let mut j = 0;
                    while j < kn {
                        let n = step.min(kn - j);
                        let due = pacer.due(n);
                        let share = (n * rows_n).div_ceil(kn);
                        assert!(
                            due.len() <= share,
                            "{rows_n} rows over {kn} keys: {} at once, share {share}",
                            due.len()
                        );
                        asked.extend(due.iter().map(|r| r[0]));
                        j += n;
                    }
                    let want: Vec<f32> = rows.iter().map(|r| r[0]).collect();
                    assert_eq!(
                        asked, want,
                        "{rows_n} rows over {kn} keys in steps of {step}"
                    );
                }
            }
        }
    }

    /// Asserts `run(|out| <body with kern>)` equals `want` for the portable kernel, the
    /// build's AVX2 one and (if this CPU has it) AVX-512: the kernels are distinct types
    /// with generic methods, so each is named here once.
    macro_rules! every_kernel {
        (|$kern:ident, $out:ident| $body:expr, $run:ident, $want:ident, $($msg:tt)+) => {{
            let label = format!($($msg)+);
            {
                let $kern = Portable;
                assert_eq!($run(&|$out| $body), $want, "portable {label}");
            }
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma",
                target_feature = "f16c"
            ))]
            {
                let $kern = Avx2;
                assert_eq!($run(&|$out| $body), $want, "AVX2 {label}");
            }
            #[cfg(target_arch = "x86_64")]
            if let Some($kern) = Avx512::detect() {
                assert_eq!($run(&|$out| $body), $want, "AVX-512 {label}");
            }
        }};
    }

    /// `n` random elements in [-1, 1], with edge values sprinkled in (f16 subnormals and
    /// its largest finite value, a bf16 tiny exponent), the conversions' special cases.
    fn elems<W: KvElem>(rng: &mut StdRng, n: usize) -> Vec<W> {
        const EDGES: [f32; 6] = [6.0e-8, -3.0e-6, 65504.0, -1.0e-30, -1.0e4, 0.0];
        (0..n)
            .map(|_| match rng.random_range(0..8) {
                0 => W::from_f32(EDGES[rng.random_range(0..EDGES.len())]),
                _ => W::from_f32(rng.random_range(-1.0..1.0)),
            })
            .collect()
    }

    fn widen<W: KvElem>(v: &[W]) -> Vec<f32> {
        v.iter().map(|x| x.to_f32()).collect()
    }

    /// Elements before and after each row in `padded`: a kernel that reads outside its
    /// window reads these and gets other bits.
    const PAD: (usize, usize) = (3, 5);

    /// Each row inside a longer one, between random elements (`PAD`); `Rows::new` over
    /// them with the window `PAD.0..PAD.0 + width` sees the rows themselves.
    fn padded<W: KvElem>(rng: &mut StdRng, rows: &[Vec<W>]) -> Vec<Vec<W>> {
        rows.iter()
            .map(|r| {
                let mut p = elems::<W>(rng, PAD.0);
                p.extend_from_slice(r);
                p.extend(elems::<W>(rng, PAD.1));
                p
            })
            .collect()
    }

    /// Every kernel on this machine gives the portable kernel's bits with weights of
    /// element `W`, on lengths with and without a tail, and those are the bits of the f32
    /// dots over the widened weights: widening in registers changes nothing. (Without
    /// AVX-512 on the test machine that kernel is not checked.)
    fn check_blocks<W: KvElem>() {
        let mut rng = StdRng::seed_from_u64(11);
        for k in [1, 7, 15, 16, 17, 64, 100, 577] {
            let mut v = || -> Vec<f32> { (0..k).map(|_| rng.random_range(-1.0..1.0)).collect() };
            let x: Vec<Vec<f32>> = (0..4).map(|_| v()).collect();
            let w: Vec<Vec<W>> = (0..6).map(|_| elems::<W>(&mut rng, k)).collect();
            let wide: Vec<Vec<f32>> = w.iter().map(|w| widen(w)).collect();
            let xs: [&[f32]; 4] = std::array::from_fn(|i| x[i].as_slice());
            let ws: [&[W]; 6] = std::array::from_fn(|i| w[i].as_slice());
            let wides: [&[f32]; 6] = std::array::from_fn(|i| wide[i].as_slice());
            let want = Portable.block(&xs, &wides);
            let name = W::NAME;
            assert_eq!(
                bits(&Portable.block(&xs, &ws)),
                bits(&want),
                "portable {name}, k {k}"
            );
            assert_eq!(
                bits(&dot_block(&xs, &ws)),
                bits(&want),
                "compile-time {name}, k {k}"
            );
            #[cfg(target_arch = "x86_64")]
            if let Some(kern) = Avx512::detect() {
                assert_eq!(
                    bits(&kern.block(&xs, &ws)),
                    bits(&want),
                    "AVX-512 {name}, k {k}"
                );
            }
            // A plain sequential reference to catch a kernel that drops lanes.
            let naive: f64 = x[0]
                .iter()
                .zip(&wide[0])
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            let scale: f64 = x[0]
                .iter()
                .zip(&wide[0])
                .map(|(a, b)| (*a * *b).abs() as f64)
                .sum();
            assert!(
                (want[0][0] as f64 - naive).abs() <= 1e-5 * scale.max(1.0),
                "{name} k {k}"
            );
        }
    }

    #[test]
    fn every_kernel_reproduces_the_portable_order_bitwise_in_every_element() {
        check_blocks::<f32>();
        check_blocks::<half::bf16>();
        check_blocks::<half::f16>();
    }

    /// `accumulate` (attention's `P·V`): every kernel gives the portable bits, which are
    /// those of the f32 values widened; on widths with every path (4 registers, single
    /// registers, a tail) and tiles of 1 to 130 rows.
    fn check_accumulate<W: KvElem>() {
        let mut rng = StdRng::seed_from_u64(12);
        for (hd, rows) in [
            (64, 128),
            (64, 1),
            (16, 3),
            (8, 5),
            (100, 130),
            (7, 9),
            (136, 17),
        ] {
            let ps = widen(&elems::<f32>(&mut rng, rows));
            let v: Vec<Vec<W>> = (0..rows).map(|_| elems::<W>(&mut rng, hd)).collect();
            let wide: Vec<Vec<f32>> = v.iter().map(|v| widen(v)).collect();
            let vs: Vec<&[W]> = v.iter().map(Vec::as_slice).collect();
            let wides: Vec<&[f32]> = wide.iter().map(Vec::as_slice).collect();
            let acc0 = widen(&elems::<f32>(&mut rng, hd));
            let run = |k: &dyn Fn(&mut [f32])| {
                let mut acc = acc0.clone();
                k(&mut acc);
                acc.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            };
            let want = run(&|a| Portable.accumulate(&ps, Rows::whole(&wides), a));
            let name = W::NAME;
            let vs = Rows::whole(&vs);
            every_kernel!(
                |kern, a| kern.accumulate(&ps, vs, a),
                run,
                want,
                "{name} {hd}"
            );
            // Element 0 by hand: the chain of fused multiply-adds in row order.
            let mut e = acc0[0];
            for (p, v) in ps.iter().zip(&wide) {
                e = p.mul_add(v[0], e);
            }
            assert_eq!(want[0], e.to_bits(), "{name} {hd}");
        }
    }

    /// `scores` (attention's score tile) with every kernel is `block`'s dot per row and
    /// key: head sizes a multiple of 16 (the AVX-512 path: at 64 and 128 the queries in
    /// registers, rows in threes or twos, keys in fours; at other sizes threes of rows,
    /// eights of keys; the vector lane tree) and not (the blocked path), rows and key
    /// counts with every remainder, scores written at a stride past the keys.
    fn check_scores<W: KvElem>() {
        let mut rng = StdRng::seed_from_u64(13);
        for (hd, rows, kn) in [
            (64, 3, 128),
            (64, 1, 5),
            (64, 2, 6),
            (64, 5, 7),
            (128, 4, 11),
            (128, 3, 6),
            (16, 2, 8),
            (32, 5, 17),
            (48, 4, 1),
            (24, 3, 9),
        ] {
            let stride = kn + 3;
            let q: Vec<f32> = (0..rows * hd)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let k: Vec<Vec<W>> = (0..kn).map(|_| elems::<W>(&mut rng, hd)).collect();
            let keys: Vec<&[W]> = k.iter().map(Vec::as_slice).collect();
            // The kernels read the keys through a window of longer rows.
            let kp = padded(&mut rng, &k);
            let kp: Vec<&[W]> = kp.iter().map(Vec::as_slice).collect();
            let window = Rows::new(&kp, PAD.0..PAD.0 + hd);
            let mut want = vec![f32::NAN; rows * stride];
            for r in 0..rows {
                for c in 0..kn {
                    want[r * stride + c] =
                        Portable.block(&[&q[r * hd..(r + 1) * hd]], &[keys[c]])[0][0];
                }
            }
            let run = |f: &dyn Fn(&mut [f32])| {
                let mut out = vec![f32::NAN; rows * stride];
                f(&mut out);
                out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            };
            let want = run(&|o| o.copy_from_slice(&want));
            let name = W::NAME;
            every_kernel!(
                |kern, o| kern.scores(&q, window, o, stride, &kp),
                run,
                want,
                "{name} {hd}x{rows}x{kn}"
            );
        }
    }

    /// Attention's softmax step (`row_max`, `exp_sum`): every kernel gives the portable
    /// bits, on rows of every length up to ten 16-lane steps and around a tile (tails of
    /// each size), with scores past exp's clamp (below −87 after the shift), zeros, and a
    /// NaN kept a NaN; the sum is checked against an f64 reference, so a dropped lane fails.
    #[test]
    fn every_kernel_takes_a_softmax_step_as_the_portable_code_bitwise() {
        let mut rng = StdRng::seed_from_u64(14);
        let lengths: Vec<usize> = (0..=160).chain([511, 512, 513]).collect();
        for (i, &len) in lengths.iter().enumerate() {
            let mut row: Vec<f32> = (0..len)
                .map(|_| match rng.random_range(0..10) {
                    0 => rng.random_range(-200.0..-80.0),
                    1 => 0.0,
                    _ => rng.random_range(-30.0..5.0),
                })
                .collect();
            if i % 7 == 3 && len > 0 {
                row[len / 2] = f32::NAN;
            }
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // The row, then one more element: what the body writes there.
            let run = |f: &dyn Fn(&mut [f32])| {
                let mut out = row.clone();
                out.push(f32::NAN);
                f(&mut out);
                out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            };
            let want = run(&|o| o[len] = Portable.row_max(&o[..len]));
            assert_eq!(want[len], m.to_bits(), "the portable max, length {len}");
            every_kernel!(
                |kern, o| o[len] = kern.row_max(&o[..len]),
                run,
                want,
                "row_max, length {len}"
            );
            let want = run(&|o| o[len] = Portable.exp_sum(&mut o[..len], m));
            if !row.iter().any(|x| x.is_nan()) {
                let exact: f64 = row.iter().map(|&x| (x as f64 - m as f64).exp()).sum();
                let sum = f32::from_bits(want[len]) as f64;
                assert!(
                    (sum - exact).abs() <= 1e-5 * exact.max(1.0),
                    "sum, length {len}"
                );
            } else {
                assert!(f32::from_bits(want[len / 2]).is_nan(), "NaN, length {len}");
            }
            every_kernel!(
                |kern, o| o[len] = kern.exp_sum(&mut o[..len], m),
                run,
                want,
                "exp_sum, length {len}"
            );
        }
    }

    #[test]
    fn every_kernel_scores_a_tile_as_the_portable_dots_in_every_element() {
        check_scores::<f32>();
        check_scores::<half::bf16>();
        check_scores::<half::f16>();
    }

    /// `accumulate_rows` with every kernel gives each row `accumulate`'s bits: row counts
    /// around the AVX-512 kernel's blocks of 4, head sizes a multiple of 64 and not.
    fn check_accumulate_rows<W: KvElem>() {
        let mut rng = StdRng::seed_from_u64(14);
        for (hd, rows, kn) in [
            (64, 3, 128),
            (64, 9, 7),
            (128, 5, 33),
            (64, 1, 1),
            (80, 3, 10),
            (16, 6, 4),
        ] {
            let p_stride = kn + 2;
            let ps = widen(&elems::<f32>(&mut rng, rows * p_stride));
            let v: Vec<Vec<W>> = (0..kn).map(|_| elems::<W>(&mut rng, hd)).collect();
            let vs: Vec<&[W]> = v.iter().map(Vec::as_slice).collect();
            // The kernels read the values through a window of longer rows.
            let vp = padded(&mut rng, &v);
            let vp: Vec<&[W]> = vp.iter().map(Vec::as_slice).collect();
            let window = Rows::new(&vp, PAD.0..PAD.0 + hd);
            let acc0 = widen(&elems::<f32>(&mut rng, rows * hd));
            let mut want = acc0.clone();
            for r in 0..rows {
                Portable.accumulate(
                    &ps[r * p_stride..][..kn],
                    Rows::whole(&vs),
                    &mut want[r * hd..(r + 1) * hd],
                );
            }
            let want: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
            let run = |f: &dyn Fn(&mut [f32])| {
                let mut acc = acc0.clone();
                f(&mut acc);
                acc.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            };
            let name = W::NAME;
            every_kernel!(
                |kern, a| kern.accumulate_rows(&ps, p_stride, window, a, &vp),
                run,
                want,
                "{name} {hd}x{rows}"
            );
        }
    }

    #[test]
    fn every_kernel_accumulates_several_rows_as_one_row_at_a_time_in_every_element() {
        check_accumulate_rows::<f32>();
        check_accumulate_rows::<half::bf16>();
        check_accumulate_rows::<half::f16>();
    }

    #[test]
    fn every_kernel_accumulates_rows_as_the_portable_kernel_in_every_element() {
        check_accumulate::<f32>();
        check_accumulate::<half::bf16>();
        check_accumulate::<half::f16>();
    }
}
