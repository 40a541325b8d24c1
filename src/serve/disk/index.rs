//! The prefix index: which disk slots hold which prefix-cache blocks, so that a restarted
//! process on the same directory can reuse them. Written crash-safely (temp file, fsync,
//! rename, fsync of the directory) after the slot file itself is synced, so the index never
//! names data that is not durable. Read back with a checksum over the whole file; anything
//! that does not parse, check, or match this model and layout is ignored, not trusted.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};

use super::store::{SlotStamp, StoreLayout};
use crate::safe_file::{self, Links};
use crate::serve::block_key::BlockKey;
use crate::serve::block_manager::DiskSlotId;

pub const INDEX_FILE: &str = "strata-kv.index";
/// Where the index is written before it is renamed over `INDEX_FILE`.
pub const TMP_FILE: &str = "strata-kv.index.tmp";
/// 2: prefix blocks keyed by SHA-256 (`BlockKey`), not a 64-bit hash.
const VERSION: u32 = 2;

/// One persisted prefix block: its chained content key, where it is, the stamp the slot
/// must carry, and what it holds (its parent's key and its tokens, so a restarted process
/// can announce it to KV-event subscribers; absent in indexes written before they were
/// recorded, which stay readable).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexEntry {
    pub hash: BlockKey,
    pub slot: DiskSlotId,
    pub key: u64,
    pub generation: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<BlockKey>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<u32>,
}

impl IndexEntry {
    pub fn stamp(&self) -> SlotStamp {
        SlotStamp {
            key: self.key,
            generation: self.generation,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct IndexFile {
    version: u32,
    fingerprint: u64,
    slot_bytes: u64,
    num_slots: u64,
    entries: Vec<IndexEntry>,
}

/// Largest index a layout of `num_slots` slots of `block_size` tokens can have: an entry
/// per slot (two 64-digit keys, three numbers of at most 20 digits, the tokens of at most
/// 10 digits and a comma each, their names: < 256 + 11 per token) and the fields around
/// them.
pub fn max_index_bytes(num_slots: usize, block_size: usize) -> u64 {
    let entry = (block_size as u64).saturating_mul(11).saturating_add(256);
    (num_slots as u64)
        .saturating_mul(entry)
        .saturating_add(4096)
}

/// Writes the index for `entries` (replacing the old one atomically).
pub fn write(
    dir: &Path,
    fingerprint: u64,
    layout: StoreLayout,
    entries: &[IndexEntry],
) -> Result<()> {
    let body = serde_json::to_vec(&IndexFile {
        version: VERSION,
        fingerprint,
        slot_bytes: layout.slot_bytes() as u64,
        num_slots: layout.num_slots as u64,
        entries: entries.to_vec(),
    })?;
    let tmp = dir.join(TMP_FILE);
    // Not through a link planted at the temporary name (the rename then replaces a link at
    // the index's own name, never its target).
    let mut f = safe_file::create_private(&tmp, "the disk tier's index")?;
    f.write_all(&seal(&body))?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, dir.join(INDEX_FILE))?;
    File::open(dir)?.sync_all()?; // the rename itself
    Ok(())
}

/// An index file's bytes for its JSON `body`: the body, then a line with its CRC32.
pub fn seal(body: &[u8]) -> Vec<u8> {
    let mut out = body.to_vec();
    out.extend_from_slice(format!("\n{:08x}\n", crc32fast::hash(body)).as_bytes());
    out
}

/// The JSON body of an index file's bytes, if its checksum line matches it.
pub fn unseal(bytes: &[u8]) -> Result<&str> {
    let text = std::str::from_utf8(bytes).context("not text")?;
    let (body, crc) = text
        .trim_end_matches('\n')
        .rsplit_once('\n')
        .context("no checksum line")?;
    let crc = u32::from_str_radix(crc, 16).context("bad checksum line")?;
    ensure!(
        crc32fast::hash(body.as_bytes()) == crc,
        "checksum mismatch (torn or corrupted)"
    );
    Ok(body)
}

/// The index in `dir`: `Ok(None)` when there is none, `Err` (with why) when there is one
/// that must not be trusted: corrupt, another version, model/configuration or layout.
pub fn read(
    dir: &Path,
    fingerprint: u64,
    layout: StoreLayout,
    block_size: usize,
) -> Result<Option<Vec<IndexEntry>>> {
    let path = dir.join(INDEX_FILE);
    if std::fs::symlink_metadata(&path).is_err() {
        return Ok(None);
    }
    // A regular file (no link, FIFO or device) no larger than an index of this layout.
    let bytes = safe_file::read_regular(
        &path,
        max_index_bytes(layout.num_slots, block_size),
        "the disk tier's index",
        Links::Refuse,
    )?;
    let f: IndexFile = serde_json::from_str(unseal(&bytes)?).context("does not parse")?;
    ensure!(
        f.version == VERSION,
        "version {} (want {VERSION})",
        f.version
    );
    ensure!(
        f.fingerprint == fingerprint,
        "written for another model, dtype or block size"
    );
    ensure!(
        f.slot_bytes == layout.slot_bytes() as u64 && f.num_slots == layout.num_slots as u64,
        "written for another slot layout"
    );
    Ok(Some(f.entries))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(tokens: Vec<u32>) -> IndexEntry {
        IndexEntry {
            hash: BlockKey::from_bytes([0xAB; 32]),
            slot: DiskSlotId::MAX,
            key: u64::MAX,
            generation: u64::MAX,
            parent: Some(BlockKey::from_bytes([0xCD; 32])),
            tokens,
        }
    }

    #[test]
    fn entries_of_the_older_format_without_contents_still_read() {
        let mut v = serde_json::to_value(entry(vec![1, 2])).unwrap();
        let m = v.as_object_mut().unwrap();
        m.remove("parent");
        m.remove("tokens");
        let e: IndexEntry = serde_json::from_value(v).unwrap();
        assert_eq!((e.parent, e.tokens.len()), (None, 0));
        let full = entry(vec![7, 8]);
        let back: IndexEntry =
            serde_json::from_str(&serde_json::to_string(&full).unwrap()).unwrap();
        assert_eq!(back, full);
    }

    #[test]
    fn the_size_bound_holds_the_largest_entries() {
        for block_size in [1, 16, 256] {
            let e = entry(vec![u32::MAX; block_size]);
            let one = serde_json::to_vec(&e).unwrap().len() as u64 + 1; // and a comma
            let bound = max_index_bytes(1, block_size) - 4096;
            assert!(one <= bound, "block {block_size}: {one} > {bound}");
        }
    }
}
