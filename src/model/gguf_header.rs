//! A skim of a GGUF header for the one value candle's reader trusts blindly:
//! `general.alignment = 0` makes `gguf_file::Content::read` divide by zero (a panic), so
//! it is looked up here first. Anything malformed is left for candle's reader to report.

use std::io::{BufRead, BufReader, Read, Seek};

/// Values nested deeper than this are malformed (candle refuses past 64 too).
const MAX_DEPTH: usize = 64;

/// The integer value of `general.alignment` if the metadata holds one (of a type candle
/// reads), else `None`; `None` too when the header cannot be skimmed.
pub fn alignment<R: Read + Seek>(reader: R) -> Option<i64> {
    skim(&mut BufReader::new(reader)).ok().flatten()
}

type Skim<T> = std::io::Result<T>;

fn bad() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed GGUF header")
}

fn u32_le<R: Read>(r: &mut R) -> Skim<u32> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn u64_le<R: Read>(r: &mut R) -> Skim<u64> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

struct Header {
    /// GGUF v1 has 32-bit lengths, v2 and v3 64-bit.
    wide: bool,
}

impl Header {
    fn len<R: Read>(&self, r: &mut R) -> Skim<u64> {
        if self.wide {
            u64_le(r)
        } else {
            u32_le(r).map(u64::from)
        }
    }
}

fn skip<R: BufRead + Seek>(r: &mut R, n: u64) -> Skim<()> {
    let n = i64::try_from(n).map_err(|_| bad())?;
    r.seek_relative(n)
}

fn skim<R: BufRead + Seek>(r: &mut R) -> Skim<Option<i64>> {
    let file_len = r.seek(std::io::SeekFrom::End(0))?;
    r.rewind()?;
    if u32_le(r)? != 0x4655_4747 {
        return Err(bad());
    }
    let h = Header {
        wide: match u32_le(r)? {
            1 => false,
            2 | 3 => true,
            _ => return Err(bad()),
        },
    };
    let _tensor_count = h.len(r)?;
    let kv_count = h.len(r)?;
    // candle keeps the last of duplicate keys: so does this skim.
    let mut found = None;
    for _ in 0..kv_count {
        let key_len = h.len(r)?;
        if key_len > file_len {
            return Err(bad());
        }
        let mut key = vec![0; key_len as usize];
        r.read_exact(&mut key)?;
        let ty = u32_le(r)?;
        if key != b"general.alignment" {
            skip_value(r, &h, ty, 0, file_len)?;
            continue;
        }
        let mut b = [0; 2];
        found = match ty {
            0 | 1 => {
                r.read_exact(&mut b[..1])?;
                Some(if ty == 0 {
                    b[0] as i64
                } else {
                    b[0] as i8 as i64
                })
            }
            2 | 3 => {
                r.read_exact(&mut b)?;
                let v = u16::from_le_bytes(b);
                Some(if ty == 2 { v as i64 } else { v as i16 as i64 })
            }
            4 | 5 => {
                let v = u32_le(r)?;
                Some(if ty == 4 { v as i64 } else { v as i32 as i64 })
            }
            _ => {
                skip_value(r, &h, ty, 0, file_len)?;
                None
            }
        };
    }
    Ok(found)
}

/// Skips one metadata value of type `ty` (GGUF's numbering).
fn skip_value<R: BufRead + Seek>(
    r: &mut R,
    h: &Header,
    ty: u32,
    depth: usize,
    file_len: u64,
) -> Skim<()> {
    if depth > MAX_DEPTH {
        return Err(bad());
    }
    match ty {
        0 | 1 | 7 => skip(r, 1),
        2 | 3 => skip(r, 2),
        4..=6 => skip(r, 4),
        10..=12 => skip(r, 8),
        8 => {
            let n = h.len(r)?;
            if n > file_len {
                return Err(bad());
            }
            skip(r, n)
        }
        9 => {
            let elem = u32_le(r)?;
            let n = h.len(r)?;
            if n > file_len {
                return Err(bad()); // each element takes at least one byte
            }
            let fixed = match elem {
                0 | 1 | 7 => Some(1),
                2 | 3 => Some(2),
                4..=6 => Some(4),
                10..=12 => Some(8),
                _ => None,
            };
            match fixed {
                Some(size) => skip(r, n.checked_mul(size).ok_or_else(bad)?),
                None => (0..n).try_for_each(|_| skip_value(r, h, elem, depth + 1, file_len)),
            }
        }
        _ => Err(bad()),
    }
}
