//! Weight rows repacked at load for the `q8` mode's integer kernels (`q8.rs`): the rows of
//! a matrix interleaved in groups of [`PACK`], so that a kernel computing a group's 8 dots
//! reads one sequential stream (instead of 8 strided ones) and converts the group's 8
//! scales with one instruction.
//!
//! **Layout.** Rows are cut into groups of `PACK` (the last group padded with all-zero
//! rows, whose results are never written). A group is a run of *group units* in row order
//! (unit `u` of all `PACK` rows, then unit `u + 1`); a unit is one stored block: 32 values,
//! or a K-quant's super-block of 256. Offsets in bytes from the unit's start:
//!
//! ```text
//! Q4_0:  d[8] f16 (16)                                   | nib[8] × 16   = 144 = 8 × 18
//! Q4_1:  d[8] f16 (16) | m[8] f16 (16)                   | nib[8] × 16   = 160 = 8 × 20
//! Q5_0:  d[8] f16 (16) | qh_lo[8] u16 | qh_hi[8] u16     | nib[8] × 16   = 176 = 8 × 22
//! Q5_1:  d[8] | m[8] | qh_lo[8] u16 | qh_hi[8] u16       | nib[8] × 16   = 192 = 8 × 24
//! Q8_0:  d[8] f16 (16) | quads[2] × (low[4], high[4]) × 16                = 272 = 8 × 34
//! Q4_K:  d[8] | dmin[8] | sc[8 blocks][8] u8 | m[8 blocks][8] u8 | nib[8 blocks][8] × 16
//!                                                                         = 1184 = 8 × 148
//! Q5_K:  as Q4_K, then qh[2 halves][8] × 16 before the nibbles           = 1440 = 8 × 180
//! Q6_K:  d[8] | sc[8 blocks][2 halves][8] i8 | qh[2 chunks][2 halves][8] × 16
//!        | nib[8 blocks][8] × 16                                          = 1680 = 8 × 210
//! ```
//!
//! `d[r]`, `m[r]` (`dmin[r]`) are row `r`'s scales as stored. **Nibbles** are canonical in
//! every 4-, 5- and 6-bit format: a row's 16 bytes for a 32-value block hold its values' low
//! four bits, `v[j]` in byte `j`'s low nibble and `v[16 + j]` in its high one, rows after one
//! another, so a 64-byte load of four rows gives, masked, each row's values 0–15 in its 16
//! bytes and, shifted, its values 16–31 in the same places. Q8_0 rows come in quads of four:
//! the four rows' values 0–15 (16 bytes each), then their values 16–31, so the same two
//! 64-byte registers. The kernels' lane `l` of a row sums values `4l..4l + 4` and
//! `16 + 4l..16 + 4l + 4` (`q8.rs`), the four bytes at `4l` of each register's row slot.
//!
//! **High bits.** Q5_0/Q5_1's `qh` (bit `i`: value `i`'s fifth bit) is split into its low
//! 16 bits (values 0–15) for the 8 rows, then its high 16, so the 8 bytes at `8k` of either
//! are the bit masks of rows `4k..4k + 4`' first (second) register of values. Q5_K's 32
//! `qh` bytes (byte `i`, bit `b`: value `i` of sub-block `b`) and Q6_K's (per 128 values:
//! byte `i`, bits `2t..2t + 2`: value `i` of that chunk's block `t`) are kept as stored,
//! cut into halves (bytes 0–15, 16–31) laid out row after row as the nibbles are.
//! **Scales.** K-quant sub-block scales and mins are unpacked from their 6-bit packing to a
//! byte each (Q4_K and Q5_K: 16 bytes a super-block where 12 were stored), block after
//! block with the 8 rows' bytes together; Q6_K's are its 16 signed bytes, per block its two
//! halves' scales.
//!
//! Repacking loses nothing: `unpack_row` rebuilds a row's stored bytes exactly (so the
//! f32 path, the embedding gather and fingerprints read a repacked matrix as stored).

use super::quant::{scale_min_k4, Format};

/// Rows per interleaved group.
pub const PACK: usize = 8;

/// Values per block of the integer kernels (the activation blocks).
const QK: usize = 32;

/// 32-value blocks in a K-quant super-block.
pub const K_BLOCKS: usize = 8;

/// The formats whose rows can be repacked: those with an integer kernel.
pub const FORMATS: [Format; 8] = [
    Format::Q4_0,
    Format::Q4_1,
    Format::Q5_0,
    Format::Q5_1,
    Format::Q8_0,
    Format::Q4K,
    Format::Q5K,
    Format::Q6K,
];

/// Whether `format`'s rows can be repacked (one of `FORMATS`).
pub fn supports(format: Format) -> bool {
    FORMATS.contains(&format)
}

/// Bytes one row's unit takes in a group unit: the stored block size, but for Q4_K and
/// Q5_K, whose 12 bytes of packed 6-bit scales and mins take 16 here.
pub const fn unit_bytes(format: Format) -> usize {
    match format {
        Format::Q4K | Format::Q5K => format.block_bytes() + 4,
        _ => format.block_bytes(),
    }
}

/// Where a 32-value group unit's nibbles (or Q8_0's quads) start.
pub const fn qs_offset(format: Format) -> usize {
    match format {
        Format::Q4_1 => 4 * PACK,
        Format::Q5_0 => 6 * PACK,
        Format::Q5_1 => 8 * PACK,
        _ => 2 * PACK,
    }
}

/// Where a Q5_0 / Q5_1 group unit's `qh_lo[8]` start (`qh_hi[8]` follow).
pub const fn qh_offset(format: Format) -> usize {
    match format {
        Format::Q5_1 => 4 * PACK,
        _ => 2 * PACK,
    }
}

/// Where the minimum scales (`m[8]` f16; a K-quant's `dmin[8]`) start.
pub const MINS_AT: usize = 2 * PACK;

/// Offsets of a K-quant group unit's parts (bytes from its start; the layout above).
#[derive(Clone, Copy, Debug)]
pub struct KParts {
    /// Sub-block scales: `[block][row]` (Q6_K: `[block][half][row]`).
    pub sc: usize,
    /// Sub-block mins `[block][row]` (Q4_K, Q5_K).
    pub mins: usize,
    /// High bits: Q5_K `[half][row][16]`, Q6_K `[chunk][half][row][16]`.
    pub qh: usize,
    /// Nibbles `[block][row][16]`.
    pub qs: usize,
}

pub const fn k_parts(format: Format) -> KParts {
    let p = PACK;
    match format {
        Format::Q6K => KParts {
            sc: 2 * p,
            mins: 0,
            qh: 2 * p + 2 * K_BLOCKS * p,
            qs: 2 * p + 2 * K_BLOCKS * p + 2 * 2 * 16 * p,
        },
        Format::Q5K => KParts {
            sc: 4 * p,
            mins: 4 * p + K_BLOCKS * p,
            qh: 4 * p + 2 * K_BLOCKS * p,
            qs: 4 * p + 2 * K_BLOCKS * p + 2 * 16 * p,
        },
        _ => KParts {
            sc: 4 * p,
            mins: 4 * p + K_BLOCKS * p,
            qh: 0,
            qs: 4 * p + 2 * K_BLOCKS * p,
        },
    }
}

/// A matrix `[rows, cols]` of one of the `supports` formats, repacked (owned).
pub struct Packed {
    format: Format,
    rows: usize,
    nb: usize,
    data: Vec<u8>, // [groups, units, PACK · unit_bytes]
}

impl Packed {
    /// Repacks `rows` stored rows of `cols` values (`bytes` = `[rows, row_bytes]`).
    pub fn pack(format: Format, bytes: &[u8], rows: usize, cols: usize) -> Self {
        assert!(supports(format), "pack: {format} has no integer kernel");
        let rb = format.row_bytes(cols).expect("pack: rows of whole blocks");
        assert_eq!(
            bytes.len(),
            rows * rb,
            "pack: bytes are not [rows, row_bytes]"
        );
        let (units, bb) = (cols / format.block_elems(), format.block_bytes());
        let gub = PACK * unit_bytes(format);
        let mut data = vec![0u8; rows.div_ceil(PACK) * units * gub];
        for (r, row) in bytes.chunks_exact(rb.max(1)).enumerate().take(rows) {
            let (g, c) = (r / PACK, r % PACK);
            for (u, blk) in row.chunks_exact(bb).enumerate() {
                let at = (g * units + u) * gub;
                place(format, c, blk, &mut data[at..at + gub]);
            }
        }
        Self {
            format,
            rows,
            nb: cols / QK,
            data,
        }
    }

    pub fn format(&self) -> Format {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes held (the stored size, plus the padding of a last partial group and Q4_K's /
    /// Q5_K's unpacked scales).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Borrowed, for the kernels.
    pub fn as_rows(&self) -> PackedRows<'_> {
        PackedRows {
            format: self.format,
            rows: self.rows,
            nb: self.nb,
            data: &self.data,
        }
    }

    /// Row `r`'s stored bytes into `out[row_bytes]`: the inverse of `pack`.
    pub fn unpack_row(&self, r: usize, out: &mut [u8]) {
        assert!(r < self.rows, "unpack_row: row {r} of {}", self.rows);
        let rows = self.as_rows();
        let bb = self.format.block_bytes();
        assert_eq!(
            out.len(),
            rows.units() * bb,
            "unpack_row: out is not one row"
        );
        let g = rows.group(r / PACK);
        for (u, blk) in out.chunks_exact_mut(bb).enumerate() {
            g.block(r % PACK, u, blk);
        }
    }
}

/// Where row `c`'s 16 nibble bytes of a 32-value group unit start (after `qs_offset`; a
/// K-quant block's, after its block's start).
pub const fn q4_row_at(c: usize) -> usize {
    QK / 2 * c
}

/// Where row `c`'s values `16h..16h + 16` of a Q8_0 group block start (after `qs_offset`):
/// quad `c / 4`'s half `h`, slot `c % 4`.
pub const fn q8_half_at(c: usize, h: usize) -> usize {
    8 * QK * (c / 4) / 2 + 4 * QK / 2 * h + QK / 2 * (c % 4)
}

/// Where stored block bytes of a 32-value format keep `d`, `m`, `qh` and the nibbles (or
/// Q8_0's bytes); `None` where the format has no such part.
pub(super) struct Stored32 {
    pub m: Option<usize>,
    pub qh: Option<usize>,
    pub qs: usize,
}

pub(super) const fn stored32(format: Format) -> Stored32 {
    match format {
        Format::Q4_1 => Stored32 {
            m: Some(2),
            qh: None,
            qs: 4,
        },
        Format::Q5_0 => Stored32 {
            m: None,
            qh: Some(2),
            qs: 6,
        },
        Format::Q5_1 => Stored32 {
            m: Some(2),
            qh: Some(4),
            qs: 8,
        },
        _ => Stored32 {
            m: None,
            qh: None,
            qs: 2,
        },
    }
}

/// Writes stored block `blk` as row `c` of group unit `gb` (whose other rows it leaves).
fn place(format: Format, c: usize, blk: &[u8], gb: &mut [u8]) {
    match format {
        Format::Q4K | Format::Q5K | Format::Q6K => return place_k(format, c, blk, gb),
        _ => {}
    }
    gb[2 * c..2 * c + 2].copy_from_slice(&blk[..2]);
    let s = stored32(format);
    let qs = qs_offset(format);
    if format == Format::Q8_0 {
        for h in 0..2 {
            let at = qs + q8_half_at(c, h);
            gb[at..at + QK / 2].copy_from_slice(&blk[s.qs + QK / 2 * h..][..QK / 2]);
        }
        return;
    }
    if let Some(m) = s.m {
        gb[MINS_AT + 2 * c..MINS_AT + 2 * c + 2].copy_from_slice(&blk[m..m + 2]);
    }
    if let Some(qh) = s.qh {
        let at = qh_offset(format) + 2 * c;
        gb[at..at + 2].copy_from_slice(&blk[qh..qh + 2]);
        gb[at + 2 * PACK..at + 2 * PACK + 2].copy_from_slice(&blk[qh + 2..qh + 4]);
    }
    let at = qs + q4_row_at(c);
    gb[at..at + QK / 2].copy_from_slice(&blk[s.qs..][..QK / 2]);
}

/// Reads row `c` of group unit `gb` back into stored block `blk`.
fn take(format: Format, c: usize, gb: &[u8], blk: &mut [u8]) {
    match format {
        Format::Q4K | Format::Q5K | Format::Q6K => return take_k(format, c, gb, blk),
        _ => {}
    }
    blk[..2].copy_from_slice(&gb[2 * c..2 * c + 2]);
    let s = stored32(format);
    let qs = qs_offset(format);
    if format == Format::Q8_0 {
        for h in 0..2 {
            let at = qs + q8_half_at(c, h);
            blk[s.qs + QK / 2 * h..][..QK / 2].copy_from_slice(&gb[at..at + QK / 2]);
        }
        return;
    }
    if let Some(m) = s.m {
        blk[m..m + 2].copy_from_slice(&gb[MINS_AT + 2 * c..MINS_AT + 2 * c + 2]);
    }
    if let Some(qh) = s.qh {
        let at = qh_offset(format) + 2 * c;
        blk[qh..qh + 2].copy_from_slice(&gb[at..at + 2]);
        blk[qh + 2..qh + 4].copy_from_slice(&gb[at + 2 * PACK..at + 2 * PACK + 2]);
    }
    let at = qs + q4_row_at(c);
    blk[s.qs..][..QK / 2].copy_from_slice(&gb[at..at + QK / 2]);
}

/// A K-quant super-block's low four bits of value `i` of block `b`, as stored: Q4_K and
/// Q5_K keep block `2c`'s in the low nibbles of 32 bytes at `qs + 32c` and block `2c + 1`'s
/// in their high ones; Q6_K per 128 values (`qs + 64k`) its blocks `t` = 0, 1 in the low
/// nibbles of the first and second 32 bytes, `t` = 2, 3 in the high ones.
pub(super) const fn k_nibble_at(format: Format, b: usize, i: usize) -> (usize, u32) {
    match format {
        Format::Q6K => {
            let (k, t) = (b / 4, b % 4);
            (64 * k + 32 * (t % 2) + i, 4 * (t / 2) as u32)
        }
        _ => (32 * (b / 2) + i, 4 * (b % 2) as u32),
    }
}

/// Stored offsets of a K-quant's `qs`, `qh` and scales (`d`, `dmin` at 0, 2; Q6_K's `d` at 208).
pub(super) const fn k_stored(format: Format) -> (usize, usize, usize) {
    match format {
        Format::Q4K => (16, 0, 4),
        Format::Q5K => (48, 16, 4),
        _ => (0, 128, 192), // Q6_K
    }
}

fn place_k(format: Format, c: usize, blk: &[u8], gb: &mut [u8]) {
    let k = k_parts(format);
    let (qs, qh, sc) = k_stored(format);
    if format == Format::Q6K {
        gb[2 * c..2 * c + 2].copy_from_slice(&blk[208..210]);
        for b in 0..K_BLOCKS {
            for h in 0..2 {
                gb[k.sc + (2 * b + h) * PACK + c] = blk[sc + 2 * b + h];
            }
        }
        for chunk in 0..2 {
            for h in 0..2 {
                let at = k.qh + ((2 * chunk + h) * PACK + c) * 16;
                gb[at..at + 16].copy_from_slice(&blk[qh + 32 * chunk + 16 * h..][..16]);
            }
        }
    } else {
        gb[2 * c..2 * c + 2].copy_from_slice(&blk[..2]);
        gb[MINS_AT + 2 * c..MINS_AT + 2 * c + 2].copy_from_slice(&blk[2..4]);
        for b in 0..K_BLOCKS {
            let (s, m) = scale_min_k4(b, &blk[sc..sc + 12]);
            gb[k.sc + b * PACK + c] = s;
            gb[k.mins + b * PACK + c] = m;
        }
        if format == Format::Q5K {
            for h in 0..2 {
                let at = k.qh + (h * PACK + c) * 16;
                gb[at..at + 16].copy_from_slice(&blk[qh + 16 * h..][..16]);
            }
        }
    }
    for b in 0..K_BLOCKS {
        let nib = |i: usize| {
            let (at, shift) = k_nibble_at(format, b, i);
            (blk[qs + at] >> shift) & 0x0F
        };
        let at = k.qs + b * PACK * 16 + q4_row_at(c);
        for j in 0..16 {
            gb[at + j] = nib(j) | (nib(16 + j) << 4);
        }
    }
}

fn take_k(format: Format, c: usize, gb: &[u8], blk: &mut [u8]) {
    let k = k_parts(format);
    let (qs, qh, sc) = k_stored(format);
    blk.fill(0);
    if format == Format::Q6K {
        blk[208..210].copy_from_slice(&gb[2 * c..2 * c + 2]);
        for b in 0..K_BLOCKS {
            for h in 0..2 {
                blk[sc + 2 * b + h] = gb[k.sc + (2 * b + h) * PACK + c];
            }
        }
        for chunk in 0..2 {
            for h in 0..2 {
                let at = k.qh + ((2 * chunk + h) * PACK + c) * 16;
                blk[qh + 32 * chunk + 16 * h..][..16].copy_from_slice(&gb[at..at + 16]);
            }
        }
    } else {
        blk[..2].copy_from_slice(&gb[2 * c..2 * c + 2]);
        blk[2..4].copy_from_slice(&gb[MINS_AT + 2 * c..MINS_AT + 2 * c + 2]);
        let s = |b: usize| gb[k.sc + b * PACK + c];
        let m = |b: usize| gb[k.mins + b * PACK + c];
        // The inverse of `scale_min_k4`: blocks 0–3 in the low six bits of bytes 0–3
        // (scales) and 4–7 (mins), blocks 4–7's low four bits in bytes 8–11 and their top
        // two in the top bits of bytes 0–7.
        for j in 0..4 {
            blk[sc + j] = s(j) | ((s(j + 4) >> 4) << 6);
            blk[sc + j + 4] = m(j) | ((m(j + 4) >> 4) << 6);
            blk[sc + j + 8] = (s(j + 4) & 0x0F) | ((m(j + 4) & 0x0F) << 4);
        }
        if format == Format::Q5K {
            for h in 0..2 {
                let at = k.qh + (h * PACK + c) * 16;
                blk[qh + 16 * h..][..16].copy_from_slice(&gb[at..at + 16]);
            }
        }
    }
    for b in 0..K_BLOCKS {
        let at = k.qs + b * PACK * 16 + q4_row_at(c);
        for j in 0..16 {
            let byte = gb[at + j];
            for (i, v) in [(j, byte & 0x0F), (16 + j, byte >> 4)] {
                let (at, shift) = k_nibble_at(format, b, i);
                blk[qs + at] |= v << shift;
            }
        }
    }
}

/// A repacked matrix (or a run of its groups), borrowed.
#[derive(Clone, Copy)]
pub struct PackedRows<'a> {
    pub format: Format,
    /// Real rows (the last group may hold fewer than `PACK`).
    pub rows: usize,
    /// Blocks of 32 values per row.
    pub nb: usize,
    data: &'a [u8], // [groups, units, PACK · unit_bytes]
}

impl<'a> PackedRows<'a> {
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(PACK)
    }

    /// Stored blocks (units) per row.
    pub fn units(&self) -> usize {
        self.nb * QK / self.format.block_elems()
    }

    /// Group `g`'s units.
    pub fn group(&self, g: usize) -> PackedGroup<'a> {
        let len = self.units() * PACK * unit_bytes(self.format);
        PackedGroup {
            format: self.format,
            nb: self.nb,
            data: &self.data[g * len..(g + 1) * len],
        }
    }
}

/// One group of `PACK` repacked rows: its units.
#[derive(Clone, Copy)]
pub struct PackedGroup<'a> {
    pub format: Format,
    /// Blocks of 32 values per row.
    pub nb: usize,
    pub data: &'a [u8], // [units, PACK · unit_bytes]
}

impl PackedGroup<'_> {
    /// Row `c`'s unit `u` as stored, into `blk[block_bytes]`.
    pub fn block(&self, c: usize, u: usize, blk: &mut [u8]) {
        let gub = PACK * unit_bytes(self.format);
        take(self.format, c, &self.data[u * gub..(u + 1) * gub], blk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Random bytes are valid blocks of every format here (any f16 scale, any nibbles).
    fn random_rows(rng: &mut StdRng, format: Format, rows: usize, cols: usize) -> Vec<u8> {
        let n = rows * format.row_bytes(cols).unwrap();
        (0..n).map(|_| rng.random()).collect()
    }

    /// Every row comes back byte for byte, in full and partial groups, and the repacked
    /// matrix is the stored size plus the last group's padding.
    #[test]
    fn a_repacked_row_unpacks_to_its_stored_bytes() {
        let mut rng = StdRng::seed_from_u64(5);
        for format in FORMATS {
            for (rows, units) in [(1, 1), (8, 3), (13, 2), (24, 18)] {
                let cols = units * format.block_elems();
                let rb = format.row_bytes(cols).unwrap();
                let bytes = random_rows(&mut rng, format, rows, cols);
                let p = Packed::pack(format, &bytes, rows, cols);
                assert_eq!(
                    p.bytes(),
                    rows.div_ceil(PACK) * PACK * units * unit_bytes(format)
                );
                let mut row = vec![0u8; rb];
                for r in 0..rows {
                    p.unpack_row(r, &mut row);
                    assert_eq!(
                        row,
                        bytes[r * rb..(r + 1) * rb],
                        "{format} row {r} of {rows}"
                    );
                    let g = p.as_rows().group(r / PACK);
                    let mut blk = vec![0u8; format.block_bytes()];
                    for b in 0..units {
                        g.block(r % PACK, b, &mut blk);
                        assert_eq!(blk, row[b * blk.len()..(b + 1) * blk.len()]);
                    }
                }
            }
        }
    }

    /// The layout the SIMD kernels assume, spelled out on one Q4_1 group block: scales,
    /// mins, then each row's 16 stored nibble bytes, row after row.
    #[test]
    fn the_q4_rows_follow_one_another_after_the_scales_and_mins() {
        let format = Format::Q4_1;
        let mut bytes = vec![0u8; 2 * 20];
        bytes[..4].copy_from_slice(&[1, 2, 3, 4]); // row 0: d, m
        bytes[4] = 0x5A; // row 0: v[0] = 0xA, v[16] = 0x5
        bytes[20..24].copy_from_slice(&[5, 6, 7, 8]); // row 1
        bytes[24] = 0xC3; // row 1: v[0] = 0x3, v[16] = 0xC
        bytes[39] = 0x71; // row 1: v[15] = 0x1, v[31] = 0x7
        let p = Packed::pack(format, &bytes, 2, QK);
        let d = p.as_rows().group(0).data;
        assert_eq!(&d[..4], &[1, 2, 5, 6]);
        assert_eq!(&d[16..20], &[3, 4, 7, 8]);
        assert_eq!((d[32], d[48], d[63]), (0x5A, 0xC3, 0x71));
        assert!(d[33..48].iter().all(|&b| b == 0) && d[64..].iter().all(|&b| b == 0));
    }

    /// Q8_0's quads: rows 0–3's values 0–15, then their values 16–31, then rows 4–7's.
    #[test]
    fn the_q8_quads_hold_four_rows_low_halves_then_their_high_halves() {
        let format = Format::Q8_0;
        let rows = 6;
        // Row r's value i is the byte 32r + i (so each byte names its row and place).
        let bytes: Vec<u8> = (0..rows)
            .flat_map(|r| {
                let mut blk = vec![0u8; 34];
                for (i, b) in blk[2..].iter_mut().enumerate() {
                    *b = (32 * r + i) as u8;
                }
                blk
            })
            .collect();
        let p = Packed::pack(format, &bytes, rows, QK);
        let q = &p.as_rows().group(0).data[qs_offset(format)..];
        let at = |r: usize, i: usize| q.iter().position(|&b| b == (32 * r + i) as u8).unwrap();
        assert_eq!(at(0, 0), 0);
        assert_eq!(at(1, 0), 16);
        assert_eq!(at(3, 15), 63);
        assert_eq!(at(0, 16), 64);
        assert_eq!(at(2, 20), 64 + 32 + 4);
        assert_eq!(at(4, 0), 128);
        assert_eq!(at(5, 16), 128 + 64 + 16);
    }
}
