//! The `gguf-meta` target: a GGUF file's header — its metadata above all — through what
//! `strata` reads before any tensor: the skim that bounds candle's reader
//! (`model::gguf_header`), candle's reader, the tensor-table check
//! (`weights::read_gguf_header`), then the model config and the tokenizer built from the
//! metadata and used once. The files hold no tensor data, so a case costs microseconds and
//! the mutations spend themselves on what a metadata bomb is made of: array counts, string
//! lengths and type tags set to edge values or to just what the rest of the file could
//! hold, arrays of a million one-byte or empty-string elements, arrays nested deep, keys by
//! the thousand.
//!
//! Contract (beyond no panic and the case budget): reading a file, accepted or refused,
//! holds at most `memory_budget(file length)`: a small multiple of the file, on top of a
//! fixed allowance (docs/errors.md "Model files").

use std::io::Cursor;

use anyhow::Result;
use candle_core::quantized::gguf_file::Value;
use rand::{rngs::StdRng, Rng};

use super::gguf_writer::GgufDoc;
use super::{corpus, mutate, Case};
use crate::bounded::{self, Limits};
use crate::model::{weights, ModelConfig, Tokenizer};

/// Most bytes reading a header of `file_len` bytes may hold: the skim lets candle hold
/// 64 MiB + 4× the metadata's bytes in `Value`s; a `Vec` grown by pushing may hold twice
/// what it uses, and the tokenizer built from a vocabulary a few times its strings.
fn memory_budget(file_len: usize) -> usize {
    (192 << 20) + 16 * file_len
}

/// The base files: the tiny models' metadata, without tensors.
pub fn gguf_meta_cases() -> Vec<Case> {
    corpus::GGUF_ARCHS
        .iter()
        .map(|arch| {
            let mut doc = corpus::gguf_doc(arch);
            doc.tensors.clear();
            let mut c = Case::default();
            c.set("model.gguf", doc.to_bytes());
            c
        })
        .collect()
}

/// Runs one case: `Err` for a refused file; a breach of the memory contract panics.
pub fn run_gguf_meta(case: &Case) -> Result<()> {
    let bytes = case.get("model.gguf").unwrap_or_default().to_vec();
    let limits = Limits {
        memory_bytes: memory_budget(bytes.len()),
        ..super::CASE_LIMITS
    };
    match bounded::run(limits, move || read_and_use(&bytes)) {
        Ok(r) => r,
        Err(e) => panic!("reading the header: {e}"),
    }
}

fn read_and_use(bytes: &[u8]) -> Result<()> {
    let content = weights::read_gguf_header(&mut Cursor::new(bytes), bytes.len() as u64)?;
    ModelConfig::from_gguf(&content.metadata)?;
    let tok = Tokenizer::from_gguf(&content.metadata)?;
    super::exercise_tokenizer(&tok).map(drop)
}

// ---------------------------------------------------------------------------------------
// mutations

/// Where a length, count or type tag sits in a serialised header.
#[derive(Debug, Clone, Copy)]
struct Field {
    at: usize,
    /// 4 or 8 bytes, little-endian.
    width: usize,
}

/// The count, length and type fields of a well-formed GGUF v2/v3 header (`None` when the
/// bytes are not one: an earlier round already broke them).
fn fields(b: &[u8]) -> Option<Vec<Field>> {
    struct Walk<'a> {
        b: &'a [u8],
        at: usize,
        out: Vec<Field>,
    }
    impl Walk<'_> {
        fn take(&mut self, width: usize, record: bool) -> Option<u64> {
            let s = self.b.get(self.at..self.at + width)?;
            let mut v = [0u8; 8];
            v[..width].copy_from_slice(s);
            if record {
                self.out.push(Field { at: self.at, width });
            }
            self.at += width;
            Some(u64::from_le_bytes(v))
        }
        fn string(&mut self) -> Option<()> {
            let n = self.take(8, true)? as usize;
            self.at = self.at.checked_add(n).filter(|&e| e <= self.b.len())?;
            Some(())
        }
        fn value(&mut self, ty: u64, depth: usize) -> Option<()> {
            match ty {
                0 | 1 | 7 => self.at += 1,
                2 | 3 => self.at += 2,
                4..=6 => self.at += 4,
                10..=12 => self.at += 8,
                8 => self.string()?,
                9 if depth < 4 => {
                    let elem = self.take(4, true)?;
                    let n = self.take(8, true)?;
                    for _ in 0..n.min(self.b.len() as u64) {
                        self.value(elem, depth + 1)?;
                    }
                }
                _ => return None,
            }
            (self.at <= self.b.len()).then_some(())
        }
    }
    if b.get(..4)? != b"GGUF" || !matches!(b.get(4)?, 2 | 3) {
        return None;
    }
    let mut w = Walk {
        b,
        at: 8,
        out: Vec::new(),
    };
    w.take(8, true)?; // tensor count
    let kvs = w.take(8, true)?;
    for _ in 0..kvs.min(b.len() as u64) {
        w.string()?;
        let ty = w.take(4, true)?;
        w.value(ty, 0)?;
    }
    Some(w.out)
}

/// A value for a count or length field: an edge, or about what the rest of the file (or
/// the header's whole length) could hold, give or take one.
fn field_value(rng: &mut StdRng, field: Field, len: usize) -> u64 {
    let rest = len.saturating_sub(field.at + field.width) as u64;
    let per = [1u64, 2, 4, 8, 12, 24, 32][rng.random_range(0..7)];
    match rng.random_range(0..4) {
        0 => mutate::interesting(rng),
        1 => rng.random_range(0..16),
        2 => (len as u64 / per)
            .wrapping_add(rng.random_range(0..3))
            .wrapping_sub(1),
        _ => (rest / per)
            .wrapping_add(rng.random_range(0..3))
            .wrapping_sub(1),
    }
}

/// How many elements a bomb has: log-uniform up to a million.
fn bomb_len(rng: &mut StdRng) -> usize {
    1usize << rng.random_range(0..=20)
}

/// A metadata value of the shapes that cost memory to hold.
fn bomb(rng: &mut StdRng) -> Value {
    let n = bomb_len(rng);
    match rng.random_range(0..6) {
        0 => Value::Array(vec![Value::U8(0); n]),
        1 => Value::Array(vec![Value::String(String::new()); n]),
        2 => Value::Array(vec![Value::Bool(true); n]),
        3 => Value::Array(vec![Value::Array(vec![]); n.min(1 << 16)]),
        4 => {
            // Nested deep: an array of an array of ... of one u32.
            let mut v = Value::U32(7);
            for _ in 0..rng.random_range(1..80) {
                v = Value::Array(vec![v]);
            }
            v
        }
        _ => Value::String("x".repeat(n)),
    }
}

/// A key a bomb is stored under: one strata reads (the tokenizer's arrays above all), or
/// a new one.
fn bomb_key(rng: &mut StdRng, doc: &GgufDoc) -> String {
    if rng.random() {
        doc.metadata[rng.random_range(0..doc.metadata.len())]
            .0
            .clone()
    } else {
        format!("fuzz.bomb.{}", rng.random::<u16>())
    }
}

/// Changes the metadata of a document (before it is serialised).
fn mutate_doc(doc: &mut GgufDoc, rng: &mut StdRng) {
    match rng.random_range(0..5) {
        0 | 1 => {
            let key = bomb_key(rng, doc);
            let v = bomb(rng);
            match doc.metadata.iter_mut().find(|(k, _)| *k == key) {
                Some((_, old)) => *old = v,
                None => doc.metadata.push((key, v)),
            }
        }
        2 => {
            // Keys by the thousand, some repeated.
            for i in 0..bomb_len(rng).min(1 << 14) {
                doc.metadata
                    .push((format!("fuzz.k{}", i % 997), Value::U32(i as u32)));
            }
        }
        3 => {
            // One element of another type in an array (candle's writer would refuse it).
            if let Some((_, Value::Array(items))) = doc
                .metadata
                .iter_mut()
                .filter(|(_, v)| matches!(v, Value::Array(a) if !a.is_empty()))
                .nth(rng.random_range(0..3))
            {
                let at = rng.random_range(0..items.len());
                items[at] = Value::U64(mutate::interesting(rng));
            }
        }
        _ => {
            // A long key.
            let key = "k".repeat(bomb_len(rng));
            doc.metadata.push((key, Value::U8(1)));
        }
    }
}

/// One stacked change: on the document while the bytes still are one the base corpus
/// wrote, then on the serialised header's fields, then on its bytes.
pub fn mutate_gguf_meta(case: &mut Case, rng: &mut StdRng) {
    let mut bytes = case.get("model.gguf").unwrap_or_default().to_vec();
    let pristine = gguf_meta_docs().iter().find(|d| d.to_bytes() == bytes);
    match (pristine, rng.random_range(0..10)) {
        (Some(doc), 0..5) => {
            let mut doc = doc.clone();
            mutate_doc(&mut doc, rng);
            bytes = doc.to_bytes();
        }
        (_, 0..8) => match fields(&bytes) {
            Some(fs) if !fs.is_empty() => {
                let f = fs[rng.random_range(0..fs.len())];
                let v = field_value(rng, f, bytes.len());
                bytes[f.at..f.at + f.width].copy_from_slice(&v.to_le_bytes()[..f.width]);
            }
            _ => mutate::mutate_bytes(&mut bytes, rng),
        },
        _ => mutate::mutate_bytes(&mut bytes, rng),
    }
    case.set("model.gguf", bytes);
}

fn gguf_meta_docs() -> &'static [GgufDoc; corpus::GGUF_ARCHS.len()] {
    static DOCS: std::sync::OnceLock<[GgufDoc; corpus::GGUF_ARCHS.len()]> =
        std::sync::OnceLock::new();
    DOCS.get_or_init(|| {
        corpus::GGUF_ARCHS.map(|arch| {
            let mut doc = corpus::gguf_doc(arch);
            doc.tensors.clear();
            doc
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_walk_finds_every_count_length_and_tag_of_a_base_header() {
        let doc = &gguf_meta_docs()[0];
        let bytes = doc.to_bytes();
        let fs = fields(&bytes).expect("a base header walks");
        // Tensor count, KV count; per KV a key length and a type tag; per array an
        // element type and a count; per string value (array elements included) a length.
        let strings: usize = doc
            .metadata
            .iter()
            .map(|(_, v)| match v {
                Value::String(_) => 1,
                Value::Array(items) => items
                    .iter()
                    .filter(|i| matches!(i, Value::String(_)))
                    .count(),
                _ => 0,
            })
            .sum();
        let arrays = doc
            .metadata
            .iter()
            .filter(|(_, v)| matches!(v, Value::Array(_)))
            .count();
        assert_eq!(fs.len(), 2 + 2 * doc.metadata.len() + 2 * arrays + strings);
        assert!(fields(&bytes[..bytes.len() / 2]).is_none());
    }

    #[test]
    fn a_u8_array_bomb_is_refused_within_the_budget() {
        // 8 MiB of u8 elements: candle would hold 256 MiB of `Value`s; the skim refuses
        // it first, and the read stays within the file's budget.
        let mut doc = gguf_meta_docs()[0].clone();
        doc.metadata.push((
            "fuzz.bomb".into(),
            Value::Array(vec![Value::U8(0); 8 << 20]),
        ));
        let mut case = Case::default();
        case.set("model.gguf", doc.to_bytes());
        let err = run_gguf_meta(&case).unwrap_err().to_string();
        assert!(err.contains("metadata"), "{err}");
    }
}
