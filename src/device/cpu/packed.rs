//! Weight rows repacked at load for the `q8` mode's integer kernels (`q8.rs`): the rows of
//! a Q4_0, Q4_1 or Q8_0 matrix interleaved in groups of [`PACK`], so that a kernel computing
//! a group's 8 dots reads one sequential stream (instead of 8 strided ones) and converts the
//! group's 8 scales with one instruction.
//!
//! **Layout.** Rows are cut into groups of `PACK` (the last group padded with all-zero
//! rows, whose results are never written). A group is `nb` *group blocks* in row order of
//! blocks (block `b` of all `PACK` rows, then block `b + 1`), each `PACK × block_bytes`
//! bytes, so a repacked matrix is exactly as large as the stored one (plus the padding):
//!
//! ```text
//! Q4_0:  d[8] f16 (16 bytes)                   | nibbles[8] × 16 bytes          = 144 = 8 × 18
//! Q4_1:  d[8] f16 (16 bytes) | m[8] f16 (16)   | nibbles[8] × 16 bytes          = 160 = 8 × 20
//! Q8_0:  d[8] f16 (16 bytes)                   | quads[2] × (low[4], high[4]) × 16 = 272 = 8 × 34
//! ```
//!
//! `d[r]` and `m[r]` are row `r`'s block scale and min, as stored. A 4-bit row's 16 stored
//! bytes follow one another, row after row: byte `j` holds its values `v[j]` (low nibble)
//! and `v[16 + j]` (high), so a 64-byte load of four rows gives, masked, each row's values
//! 0–15 in its 16 bytes, and shifted, its values 16–31 in the same places. Q8_0 rows come in
//! quads of four: the four rows' values 0–15 (16 bytes each), then their values 16–31, so the
//! same two 64-byte registers. The kernels' lane `l` of a row sums values `4l..4l + 4` and
//! `16 + 4l..16 + 4l + 4` (`q8.rs`), the four bytes at `4l` of each register's row slot.
//!
//! Repacking only moves bytes: `unpack_row` rebuilds a row's stored bytes exactly (so the
//! f32 path, the embedding gather and fingerprints read a repacked matrix as stored).

use super::quant::Format;

/// Rows per interleaved group.
pub const PACK: usize = 8;

/// Values per block of the formats repacked here.
const QK: usize = 32;

/// Whether `format`'s rows can be repacked (the formats with an integer kernel).
pub fn supports(format: Format) -> bool {
    matches!(format, Format::Q4_0 | Format::Q4_1 | Format::Q8_0)
}

/// Where a group block's weight values start: after the `PACK` scales (and the
/// `PACK` mins of Q4_1).
pub const fn qs_offset(format: Format) -> usize {
    match format {
        Format::Q4_1 => 4 * PACK,
        _ => 2 * PACK,
    }
}

/// Where a stored 4-bit block's 16 nibble bytes start (after `d`, and Q4_1's `m`).
const fn nibbles_at(format: Format) -> usize {
    match format {
        Format::Q4_1 => 4,
        _ => 2,
    }
}

/// A Q4_0, Q4_1 or Q8_0 matrix `[rows, nb · 32]`, repacked (owned).
pub struct Packed {
    format: Format,
    rows: usize,
    nb: usize,
    data: Vec<u8>, // [groups, nb, PACK · block_bytes]
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
        let (nb, bb) = (cols / QK, format.block_bytes());
        let gbb = PACK * bb;
        let mut data = vec![0u8; rows.div_ceil(PACK) * nb * gbb];
        for (r, row) in bytes.chunks_exact(rb.max(1)).enumerate().take(rows) {
            let (g, c) = (r / PACK, r % PACK);
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let at = (g * nb + b) * gbb;
                place(format, c, blk, &mut data[at..at + gbb]);
            }
        }
        Self {
            format,
            rows,
            nb,
            data,
        }
    }

    pub fn format(&self) -> Format {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes held (the stored size, plus the padding of a last partial group).
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
        let bb = self.format.block_bytes();
        assert_eq!(out.len(), self.nb * bb, "unpack_row: out is not one row");
        let gbb = PACK * bb;
        let (g, c) = (r / PACK, r % PACK);
        for (b, blk) in out.chunks_exact_mut(bb).enumerate() {
            let at = (g * self.nb + b) * gbb;
            take(self.format, c, &self.data[at..at + gbb], blk);
        }
    }
}

/// Where row `c`'s 16 nibble bytes of a Q4 group block start (after `qs_offset`).
pub const fn q4_row_at(c: usize) -> usize {
    QK / 2 * c
}

/// Where row `c`'s values `16h..16h + 16` of a Q8_0 group block start (after `qs_offset`):
/// quad `c / 4`'s half `h`, slot `c % 4`.
pub const fn q8_half_at(c: usize, h: usize) -> usize {
    8 * QK * (c / 4) / 2 + 4 * QK / 2 * h + QK / 2 * (c % 4)
}

/// Writes stored block `blk` as row `c` of group block `gb` (whose other rows it leaves).
fn place(format: Format, c: usize, blk: &[u8], gb: &mut [u8]) {
    gb[2 * c..2 * c + 2].copy_from_slice(&blk[..2]);
    let qs = qs_offset(format);
    match format {
        Format::Q8_0 => {
            for h in 0..2 {
                let at = qs + q8_half_at(c, h);
                gb[at..at + QK / 2].copy_from_slice(&blk[2 + QK / 2 * h..][..QK / 2]);
            }
        }
        _ => {
            if format == Format::Q4_1 {
                gb[2 * PACK + 2 * c..2 * PACK + 2 * c + 2].copy_from_slice(&blk[2..4]);
            }
            let at = qs + q4_row_at(c);
            gb[at..at + QK / 2].copy_from_slice(&blk[nibbles_at(format)..][..QK / 2]);
        }
    }
}

/// Reads row `c` of group block `gb` back into stored block `blk`.
fn take(format: Format, c: usize, gb: &[u8], blk: &mut [u8]) {
    blk[..2].copy_from_slice(&gb[2 * c..2 * c + 2]);
    let qs = qs_offset(format);
    match format {
        Format::Q8_0 => {
            for h in 0..2 {
                let at = qs + q8_half_at(c, h);
                blk[2 + QK / 2 * h..][..QK / 2].copy_from_slice(&gb[at..at + QK / 2]);
            }
        }
        _ => {
            if format == Format::Q4_1 {
                blk[2..4].copy_from_slice(&gb[2 * PACK + 2 * c..2 * PACK + 2 * c + 2]);
            }
            let at = qs + q4_row_at(c);
            blk[nibbles_at(format)..][..QK / 2].copy_from_slice(&gb[at..at + QK / 2]);
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
    data: &'a [u8], // [groups, nb, PACK · block_bytes]
}

impl<'a> PackedRows<'a> {
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(PACK)
    }

    /// Group `g`'s `nb` group blocks.
    pub fn group(&self, g: usize) -> PackedGroup<'a> {
        let len = self.nb * PACK * self.format.block_bytes();
        PackedGroup {
            format: self.format,
            nb: self.nb,
            data: &self.data[g * len..(g + 1) * len],
        }
    }
}

/// One group of `PACK` repacked rows: `nb` group blocks.
#[derive(Clone, Copy)]
pub struct PackedGroup<'a> {
    pub format: Format,
    pub nb: usize,
    pub data: &'a [u8], // [nb, PACK · block_bytes]
}

impl PackedGroup<'_> {
    /// Row `c`'s block `b` as stored, into `blk[block_bytes]`.
    pub fn block(&self, c: usize, b: usize, blk: &mut [u8]) {
        let gbb = PACK * self.format.block_bytes();
        take(self.format, c, &self.data[b * gbb..(b + 1) * gbb], blk);
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
        for format in [Format::Q4_0, Format::Q4_1, Format::Q8_0] {
            for (rows, nb) in [(1, 1), (8, 3), (13, 2), (24, 18)] {
                let cols = nb * QK;
                let rb = format.row_bytes(cols).unwrap();
                let bytes = random_rows(&mut rng, format, rows, cols);
                let p = Packed::pack(format, &bytes, rows, cols);
                assert_eq!(p.bytes(), rows.div_ceil(PACK) * PACK * rb);
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
                    for b in 0..nb {
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
