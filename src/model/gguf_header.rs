//! A skim of a GGUF header before candle's reader runs on its metadata, for what that
//! reader trusts (the tensor table after the metadata is read by `weights.rs` itself):
//!
//! - `general.alignment = 0` makes `gguf_file::Content::read` divide by zero (a panic);
//! - candle holds every metadata value as a `gguf_file::Value` (32 bytes, whatever the
//!   element: a u8 array of 64 MiB became 2 GiB and 40 s of one-byte reads). The skim
//!   adds up what candle would hold — a `Value` per element plus string bytes — and refuses
//!   a file past `memory_budget` before anything is allocated: 64 MiB plus 4× the
//!   metadata's bytes on disk (a 262K-token vocabulary with its scores, types and merges
//!   holds ~3× its bytes), so rejecting a bad file costs a small multiple of what it is.
//!
//! Anything malformed is left for candle's reader to report (it bounds lengths by the
//! file's size).

use std::io::{BufRead, BufReader, Read, Seek};

use candle_core::quantized::gguf_file;

/// Values nested deeper than this are malformed (candle refuses past 64 too).
const MAX_DEPTH: usize = 64;

/// What candle's reader may hold for the metadata: `BASE_BUDGET` plus `BUDGET_PER_BYTE`×
/// the bytes the metadata takes in the file.
const BASE_BUDGET: u64 = 64 << 20;
const BUDGET_PER_BYTE: u64 = 4;

/// What the skim found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Skimmed {
    /// `general.alignment` if the metadata holds one of a type candle reads.
    pub alignment: Option<i64>,
    /// GGUF v2/v3's 64-bit lengths (v1: 32-bit).
    pub wide: bool,
    /// Tensors the header declares.
    pub tensor_count: u64,
    /// Where the metadata ends (the tensor table starts): `None` when the skim did not
    /// get there (a malformed header, for candle to report).
    pub metadata_end: Option<u64>,
}

/// Skims the header: `Err` (one line) when candle's reader would hold more than the
/// budget; a malformed header is `Ok` with what was found, for candle to report.
pub fn check<R: Read + Seek>(reader: R) -> Result<Skimmed, String> {
    let mut tally = Tally::default();
    let mut found = Skimmed::default();
    let r = skim(&mut BufReader::new(reader), &mut tally, &mut found);
    if let Err(e) = r {
        if let Some(over) = e.get_ref().and_then(|e| e.downcast_ref::<OverBudget>()) {
            return Err(over.0.clone());
        }
    }
    Ok(found)
}

type Skim<T> = std::io::Result<T>;

fn bad() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed GGUF header")
}

/// The budget's refusal, carried through `std::io::Error` to `check`.
#[derive(Debug)]
struct OverBudget(String);

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for OverBudget {}

/// What candle would hold for the metadata skimmed so far.
#[derive(Default)]
struct Tally {
    held: u64,
}

impl Tally {
    /// Adds `bytes` held for the value under `key`; refuses past the budget, which grows
    /// with the metadata bytes read (`at`: the offset reached in the file).
    fn add(&mut self, bytes: u64, key: &[u8], at: u64) -> Skim<()> {
        self.held = self.held.saturating_add(bytes);
        let budget = BASE_BUDGET.saturating_add(BUDGET_PER_BYTE.saturating_mul(at));
        if self.held > budget {
            let key = String::from_utf8_lossy(&key[..key.len().min(64)])
                .escape_debug()
                .to_string();
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                OverBudget(format!(
                    "GGUF metadata `{key}` would take {} MiB of memory to read (at most {} MiB for {} MiB of metadata)",
                    self.held >> 20,
                    budget >> 20,
                    at >> 20
                )),
            ));
        }
        Ok(())
    }
}

/// Bytes candle holds for one value: the `Value` itself (strings' and arrays' contents
/// come on top, added where they are read).
fn value_bytes() -> u64 {
    std::mem::size_of::<gguf_file::Value>() as u64
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

fn skim<R: BufRead + Seek>(r: &mut R, tally: &mut Tally, out: &mut Skimmed) -> Skim<()> {
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
    out.wide = h.wide;
    out.tensor_count = h.len(r)?;
    let kv_count = h.len(r)?;
    // candle keeps the last of duplicate keys: so does this skim.
    for _ in 0..kv_count {
        let key_len = h.len(r)?;
        if key_len > file_len {
            return Err(bad());
        }
        let mut key = vec![0; key_len as usize];
        r.read_exact(&mut key)?;
        let ty = u32_le(r)?;
        let at = r.stream_position()?;
        tally.add(key_len + value_bytes() + 64, &key, at)?; // the key, its value, a map entry
        if key != b"general.alignment" {
            let mut value = Value {
                h: &h,
                file_len,
                tally,
                key: &key,
            };
            value.skip(r, ty, 0)?;
            continue;
        }
        let mut b = [0; 2];
        out.alignment = match ty {
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
                let mut value = Value {
                    h: &h,
                    file_len,
                    tally,
                    key: &key,
                };
                value.skip(r, ty, 0)?;
                None
            }
        };
    }
    out.metadata_end = Some(r.stream_position()?);
    Ok(())
}

/// One metadata value being skipped, its memory tallied under its key.
struct Value<'a> {
    h: &'a Header,
    file_len: u64,
    tally: &'a mut Tally,
    key: &'a [u8],
}

impl Value<'_> {
    /// Skips one value of type `ty` (GGUF's numbering) whose own `Value` is counted.
    fn skip<R: BufRead + Seek>(&mut self, r: &mut R, ty: u32, depth: usize) -> Skim<()> {
        if depth > MAX_DEPTH {
            return Err(bad());
        }
        match ty {
            0 | 1 | 7 => skip(r, 1),
            2 | 3 => skip(r, 2),
            4..=6 => skip(r, 4),
            10..=12 => skip(r, 8),
            8 => {
                let n = self.h.len(r)?;
                if n > self.file_len {
                    return Err(bad());
                }
                let at = r.stream_position()?;
                self.tally.add(n, self.key, at)?;
                skip(r, n)
            }
            9 => {
                let elem = u32_le(r)?;
                let n = self.h.len(r)?;
                if n > self.file_len {
                    return Err(bad()); // each element takes at least one byte
                }
                // Every element is a `Value` to candle, before its contents.
                let at = r.stream_position()?;
                self.tally
                    .add(n.saturating_mul(value_bytes()), self.key, at)?;
                let fixed = match elem {
                    0 | 1 | 7 => Some(1),
                    2 | 3 => Some(2),
                    4..=6 => Some(4),
                    10..=12 => Some(8),
                    _ => None,
                };
                match fixed {
                    Some(size) => skip(r, n.checked_mul(size).ok_or_else(bad)?),
                    None => (0..n).try_for_each(|_| self.skip(r, elem, depth + 1)),
                }
            }
            _ => Err(bad()),
        }
    }
}
