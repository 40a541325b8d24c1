//! The disk tier: when the host tier has no room for a preempted request's blocks they
//! go to one preallocated slot file on disk, and full prefix blocks are written through
//! to it with an index, so a restarted process on the same directory reuses them.
//!
//! - `store`: the slot file (fallocate, `O_DIRECT` probed once, per-slot header and
//!   checksum, fault-injection seam `SlotIo`);
//! - `pool`: the IO threads;
//! - `backend`: the disk transfer backend (staging through host memory) and the tiered
//!   backend that routes jobs between it and the host tier's;
//! - `index`: the persisted prefix index (temp file + fsync + rename);
//! - `bench`: `strata bench disk`, the store against `dd` on the same file system;
//! - this file: configuration, the CLI options, the model fingerprint, and `DiskTier`, the
//!   engine's handle on all of it.

pub mod backend;
pub mod bench;
pub mod index;
pub mod pool;
pub mod store;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{ensure, Result};
use clap::Args;

use self::index::IndexEntry;
use self::store::{DiskStore, IoMode, SlotIo, StoreLayout};
use super::block_manager::PersistedBlock;
use super::cache_events::BlockContent;
use crate::errors::usage;
use crate::flags;
use crate::model::Model;

/// The disk tier's command-line options (shared by `bench serve` and `serve`).
#[derive(Args, Debug, Clone, Default)]
pub struct DiskArgs {
    /// Directory for the disk KV tier (one preallocated slot file and the prefix index);
    /// a restart on the same directory reuses the persisted prefix blocks.
    #[arg(long, requires = "max_disk_offload_blocks")]
    pub disk_offload_dir: Option<PathBuf>,
    /// Disk-tier capacity in KV blocks (needs --disk-offload-dir; the slot file must fit
    /// in the directory's free space).
    #[arg(long, default_value_t = 0, value_parser = flags::blocks_or_zero(), requires = "disk_offload_dir")]
    pub max_disk_offload_blocks: usize,
    /// IO threads for the disk tier.
    #[arg(long, default_value_t = 4, value_parser = flags::io_threads())]
    pub disk_io_threads: usize,
}

impl DiskArgs {
    /// The engine's disk configuration, or `None` when the tier is off; a half-given pair
    /// of options is a usage error.
    pub fn config(&self) -> Result<Option<DiskTierConfig>> {
        match (&self.disk_offload_dir, self.max_disk_offload_blocks) {
            (None, 0) => Ok(None),
            (None, _) => Err(usage("--max-disk-offload-blocks needs --disk-offload-dir")),
            (Some(_), 0) => Err(usage(
                "--disk-offload-dir needs --max-disk-offload-blocks > 0",
            )),
            (Some(dir), _) => {
                ensure!(
                    (1..=flags::MAX_IO_THREADS).contains(&self.disk_io_threads),
                    "--disk-io-threads must be in 1..={}",
                    flags::MAX_IO_THREADS
                );
                Ok(Some(DiskTierConfig {
                    dir: dir.clone(),
                    io_threads: self.disk_io_threads,
                }))
            }
        }
    }
}

/// Where the disk tier lives; its capacity is `SchedulerConfig::max_disk_offload_blocks`.
#[derive(Debug, Clone)]
pub struct DiskTierConfig {
    pub dir: PathBuf,
    pub io_threads: usize,
}

impl DiskTierConfig {
    /// Checks a tier of `num_slots` slots of `payload_bytes` each can exist in the
    /// directory (its files' types, the file's size, the free space) before anything is
    /// allocated or created for it (`StoreLayout::check`).
    pub fn check(&self, num_slots: usize, payload_bytes: usize) -> Result<()> {
        StoreLayout {
            payload_bytes,
            num_slots,
        }
        .check(&self.dir)?;
        store::check_not_in_use(&self.dir)
    }
}

/// A fingerprint of everything that decides a KV block's bits: the model's configuration
/// and weights, the KV element (`elem`: "f32" on the CPU device, "bf16" on CUDA) and its
/// byte order (payloads are the elements' native bytes), the layout, and the block size.
/// A persisted block is reused only under an equal fingerprint, so another model, element
/// or block size never matches.
pub fn fingerprint(model: &Model, block_size: usize, elem: &str) -> u64 {
    let mut h = DefaultHasher::new();
    ("strata-kv-v1", elem, block_size).hash(&mut h);
    if cfg!(target_endian = "big") {
        "big-endian".hash(&mut h);
    }
    format!("{:?}", model.cfg).hash(&mut h);
    let w = &model.weights;
    let mut crc = crc32fast::Hasher::new();
    for m in w.matrices() {
        m.hash_into(&mut crc);
    }
    for v in w.vectors() {
        // SAFETY: f32 has no padding; viewing its bytes is sound.
        crc.update(unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len() * 4) });
    }
    crc.finalize().hash(&mut h);
    h.finish()
}

/// What opening the tier found, for the plan printed at start.
#[derive(Debug, Clone, Default)]
pub struct RestoreReport {
    /// Persisted prefix blocks taken over from an earlier process.
    pub adopted: usize,
    /// Index entries whose slot header did not match (stale, torn, overwritten).
    pub rejected_entries: usize,
    /// Why the whole index was ignored, if it was.
    pub index_ignored: Option<String>,
}

/// The engine's handle on the disk tier: the store, and the index writer thread.
pub struct DiskTier {
    pub store: Arc<DiskStore>,
    pub io_threads: usize,
    /// Staging blocks in the device's host memory that disk copies stream through.
    pub staging_blocks: usize,
    dir: PathBuf,
    pub restore: RestoreReport,
    index_tx: Option<Sender<Vec<PersistedBlock>>>,
    index_thread: Option<JoinHandle<()>>,
}

impl DiskTier {
    pub fn open(
        cfg: &DiskTierConfig,
        layout: StoreLayout,
        fingerprint: u64,
        wrap_io: impl FnOnce(Box<dyn SlotIo>) -> Box<dyn SlotIo>,
    ) -> Result<Self> {
        let store = Arc::new(DiskStore::open(&cfg.dir, layout, fingerprint, wrap_io)?);
        let (tx, rx) = channel::<Vec<PersistedBlock>>();
        let (st, dir) = (Arc::clone(&store), cfg.dir.clone());
        let thread = std::thread::Builder::new()
            .name("disk-index".into())
            .spawn(move || {
                while let Ok(mut latest) = rx.recv() {
                    while let Ok(newer) = rx.try_recv() {
                        latest = newer; // only the newest snapshot matters
                    }
                    if let Err(e) = save_index(&st, &dir, &latest) {
                        crate::log!("warning: disk tier index not saved: {e:#}");
                    }
                }
            })?;
        Ok(Self {
            store,
            io_threads: cfg.io_threads,
            staging_blocks: 0,
            dir: cfg.dir.clone(),
            restore: RestoreReport::default(),
            index_tx: Some(tx),
            index_thread: Some(thread),
        })
    }

    /// Reads the index of an earlier process and returns the entries whose slots carry
    /// exactly the stamp it names (and, if they name their tokens, a block's worth of
    /// `block_size`); everything else is ignored (and reported).
    pub fn restore_entries(&mut self, block_size: usize) -> Vec<PersistedBlock> {
        let s = &self.store;
        let entries = match index::read(&self.dir, s.fingerprint(), s.layout(), block_size) {
            Ok(Some(e)) => e,
            Ok(None) => return Vec::new(),
            Err(e) => {
                self.restore.index_ignored = Some(format!("{e:#}"));
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        for e in entries {
            let whole = e.tokens.is_empty() || e.tokens.len() == block_size;
            if whole && s.adopt(e.slot, e.stamp()).is_ok() {
                let content = (!e.tokens.is_empty()).then(|| BlockContent {
                    parent: e.parent,
                    tokens: e.tokens.into(),
                });
                out.push(PersistedBlock {
                    hash: e.hash,
                    slot: e.slot,
                    content,
                });
            } else {
                self.restore.rejected_entries += 1;
            }
        }
        out
    }

    /// Saves the persisted set in the background (coalesced; the newest wins).
    pub fn save_index_async(&self, persisted: Vec<PersistedBlock>) {
        if let Some(tx) = &self.index_tx {
            let _ = tx.send(persisted);
        }
    }

    /// One line describing the tier, for the plan printed at start.
    pub fn describe(&self) -> String {
        let s = &self.store;
        let l = s.layout();
        let mode = match s.io_mode() {
            IoMode::Direct => "O_DIRECT".to_string(),
            IoMode::Buffered { reason } => format!("buffered IO: {reason}"),
        };
        let r = &self.restore;
        let mut line = format!(
            "disk tier: {} slots × {:.1} KiB = {:.2} GiB in {} ({}, {}, {} IO threads, {} staging blocks); \
             prefix blocks restored: {}",
            l.num_slots,
            l.slot_bytes() as f64 / 1024.0,
            l.file_bytes().unwrap_or(u64::MAX) as f64 / (1u64 << 30) as f64,
            s.path().display(),
            store::fs_name(s.path().parent().unwrap_or(Path::new("."))),
            mode,
            self.io_threads,
            self.staging_blocks,
            r.adopted,
        );
        if r.rejected_entries > 0 {
            line += &format!(", {} index entries failed their check", r.rejected_entries);
        }
        if let Some(why) = &r.index_ignored {
            line += &format!("; index ignored: {why}");
        }
        line
    }
}

fn save_index(store: &DiskStore, dir: &Path, persisted: &[PersistedBlock]) -> Result<()> {
    store.sync_data()?; // the slots before the index that names them
    let entries: Vec<IndexEntry> = persisted
        .iter()
        .filter_map(|p| {
            let st = store.expected(p.slot)?;
            Some(IndexEntry {
                hash: p.hash,
                slot: p.slot,
                key: st.key,
                generation: st.generation,
                parent: p.content.as_ref().and_then(|c| c.parent),
                tokens: p.content.as_ref().map_or(Vec::new(), |c| c.tokens.to_vec()),
            })
        })
        .collect();
    index::write(dir, store.fingerprint(), store.layout(), &entries)
}

impl Drop for DiskTier {
    /// Writes the last index snapshot before the process goes.
    fn drop(&mut self) {
        drop(self.index_tx.take());
        if let Some(t) = self.index_thread.take() {
            let _ = t.join();
        }
    }
}
