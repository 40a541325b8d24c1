//! Weight storage formats the CPU computes on as stored, and their dequantization.
//!
//! A format stores a matrix row as whole blocks (`block_elems` values in `block_bytes`
//! bytes); dequantizing a row reproduces, bit for bit, what llama.cpp's and candle's
//! reference `dequantize_row_*` compute (the same f32 operations in the same order: Rust
//! never fuses a multiply and an add on its own). `linear` over a stored weight is then,
//! bitwise, `linear` over its dequantized f32 rows: the one fixed reduction order of
//! `dot.rs`, batch-invariant, whatever the format.
//!
//! The dequantizers are written once, scalar; the compiler vectorizes them for the build's
//! target (AVX2 on x86-64-v3) and, through `#[target_feature]`, for AVX-512 where the CPU
//! has it (detected at run time). Both compile the same IEEE operations, so they agree
//! bitwise (a test checks it).

use half::f16;

/// How a weight matrix's rows are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    F32,
    Bf16,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    /// 32 values: an f16 scale and 16 bytes of 4-bit indices into `IQ4_VALUES`.
    Iq4Nl,
    /// 256 values: an f16 scale, eight 6-bit sub-block scales, 4-bit indices into
    /// `IQ4_VALUES`.
    Iq4Xs,
    /// OCP microscaling FP4 (gpt-oss's experts): 32 values, a power-of-two scale (E8M0)
    /// and 16 bytes of 4-bit E2M1 codes (`MXFP4_VALUES`).
    Mxfp4,
}

/// The 16 values IQ4_NL and IQ4_XS indices name (ggml's `kvalues_iq4nl`): a non-linear
/// grid, denser near zero.
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The 16 values an MXFP4 code names, doubled (ggml's `kvalues_mxfp4`: E2M1's
/// 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; `e8m0_half` halves the scale back).
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half the scale an E8M0 byte encodes, `2^(e − 127) / 2` (ggml's
/// `ggml_e8m0_to_fp32_half`: subnormal for `e < 2`).
#[inline(always)]
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

impl Format {
    /// The format of GGML type `id` (ggml.h's numbering, as GGUF tensor tables store
    /// it), or why strata does not read it.
    pub fn from_ggml_id(id: u32) -> Result<Format, String> {
        Ok(match id {
            0 => Format::F32,
            1 => Format::F16,
            2 => Format::Q4_0,
            3 => Format::Q4_1,
            6 => Format::Q5_0,
            7 => Format::Q5_1,
            8 => Format::Q8_0,
            10 => Format::Q2K,
            11 => Format::Q3K,
            12 => Format::Q4K,
            13 => Format::Q5K,
            14 => Format::Q6K,
            20 => Format::Iq4Nl,
            23 => Format::Iq4Xs,
            30 => Format::Bf16,
            39 => Format::Mxfp4,
            _ => {
                let name = match id {
                    4 | 5 => "Q4_2/Q4_3 (removed from GGML)",
                    9 => "Q8_1",
                    15 => "Q8_K",
                    16 => "IQ2_XXS",
                    17 => "IQ2_XS",
                    18 => "IQ3_XXS",
                    19 => "IQ1_S",
                    21 => "IQ3_S",
                    22 => "IQ2_S",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    29 => "IQ1_M",
                    34 => "TQ1_0",
                    35 => "TQ2_0",
                    _ => return Err(format!("unknown GGML type {id}")),
                };
                return Err(format!(
                    "type {name} (GGML type {id}), which strata does not read; it reads F32, \
                     F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, \
                     IQ4_NL, IQ4_XS and MXFP4: use a file of one of those (e.g. Q4_K_M)"
                ));
            }
        })
    }

    /// The same format in candle's terms (candle reads neither IQ4 format nor MXFP4).
    pub fn ggml(self) -> Option<candle_core::quantized::GgmlDType> {
        use candle_core::quantized::GgmlDType as G;
        Some(match self {
            Format::F32 => G::F32,
            Format::Bf16 => G::BF16,
            Format::F16 => G::F16,
            Format::Q4_0 => G::Q4_0,
            Format::Q4_1 => G::Q4_1,
            Format::Q5_0 => G::Q5_0,
            Format::Q5_1 => G::Q5_1,
            Format::Q8_0 => G::Q8_0,
            Format::Q2K => G::Q2K,
            Format::Q3K => G::Q3K,
            Format::Q4K => G::Q4K,
            Format::Q5K => G::Q5K,
            Format::Q6K => G::Q6K,
            Format::Iq4Nl | Format::Iq4Xs | Format::Mxfp4 => return None,
        })
    }
}

/// Values in one K-quant super-block.
const QK_K: usize = 256;

impl Format {
    /// Values per block.
    pub const fn block_elems(self) -> usize {
        match self {
            Format::F32 | Format::Bf16 | Format::F16 => 1,
            Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q5_1 | Format::Q8_0 => 32,
            Format::Iq4Nl | Format::Mxfp4 => 32,
            Format::Q2K | Format::Q3K | Format::Q4K | Format::Q5K | Format::Q6K => QK_K,
            Format::Iq4Xs => QK_K,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Format::F32 => 4,
            Format::Bf16 | Format::F16 => 2,
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q5_1 => 24,
            Format::Q8_0 => 34,
            Format::Q2K => 84,
            Format::Q3K => 110,
            Format::Q4K => 144,
            Format::Q5K => 176,
            Format::Q6K => 210,
            Format::Iq4Nl => 18,
            Format::Iq4Xs => 136,
            Format::Mxfp4 => 17,
        }
    }

    /// Bytes of a row of `cols` values, or `None` if `cols` is not a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        cols.is_multiple_of(self.block_elems())
            .then(|| cols / self.block_elems() * self.block_bytes())
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::Bf16 => "bf16",
            Format::F16 => "f16",
            Format::Q4_0 => "Q4_0",
            Format::Q4_1 => "Q4_1",
            Format::Q5_0 => "Q5_0",
            Format::Q5_1 => "Q5_1",
            Format::Q8_0 => "Q8_0",
            Format::Q2K => "Q2_K",
            Format::Q3K => "Q3_K",
            Format::Q4K => "Q4_K",
            Format::Q5K => "Q5_K",
            Format::Q6K => "Q6_K",
            Format::Iq4Nl => "IQ4_NL",
            Format::Iq4Xs => "IQ4_XS",
            Format::Mxfp4 => "MXFP4",
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Dequantizes whole blocks: `bytes` holds `out.len() / block_elems` blocks of `format`.
/// Uses the AVX-512 build of the same code where the CPU has it.
pub fn dequantize(format: Format, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(
        Some(bytes.len()),
        format.row_bytes(out.len()),
        "dequantize: {} bytes are not {} {format} values",
        bytes.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if avx512_detected() {
        // SAFETY: AVX-512F (and BW, which byte shuffles want) were detected.
        unsafe { dequantize_avx512(format, bytes, out) };
        return;
    }
    dequantize_generic(format, bytes, out);
}

#[cfg(target_arch = "x86_64")]
fn avx512_detected() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn dequantize_avx512(format: Format, bytes: &[u8], out: &mut [f32]) {
    dequantize_generic(format, bytes, out);
}

/// The one definition of every format's values (the build's vector width).
#[inline(always)]
pub fn dequantize_generic(format: Format, bytes: &[u8], out: &mut [f32]) {
    let (n, b) = (format.block_elems(), format.block_bytes());
    match format {
        Format::F32 => {
            for (o, x) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
            }
        }
        Format::Bf16 => {
            for (o, x) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                // bf16 is the top half of an f32: widening is a shift.
                *o = f32::from_bits((u16::from_le_bytes([x[0], x[1]]) as u32) << 16);
            }
        }
        Format::F16 => {
            for (o, x) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([x[0], x[1]]).to_f32();
            }
        }
        _ => {
            let blocks = bytes.chunks_exact(b).zip(out.chunks_exact_mut(n));
            match format {
                Format::Q4_0 => blocks.for_each(|(x, y)| q4_0(x, y.try_into().unwrap())),
                Format::Q4_1 => blocks.for_each(|(x, y)| q4_1(x, y.try_into().unwrap())),
                Format::Q5_0 => blocks.for_each(|(x, y)| q5_0(x, y.try_into().unwrap())),
                Format::Q5_1 => blocks.for_each(|(x, y)| q5_1(x, y.try_into().unwrap())),
                Format::Q8_0 => blocks.for_each(|(x, y)| q8_0(x, y.try_into().unwrap())),
                Format::Q2K => blocks.for_each(|(x, y)| q2_k(x, y.try_into().unwrap())),
                Format::Q3K => blocks.for_each(|(x, y)| q3_k(x, y.try_into().unwrap())),
                Format::Q4K => blocks.for_each(|(x, y)| q4_k(x, y.try_into().unwrap())),
                Format::Q5K => blocks.for_each(|(x, y)| q5_k(x, y.try_into().unwrap())),
                Format::Q6K => blocks.for_each(|(x, y)| q6_k(x, y.try_into().unwrap())),
                Format::Iq4Nl => blocks.for_each(|(x, y)| iq4_nl(x, y.try_into().unwrap())),
                Format::Iq4Xs => blocks.for_each(|(x, y)| iq4_xs(x, y.try_into().unwrap())),
                Format::Mxfp4 => blocks.for_each(|(x, y)| mxfp4(x, y.try_into().unwrap())),
                Format::F32 | Format::Bf16 | Format::F16 => unreachable!(),
            }
        }
    }
}

#[inline(always)]
fn half_at(x: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([x[at], x[at + 1]]).to_f32()
}

/// `d: f16, qs: [u8; 16]`: value `j` (`j + 16`) is d × `IQ4_VALUES[low (high) nibble of
/// qs[j]]` (ggml's `dequantize_row_iq4_nl`).
#[inline(always)]
fn iq4_nl(x: &[u8], y: &mut [f32; 32]) {
    let d = half_at(x, 0);
    table_values(&IQ4_VALUES, d, &x[2..18], y);
}

/// `e: u8, qs: [u8; 16]`: value `j` (`j + 16`) is `e8m0_half(e)` × `MXFP4_VALUES[low
/// (high) nibble of qs[j]]` (ggml's `dequantize_row_mxfp4`).
#[inline(always)]
fn mxfp4(x: &[u8], y: &mut [f32; 32]) {
    table_values(&MXFP4_VALUES, e8m0_half(x[0]), &x[1..17], y);
}

/// Sixteen index bytes into `table`, scaled: `y[j]` from the low nibble of `qs[j]`,
/// `y[j + 16]` from its high nibble.
#[inline(always)]
fn table_values(table: &[i8; 16], scale: f32, qs: &[u8], y: &mut [f32; 32]) {
    for j in 0..16 {
        y[j] = scale * table[(qs[j] & 0x0F) as usize] as f32;
        y[j + 16] = scale * table[(qs[j] >> 4) as usize] as f32;
    }
}

/// The scale of IQ4_XS sub-block `ib` (0..8) of the block at `x`: d × (its 6-bit scale −
/// 32), the scale's low 4 bits from `scales_l`, its high 2 from `scales_h`.
#[inline(always)]
pub fn iq4_xs_scale(x: &[u8], ib: usize) -> f32 {
    let d = half_at(x, 0);
    let scales_h = u16::from_le_bytes([x[2], x[3]]);
    let low = (x[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
    let high = ((scales_h >> (2 * ib)) & 3) as u8;
    d * ((low | (high << 4)) as i32 - 32) as f32
}

/// `d: f16, scales_h: u16, scales_l: [u8; 4], qs: [u8; 128]`: eight sub-blocks of 32, each
/// its scale (`iq4_xs_scale`) × `IQ4_VALUES[nibble]` (ggml's `dequantize_row_iq4_xs`).
#[inline(always)]
fn iq4_xs(x: &[u8], y: &mut [f32; QK_K]) {
    for ib in 0..QK_K / 32 {
        let qs = &x[8 + 16 * ib..8 + 16 * (ib + 1)];
        let out: &mut [f32; 32] = (&mut y[32 * ib..32 * (ib + 1)]).try_into().unwrap();
        table_values(&IQ4_VALUES, iq4_xs_scale(x, ib), qs, out);
    }
}

/// `d: f16, qs: [u8; 16]`; value `j` (`j + 16`) is the low (high) nibble of `qs[j]`, − 8, × d.
#[inline(always)]
fn q4_0(x: &[u8], y: &mut [f32; 32]) {
    let d = half_at(x, 0);
    let qs = &x[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// `d: f16, m: f16, qs: [u8; 16]`: nibble × d + m.
#[inline(always)]
fn q4_1(x: &[u8], y: &mut [f32; 32]) {
    let (d, m) = (half_at(x, 0), half_at(x, 2));
    let qs = &x[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// `d: f16, qh: u32, qs: [u8; 16]`: (nibble | fifth bit from qh) − 16, × d.
#[inline(always)]
fn q5_0(x: &[u8], y: &mut [f32; 32]) {
    let d = half_at(x, 0);
    let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
    let qs = &x[6..22];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = (((qs[j] & 0x0F) as u32 | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
    }
}

/// `d: f16, m: f16, qh: u32, qs: [u8; 16]`: (nibble | fifth bit) × d + m.
#[inline(always)]
fn q5_1(x: &[u8], y: &mut [f32; 32]) {
    let (d, m) = (half_at(x, 0), half_at(x, 2));
    let qh = u32::from_le_bytes([x[4], x[5], x[6], x[7]]);
    let qs = &x[8..24];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((qs[j] & 0x0F) as u32 | h0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) as u32 | h1) as f32 * d + m;
    }
}

/// `d: f16, qs: [i8; 32]`: q × d.
#[inline(always)]
fn q8_0(x: &[u8], y: &mut [f32; 32]) {
    let d = half_at(x, 0);
    for (y, &q) in y.iter_mut().zip(&x[2..34]) {
        *y = q as i8 as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` (of 8) packed in a K-quant's 12 scale bytes.
#[inline(always)]
pub(super) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16`: 16 sub-blocks of 16, each
/// `d·(scale & 15) · q − dmin·(scale >> 4)` with 2-bit `q`. Half `h` (128 values) reads
/// `qs[32h..32h + 32]`, its 32-value group `j` at bits `2j..2j + 2`, the group's first 16
/// values from the first 16 bytes (sub-block `8h + 2j`), the next 16 from the rest.
#[inline(always)]
fn q2_k(x: &[u8], y: &mut [f32; QK_K]) {
    let (d, dmin) = (half_at(x, 80), half_at(x, 82));
    for (v, out) in y.iter_mut().enumerate() {
        let (h, j, s, i) = (v / 128, (v % 128) / 32, (v % 32) / 16, v % 16);
        let sc = x[8 * h + 2 * j + s];
        let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
        let q = (x[16 + 32 * h + 16 * s + i] >> (2 * j)) & 3;
        *out = dl * q as f32 - ml;
    }
}

/// Q3_K's 16 six-bit scales (each − 32 when used) from its 12 packed bytes.
#[inline(always)]
pub(super) fn q3_k_scales(packed: &[u8]) -> [i8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let word = |i: usize| u32::from_le_bytes(packed[4 * i..4 * i + 4].try_into().unwrap());
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut out = [0i8; 16];
    for (o, b) in out.iter_mut().zip(aux.iter().flat_map(|w| w.to_le_bytes())) {
        *o = b as i8;
    }
    out
}

/// `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16`: 16 sub-blocks of 16, each
/// `d·(scale − 32) · (q − 4·(1 − hbit))` with 2-bit `q` laid out as Q2_K's and the high
/// bit of value `v` at bit `4h + j` of `hmask[v % 32]`.
#[inline(always)]
fn q3_k(x: &[u8], y: &mut [f32; QK_K]) {
    let d = half_at(x, 108);
    let scales = q3_k_scales(&x[96..108]);
    for (v, out) in y.iter_mut().enumerate() {
        let (h, j, s, i) = (v / 128, (v % 128) / 32, (v % 32) / 16, v % 16);
        let dl = d * (scales[8 * h + 2 * j + s] as f32 - 32.0);
        let q = ((x[32 + 32 * h + 16 * s + i] >> (2 * j)) & 3) as i8;
        let high = x[16 * s + i] & (1 << (4 * h + j)) != 0;
        *out = dl * (q - if high { 0 } else { 4 }) as f32;
    }
}

/// `d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`: Q4_K's layout with
/// a fifth bit: value `l` of 64-value group `g`'s low (high) half has it at bit `2g`
/// (`2g + 1`) of `qh[l]`.
#[inline(always)]
fn q5_k(x: &[u8], y: &mut [f32; QK_K]) {
    let (d, dmin) = (half_at(x, 0), half_at(x, 2));
    let scales = &x[4..16];
    let qh = &x[16..48];
    for g in 0..4 {
        let ql = &x[48 + 32 * g..48 + 32 * g + 32];
        let (s1, m1) = scale_min_k4(2 * g, scales);
        let (s2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
        let y = &mut y[g * 64..g * 64 + 64];
        for l in 0..32 {
            let lo = (ql[l] & 0xF) | (((qh[l] >> (2 * g)) & 1) << 4);
            let hi = (ql[l] >> 4) | (((qh[l] >> (2 * g + 1)) & 1) << 4);
            y[l] = d1 * lo as f32 - m1;
            y[l + 32] = d2 * hi as f32 - m2;
        }
    }
}

/// `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`: 8 sub-blocks of 32, each
/// `d·scale · nibble − dmin·min`; a 64-value chunk takes 32 bytes' low then high nibbles.
#[inline(always)]
fn q4_k(x: &[u8], y: &mut [f32; QK_K]) {
    let (d, dmin) = (half_at(x, 0), half_at(x, 2));
    let scales = &x[4..16];
    let qs = &x[16..144];
    for c in 0..4 {
        let q = &qs[c * 32..c * 32 + 32];
        let (s1, m1) = scale_min_k4(2 * c, scales);
        let (s2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
        let y = &mut y[c * 64..c * 64 + 64];
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0xF) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`: 6-bit values (4 low bits from
/// `ql`, 2 high from `qh`) − 32, × d × their 16-value sub-block's scale.
#[inline(always)]
fn q6_k(x: &[u8], y: &mut [f32; QK_K]) {
    let d = half_at(x, 208);
    for half in 0..2 {
        let ql = &x[64 * half..64 * half + 64];
        let qh = &x[128 + 32 * half..128 + 32 * half + 32];
        let sc = &x[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            y[l] = d * sc[is] as i8 as f32 * q1 as f32;
            y[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
            y[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
            y[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    const ALL: [Format; 13] = [
        Format::F32,
        Format::Bf16,
        Format::F16,
        Format::Q4_0,
        Format::Q4_1,
        Format::Q5_0,
        Format::Q5_1,
        Format::Q8_0,
        Format::Q2K,
        Format::Q3K,
        Format::Q4K,
        Format::Q5K,
        Format::Q6K,
    ];

    /// Candle's quantizer writes the blocks, candle's dequantizer (an implementation we did
    /// not write: llama.cpp's `dequantize_row_*` ported) is the reference; ours must give
    /// its bits exactly, on the default and on the AVX-512 build. The block sizes and
    /// byte counts are candle's too.
    #[test]
    fn dequantize_matches_candle_bitwise_for_every_format() {
        let mut rng = StdRng::seed_from_u64(5);
        for f in ALL {
            let n = 4 * QK_K;
            let src: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..3.0)).collect();
            let t = Tensor::from_vec(src, (4, QK_K), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&t, f.ggml().unwrap()).unwrap();
            assert_eq!(f.ggml().unwrap().block_size(), f.block_elems(), "{f}");
            assert_eq!(f.ggml().unwrap().type_size(), f.block_bytes(), "{f}");
            let bytes = q.data().unwrap().into_owned();
            let want: Vec<f32> = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let mut got = vec![0.0f32; n];
            dequantize_generic(f, &bytes, &mut got);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{f}: default build");
            let mut got = vec![0.0f32; n];
            dequantize(f, &bytes, &mut got);
            assert_eq!(
                bits(&got),
                bits(&want),
                "{f}: dispatched (AVX-512 if present)"
            );
            // Not all zeros / not constant: the quantizer kept information.
            assert!(want.iter().any(|&x| x != want[0]), "{f}");
        }
    }

    #[test]
    fn row_bytes_refuses_partial_blocks() {
        assert_eq!(Format::Q4_1.row_bytes(64), Some(40));
        assert_eq!(Format::Q4_1.row_bytes(48), None);
        assert_eq!(Format::Q6K.row_bytes(512), Some(420));
        assert_eq!(Format::Bf16.row_bytes(3), Some(6));
    }
}
