//! The `disk` target: the disk tier's two files as a restarted `strata serve` finds them in
//! its `--disk-offload-dir` — the prefix index (`strata-kv.index`: JSON, then a CRC32 line)
//! and the slot file (`strata-kv.slots`: fixed slots, each a header page then the payload).
//!
//! A case names the files' bytes, and may plant another kind of file at a name: a
//! `NAME.kind` entry holds `fifo`, `dir`, `link /dev/zero`, `link ../sentinel` (a file
//! outside the tier's directory), `hardlink sentinel`, or `len N` (the bytes, then the file
//! grown or cut to N bytes with `set_len`: a huge file is sparse, never written). A case
//! that names the index's temporary file (`strata-kv.index.tmp`) also saves the index
//! after the restore, as the engine does when its persisted set changes.
//!
//! Run: open the tier with the base layout and fingerprint (`DiskTier::open`, as `strata
//! serve` does), `restore_entries`, then read every adopted slot with its key (the block's
//! hash, as the engine loads a persisted prefix block). The contract — a breach is a panic,
//! so a finding:
//! - a read that succeeds returns exactly the payload the base wrote under that key (the
//!   payload is a function of the key): never torn, flipped, stale or another block's data;
//! - the sentinel beside the tier's directory is never modified (content and length);
//! - a slot file that is a link, FIFO, directory or shared hard link is refused, and an
//!   index that is not a regular file of its own is ignored and said so (`RestoreReport`);
//! - no panic, within `CASE_LIMITS` (a FIFO must not block, a huge file must not be read).
//!
//! `Ok` only when every entry of the index was adopted and read back; an ignored index, a
//! rejected entry or a failed read is an `Err` (the expected end of a damaged tier).
//!
//! Mutations (1–4 stacked): the index's JSON by pointer with its checksum line recomputed
//! (so a change reaches the parser and the checks after it), entries duplicated or moved
//! to other slots, raw bytes with the checksum left wrong; the slot file's headers and
//! payloads flipped, header fields rewritten raw or re-sealed (header checksum and payload
//! CRC recomputed, so a well-formed but stale or foreign slot is presented), one slot copied
//! over another, the file cut or extended; and the kinds above at any of the three names.
//!
//! A re-seal always gives the slot a stamp no index entry can name (a fresh random key,
//! generation or fingerprint; another slot's key but its own generation): a checksum is no
//! signature, and a forgery consistent with the index would be served by design.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use rand::{rngs::StdRng, Rng, RngCore, SeedableRng};
use serde_json::Value as J;

use super::mutate::{interesting, mutate_bytes, mutate_json};
use super::{Case, ScratchDir};
use crate::serve::block_key::BlockKey;
use crate::serve::block_manager::{DiskSlotId, PersistedBlock};
use crate::serve::disk::index::{self, IndexEntry, INDEX_FILE, TMP_FILE};
use crate::serve::disk::store::{
    DiskStore, SlotHeader, StoreLayout, ALIGN, HEADER_LEN, SLOTS_FILE,
};
use crate::serve::disk::{DiskTier, DiskTierConfig};

/// A small tier: four slots of a payload that spans pages and ends inside one.
pub const LAYOUT: StoreLayout = StoreLayout {
    payload_bytes: 2 * ALIGN + 100,
    num_slots: 4,
};
const FINGERPRINT: u64 = u64::from_le_bytes(*b"fuzzdisk");
/// Tokens a block holds (bounds the index a layout may have; the cases name no tokens).
const BLOCK_SIZE: usize = 16;
const SENTINEL: &[u8] = b"sentinel: no file of the tier may ever reach this one\n";

/// The payload the base writes under `key`: a function of the key alone, so a read is
/// checked without knowing which slot it came from.
pub fn payload_for(key: u64) -> Vec<u8> {
    let mut p = vec![0; LAYOUT.payload_bytes];
    StdRng::seed_from_u64(key).fill_bytes(&mut p);
    p
}

/// The base tiers: three of four slots written, and all four (other keys).
pub fn disk_cases() -> Vec<Case> {
    [(1u64, &[0, 1, 3][..]), (2, &[0, 1, 2, 3][..])]
        .into_iter()
        .map(|(salt, slots)| base_tier(salt, slots).expect("building a base disk tier"))
        .collect()
}

/// A tier whose `slots` were written through `DiskStore` (keys drawn from `salt`) and an
/// index naming them (`index::write`), as the files' bytes.
fn base_tier(salt: u64, slots: &[DiskSlotId]) -> Result<Case> {
    let dir = ScratchDir::new()?;
    let store = DiskStore::open(dir.path(), LAYOUT, FINGERPRINT, |io| io)?;
    let mut keys = StdRng::seed_from_u64(salt);
    let mut buf = store.slot_buffer()?;
    let mut entries = Vec::new();
    for &slot in slots {
        let hash = BlockKey::from_bytes(keys.random());
        let key = hash.wire();
        store
            .payload_mut(&mut buf)
            .copy_from_slice(&payload_for(key));
        store.write_slot(slot, key, &mut buf)?;
        // Generations come from the wall clock: fixed ones (rewritten below) keep a case a
        // pure function of (seed, index) in every process.
        let generation = 0x6e6e_0000_0000 + (salt << 8) + slot as u64;
        entries.push(IndexEntry {
            hash,
            slot,
            key,
            generation,
            parent: None,
            tokens: Vec::new(),
        });
    }
    drop(store);
    let mut slots_file = std::fs::read(dir.path().join(SLOTS_FILE))?;
    for e in &entries {
        let header = header_mut(&mut slots_file, e.slot as usize).context("a header")?;
        let mut h = SlotHeader::decode(header).context("a header just written")?;
        h.generation = e.generation;
        h.encode(header);
    }
    index::write(dir.path(), FINGERPRINT, LAYOUT, &entries)?;
    let index_file = std::fs::read(dir.path().join(INDEX_FILE))?;
    Ok(Case {
        files: vec![
            (INDEX_FILE.into(), index_file),
            (SLOTS_FILE.into(), slots_file),
        ],
    })
}

/// The header bytes of `slot` in the slot file's bytes, if the file reaches that far.
fn header_mut(file: &mut [u8], slot: usize) -> Option<&mut [u8]> {
    let at = slot * LAYOUT.slot_bytes();
    file.get_mut(at..at + HEADER_LEN)
}

// ---------------------------------------------------------------------------------------
// file kinds

/// What is at one of the tier's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A regular file with the case's bytes, grown or cut to `len` when given.
    Bytes {
        len: Option<u64>,
    },
    Fifo,
    Dir,
    LinkToZero,
    LinkToSentinel,
    HardLinkToSentinel,
}

impl Kind {
    fn parse(text: &[u8]) -> Result<Self> {
        Ok(match std::str::from_utf8(text).context("kind")?.trim() {
            "fifo" => Kind::Fifo,
            "dir" => Kind::Dir,
            "link /dev/zero" => Kind::LinkToZero,
            "link ../sentinel" => Kind::LinkToSentinel,
            "hardlink sentinel" => Kind::HardLinkToSentinel,
            other => match other.strip_prefix("len ") {
                Some(n) => Kind::Bytes {
                    len: Some(n.parse().context("len")?),
                },
                None => bail!("unknown file kind {other:?}"),
            },
        })
    }

    fn to_text(self) -> String {
        match self {
            Kind::Bytes { len: None } => String::new(),
            Kind::Bytes { len: Some(n) } => format!("len {n}"),
            Kind::Fifo => "fifo".into(),
            Kind::Dir => "dir".into(),
            Kind::LinkToZero => "link /dev/zero".into(),
            Kind::LinkToSentinel => "link ../sentinel".into(),
            Kind::HardLinkToSentinel => "hardlink sentinel".into(),
        }
    }

    /// Whether the tier must refuse this as its slot file (it would write through it).
    fn refused_as_slot_file(self) -> bool {
        !matches!(self, Kind::Bytes { .. })
    }

    /// Whether the tier must ignore this as its index without reading it.
    fn ignored_as_index(self) -> bool {
        matches!(
            self,
            Kind::Fifo | Kind::Dir | Kind::LinkToZero | Kind::LinkToSentinel
        )
    }
}

fn kind_name(name: &str) -> String {
    format!("{name}.kind")
}

/// What the case puts at `name`: `None` when nothing.
fn kind_of(case: &Case, name: &str) -> Result<Option<Kind>> {
    match case.get(&kind_name(name)) {
        Some(k) => Kind::parse(k).map(Some),
        None => Ok(case.get(name).map(|_| Kind::Bytes { len: None })),
    }
}

/// Creates `name` in `dir` as the case says.
fn plant(case: &Case, dir: &Path, name: &str) -> Result<Option<Kind>> {
    let Some(kind) = kind_of(case, name)? else {
        return Ok(None);
    };
    let path = dir.join(name);
    match kind {
        Kind::Bytes { len } => {
            std::fs::write(&path, case.get(name).unwrap_or_default())?;
            if let Some(n) = len {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)?
                    .set_len(n)
                    .with_context(|| format!("set_len({n})"))?;
            }
        }
        Kind::Fifo => {
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
            // SAFETY: a valid NUL-terminated path.
            ensure!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) } == 0, "mkfifo");
        }
        Kind::Dir => std::fs::create_dir(&path)?,
        Kind::LinkToZero => std::os::unix::fs::symlink("/dev/zero", &path)?,
        Kind::LinkToSentinel => std::os::unix::fs::symlink("../sentinel", &path)?,
        Kind::HardLinkToSentinel => std::fs::hard_link(dir.join("../sentinel"), &path)?,
    }
    Ok(Some(kind))
}

// ---------------------------------------------------------------------------------------
// the run

pub fn run_disk(case: &Case) -> Result<()> {
    for (name, _) in &case.files {
        let file = name.strip_suffix(".kind").unwrap_or(name);
        ensure!(
            [INDEX_FILE, SLOTS_FILE, TMP_FILE].contains(&file),
            "bad file name in case: {name:?}"
        );
    }
    let scratch = ScratchDir::new()?;
    let sentinel = scratch.path().join("sentinel");
    std::fs::write(&sentinel, SENTINEL)?;
    let dir = scratch.path().join("tier");
    std::fs::create_dir(&dir)?;
    let index = plant(case, &dir, INDEX_FILE)?;
    let slots = plant(case, &dir, SLOTS_FILE)?;
    let tmp = plant(case, &dir, TMP_FILE)?;
    let result = open_and_read(&dir, index, slots, tmp.is_some());
    // The sentinel is a regular file only this harness writes: reading it cannot block.
    let now = std::fs::read(&sentinel).expect("the sentinel is still readable");
    assert!(
        now == SENTINEL,
        "the file outside the tier's directory was modified ({} bytes now, was {})",
        now.len(),
        SENTINEL.len()
    );
    result
}

fn open_and_read(
    dir: &Path,
    index: Option<Kind>,
    slots: Option<Kind>,
    save_index: bool,
) -> Result<()> {
    let cfg = DiskTierConfig {
        dir: dir.to_path_buf(),
        io_threads: 1,
    };
    let opened = DiskTier::open(&cfg, LAYOUT, FINGERPRINT, |io| io);
    if let Some(k) = slots.filter(|k| k.refused_as_slot_file()) {
        assert!(
            opened.is_err(),
            "a slot file planted as {:?} was opened",
            k.to_text()
        );
    }
    let mut tier = opened?;
    let adopted = tier.restore_entries(BLOCK_SIZE);
    if let Some(k) = index.filter(|k| k.ignored_as_index()) {
        assert!(
            tier.restore.index_ignored.is_some() && adopted.is_empty(),
            "an index planted as {:?} was not ignored",
            k.to_text()
        );
    }
    let mut buf = tier.store.slot_buffer()?;
    let mut failed = Vec::new();
    for &PersistedBlock { hash, slot, .. } in &adopted {
        match tier.store.read_slot(slot, hash.wire(), &mut buf) {
            Ok(()) => assert!(
                tier.store.payload(&buf) == payload_for(hash.wire()),
                "slot {slot} was read as block {hash} but holds other data"
            ),
            Err(e) => failed.push(format!("{e}")),
        }
    }
    if save_index {
        tier.save_index_async(adopted);
    }
    let restore = tier.restore.clone();
    drop(tier); // joins the index writer
    if let Some(why) = restore.index_ignored {
        bail!("index ignored: {why}");
    }
    ensure!(
        restore.rejected_entries == 0,
        "{} index entries failed their check",
        restore.rejected_entries
    );
    ensure!(failed.is_empty(), "reads failed: {}", failed.join("; "));
    Ok(())
}

// ---------------------------------------------------------------------------------------
// mutations

pub fn mutate_disk(case: &mut Case, rng: &mut StdRng) {
    match rng.random_range(0..20) {
        0..=7 => mutate_index(case, rng),
        8..=16 => mutate_slots(case, rng),
        _ => {
            let name = [INDEX_FILE, SLOTS_FILE, TMP_FILE][rng.random_range(0..3)];
            plant_kind(case, name, rng);
        }
    }
}

fn plant_kind(case: &mut Case, name: &str, rng: &mut StdRng) {
    let file_bytes = LAYOUT.file_bytes().unwrap_or(0);
    let kind = match rng.random_range(0..7) {
        0 => Kind::Fifo,
        1 => Kind::Dir,
        2 => Kind::LinkToZero,
        3 => Kind::LinkToSentinel,
        4 => Kind::HardLinkToSentinel,
        // Grown or cut without writing: past any bound (sparse), or just off the layout.
        _ => {
            let lens = [
                0,
                1,
                ALIGN as u64,
                file_bytes - 1,
                file_bytes + 1,
                1 << 32,
                1 << 40,
            ];
            Kind::Bytes {
                len: Some(lens[rng.random_range(0..lens.len())]),
            }
        }
    };
    if case.get(name).is_none() {
        case.set(name, Vec::new());
    }
    case.set(&kind_name(name), kind.to_text().into_bytes());
}

fn mutate_index(case: &mut Case, rng: &mut StdRng) {
    let bytes = case.get(INDEX_FILE).unwrap_or_default().to_vec();
    let parsed = index::unseal(&bytes)
        .ok()
        .and_then(|body| serde_json::from_str::<J>(body).ok());
    let out = match parsed {
        // Most changes keep the checksum right, so they reach the parser and what follows.
        Some(mut v) if rng.random_range(0..10) < 8 => {
            if rng.random() {
                mutate_json(&mut v, rng);
            } else {
                mutate_entries(&mut v, rng);
            }
            index::seal(v.to_string().as_bytes())
        }
        _ => {
            let mut b = bytes;
            mutate_bytes(&mut b, rng);
            b
        }
    };
    case.set(INDEX_FILE, out);
}

/// Entries named twice, moved to another (or no) slot, or given another's key. (Earlier
/// rounds may have made anything of them: only objects are edited.)
fn mutate_entries(v: &mut J, rng: &mut StdRng) {
    let Some(J::Array(entries)) = v.get_mut("entries") else {
        return;
    };
    if entries.is_empty() {
        return;
    }
    let i = rng.random_range(0..entries.len());
    let j = rng.random_range(0..entries.len());
    let field = |e: &J, k: &str| e.get(k).cloned().unwrap_or(J::Null);
    let (slot_j, hash_j) = (field(&entries[j], "slot"), field(&entries[j], "hash"));
    let choice = rng.random_range(0..4);
    if choice == 0 {
        let e = entries[i].clone();
        entries.push(e);
        return;
    }
    let slot_i = field(&entries[i], "slot");
    let Some(e) = entries[i].as_object_mut() else {
        return;
    };
    match choice {
        1 => {
            let to = rng.random_range(0..=LAYOUT.num_slots as u64);
            e.insert("slot".into(), J::from(to));
        }
        2 => {
            e.insert("slot".into(), slot_j);
            if let Some(o) = entries[j].as_object_mut() {
                o.insert("slot".into(), slot_i);
            }
        }
        // The hash names another block than the slot's key: a read with it (its 64-bit
        // form, that other block's key) must not be served.
        _ => {
            e.insert("hash".into(), hash_j);
        }
    }
}

fn mutate_slots(case: &mut Case, rng: &mut StdRng) {
    let mut file = case.get(SLOTS_FILE).unwrap_or_default().to_vec();
    let slot_bytes = LAYOUT.slot_bytes();
    let slot = rng.random_range(0..LAYOUT.num_slots);
    let at = slot * slot_bytes;
    match rng.random_range(0..10) {
        // A byte of a header, or of a payload, flipped.
        0 => flip(&mut file, at, HEADER_LEN, rng),
        1 => flip(&mut file, at + ALIGN, LAYOUT.payload_bytes, rng),
        // A header field overwritten with a boundary value; its checksum left wrong.
        2 => {
            let field = [8, 16, 24, 32, 40, 44][rng.random_range(0..6)];
            let v = interesting(rng).to_le_bytes();
            let w = if field >= 40 { 4 } else { 8 };
            if let Some(dst) = file.get_mut(at + field..at + field + w) {
                dst.copy_from_slice(&v[..w]);
            }
        }
        3 | 4 => reseal(&mut file, slot, rng),
        // One slot (whole, or its header page only) copied over another.
        5 => {
            let from = rng.random_range(0..LAYOUT.num_slots) * slot_bytes;
            let n = if rng.random() { slot_bytes } else { ALIGN };
            if from + n <= file.len() && at + n <= file.len() {
                file.copy_within(from..from + n, at);
            }
        }
        6 => file.truncate(rng.random_range(0..=file.len())),
        7 => {
            let n = [1, ALIGN, slot_bytes][rng.random_range(0..3)];
            file.extend(std::iter::repeat_n(0u8, n));
        }
        _ => mutate_bytes(&mut file, rng),
    }
    case.set(SLOTS_FILE, file);
}

fn flip(file: &mut [u8], from: usize, len: usize, rng: &mut StdRng) {
    let i = from + rng.random_range(0..len);
    if let Some(b) = file.get_mut(i) {
        *b ^= 1 << rng.random_range(0..8);
    }
}

/// Rewrites a field of a well-formed header and seals it again (header checksum, and the
/// payload CRC over the payload as it now is), so the slot looks sound but is stale, foreign
/// or of another length. Never a stamp an index entry names (see the module).
fn reseal(file: &mut [u8], slot: usize, rng: &mut StdRng) {
    let other_key = {
        let o = rng.random_range(0..LAYOUT.num_slots);
        header_mut(file, o)
            .and_then(|h| SlotHeader::decode(h))
            .map(|h| h.key)
    };
    let payload_at = slot * LAYOUT.slot_bytes() + ALIGN;
    let payload_crc = file
        .get(payload_at..payload_at + LAYOUT.payload_bytes)
        .map(crc32fast::hash);
    let Some(header) = header_mut(file, slot) else {
        return;
    };
    let Some(mut h) = SlotHeader::decode(header) else {
        return;
    };
    match rng.random_range(0..4) {
        // Another block's key under this slot's own generation: foreign.
        0 => {
            h.key = other_key
                .filter(|&k| k != h.key)
                .unwrap_or_else(|| rng.random())
        }
        1 => h.generation = rng.random(), // stale (or from the future)
        2 => h.fingerprint = rng.random(), // another model
        _ => {
            // The stamp stays, the length lies (the payload CRC is left as it was).
            let len = LAYOUT.payload_bytes as u64;
            h.payload_len =
                [0, 1, len - 1, len + 1, ALIGN as u64 * 3, u64::MAX][rng.random_range(0..6)];
            h.encode(header);
            return;
        }
    }
    if let Some(crc) = payload_crc {
        h.checksum = crc;
    }
    h.encode(header);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzz::{base_corpus, make_case, run_case_bounded, Outcome, Target};

    #[test]
    fn the_base_tiers_are_the_same_bytes_every_time_they_are_built() {
        // Generations start from the wall clock: without fixed ones a supervisor would
        // rebuild another input than the one its worker ran.
        assert_eq!(disk_cases(), disk_cases());
    }

    #[test]
    fn every_planted_kind_at_every_name_ends_in_an_error_or_a_clean_restore() {
        let base = &disk_cases()[0];
        let kinds = [
            Kind::Fifo,
            Kind::Dir,
            Kind::LinkToZero,
            Kind::LinkToSentinel,
            Kind::HardLinkToSentinel,
            Kind::Bytes { len: Some(1 << 40) },
        ];
        for name in [INDEX_FILE, SLOTS_FILE, TMP_FILE] {
            for kind in kinds {
                assert_eq!(Kind::parse(kind.to_text().as_bytes()).unwrap(), kind);
                let mut case = base.clone();
                if case.get(name).is_none() {
                    case.set(name, Vec::new());
                }
                case.set(&kind_name(name), kind.to_text().into_bytes());
                // The contract's checks panic; at the temporary name only the save fails.
                match (name, run_case_bounded(Target::Disk, &case)) {
                    (TMP_FILE, Outcome::Ok) | (_, Outcome::Refused(_)) => {}
                    (_, other) => panic!("{name} as {kind:?}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn mutations_reach_every_check_of_the_restore_and_the_reads() {
        // The checksum line is recomputed, so changes reach the parser and the checks
        // behind it; re-sealed and copied slots reach the stamp checks; flips reach the
        // payload check; planted kinds reach the file-type checks.
        let base = base_corpus(Target::Disk);
        let wanted = [
            "checksum mismatch (torn or corrupted)",
            "does not parse",
            "written for another slot layout",
            "index entries failed their check",
            "holds another block",
            "payload checksum mismatch",
            "strata-kv.slots: a symbolic link",
            "strata-kv.index: not a regular file (a FIFO)",
            "is more than the limit",
        ];
        let mut seen = vec![0; wanted.len()];
        let mut ok = 0;
        for i in 0..400 {
            match run_case_bounded(Target::Disk, &make_case(Target::Disk, &base, 3, i)) {
                Outcome::Ok => ok += 1,
                Outcome::Refused(why) => {
                    for (n, w) in seen.iter_mut().zip(wanted) {
                        *n += why.contains(w) as usize;
                    }
                }
                other => panic!("case {i}: {other:?}"),
            }
        }
        assert!(ok > 0, "no case restored cleanly");
        for (n, w) in seen.iter().zip(wanted) {
            assert!(*n > 0, "no case reached {w:?}: {seen:?}");
        }
    }
}
