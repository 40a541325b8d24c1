//! The disk store: one preallocated file of fixed-size slots, each a header page then the
//! payload, written and read whole with one positioned IO each (`O_DIRECT` when the file
//! system takes it). Every read is checked against what this process wrote (or adopted
//! from the index) before anything uses it.
//!
//! Slot layout (`slot_bytes` = `ALIGN` + payload rounded up to `ALIGN`):
//! ```text
//! [ header: magic, fingerprint, key, generation, payload_len, payload crc, header crc | pad ]
//! [ payload: payload_len bytes | pad to ALIGN ]
//! ```
//! The generation is unique per write (it starts from the wall clock, so a later process
//! never reuses an earlier one's): a slot whose header names another generation is stale,
//! one whose payload checksum differs is torn or flipped; neither is ever used.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use thiserror::Error;

use crate::safe_file;
use crate::serve::block_manager::DiskSlotId;

/// IO alignment for `O_DIRECT`: buffers, offsets and lengths are multiples of it.
pub const ALIGN: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"STRATAKV");
/// The header's bytes at the start of a slot's first page.
pub const HEADER_LEN: usize = 48;
pub const SLOTS_FILE: &str = "strata-kv.slots";

/// A zeroed host buffer aligned to `ALIGN` (what `O_DIRECT` needs; `Vec` gives no such
/// guarantee).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an owned allocation, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` must be a positive multiple of `ALIGN`.
    pub fn zeroed(len: usize) -> Result<Self> {
        anyhow::ensure!(
            len > 0 && len.is_multiple_of(ALIGN),
            "aligned buffer of {len} bytes"
        );
        let layout = Layout::from_size_align(len, ALIGN)?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })
            .with_context(|| format!("out of host memory allocating {len} bytes of staging"))?;
        Ok(Self { ptr, len })
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of len initialized (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this exact layout.
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, ALIGN),
            )
        }
    }
}

/// Positioned IO on the slot file. The production implementation is the file itself;
/// tests wrap it to inject faults (flipped bytes, torn or lost writes, short reads, ENOSPC,
/// EIO, slow IO) and so exercise exactly the code paths a real fault takes.
pub trait SlotIo: Send + Sync {
    /// Reads up to `buf.len()` bytes at `offset`; fewer only at end of file.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Writes `buf` at `offset`; returns the bytes written (fewer is a short write).
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize>;
    /// Makes written data durable (before the index may name it).
    fn sync_data(&self) -> io::Result<()>;
}

struct FileIo(File);

impl SlotIo for FileIo {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.0.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.0.write_at(&buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }
}

/// Slot count and payload size; the file is `num_slots * slot_bytes()` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLayout {
    pub payload_bytes: usize,
    pub num_slots: usize,
}

impl StoreLayout {
    /// A slot's bytes: the header page and the payload rounded up to whole pages
    /// (saturating: a payload that large never passes `file_bytes` and the space check).
    pub fn slot_bytes(&self) -> usize {
        self.payload_bytes
            .div_ceil(ALIGN)
            .saturating_mul(ALIGN)
            .saturating_add(ALIGN)
    }

    /// The slot file's size; `None` if it does not fit in 64 bits.
    pub fn file_bytes(&self) -> Option<u64> {
        (self.slot_bytes() as u64).checked_mul(self.num_slots as u64)
    }

    /// Checks, before anything is created or allocated, that a slot file of this layout
    /// can exist in `dir`: slots addressable by a `DiskSlotId`, a size that fits in 64
    /// bits, and room on the file system. Returns the file's size.
    pub fn check(&self, dir: &Path) -> Result<u64> {
        anyhow::ensure!(
            self.num_slots > 0 && self.payload_bytes > 0,
            "disk store needs slots"
        );
        anyhow::ensure!(
            self.num_slots <= DiskSlotId::MAX as usize,
            "{} disk slots is more than a slot id addresses ({})",
            self.num_slots,
            DiskSlotId::MAX
        );
        let want = self.file_bytes().with_context(|| {
            format!(
                "the disk tier's slot file ({} slots of {} bytes) is larger than 2^64 bytes",
                self.num_slots,
                self.slot_bytes()
            )
        })?;
        if let Ok(m) = std::fs::metadata(dir) {
            anyhow::ensure!(
                m.is_dir(),
                "--disk-offload-dir {}: not a directory",
                dir.display()
            );
        }
        let path = dir.join(SLOTS_FILE);
        safe_file::check_private(&path, "the disk tier's slot file")?;
        check_space(dir, &path, want)?;
        Ok(want)
    }

    fn offset(&self, slot: DiskSlotId) -> u64 {
        slot as u64 * self.slot_bytes() as u64
    }
}

/// How the store does IO, decided once when the file is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoMode {
    Direct,
    /// `O_DIRECT` was refused; IO goes through the page cache (reported, never silent).
    Buffered {
        reason: String,
    },
}

/// What a slot must hold to be used: the key it was written under and that write's
/// generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotStamp {
    pub key: u64,
    pub generation: u64,
}

#[derive(Debug, Error)]
pub enum SlotError {
    #[error("disk IO error: {0}")]
    Io(#[from] io::Error),
    #[error("short {op} on slot {slot}: {got} of {want} bytes")]
    Short {
        op: &'static str,
        slot: DiskSlotId,
        got: usize,
        want: usize,
    },
    #[error("slot {slot} fails its integrity check: {why}")]
    Integrity { slot: DiskSlotId, why: &'static str },
    #[error("slot {0} holds nothing this process wrote or adopted")]
    Unknown(DiskSlotId),
}

/// Counters for the stats; `*_busy_ns` is wall time with at least one IO of that kind in
/// flight, so bytes / busy time is the store's throughput under the engine's load.
#[derive(Debug, Default)]
pub struct DiskCounters {
    pub slots_written: AtomicU64,
    pub slots_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub bytes_read: AtomicU64,
    pub checksum_failures: AtomicU64,
    pub io_errors: AtomicU64,
    write_busy: BusyClock,
    read_busy: BusyClock,
}

/// Wall time during which at least one operation was in flight.
#[derive(Debug, Default)]
struct BusyClock(Mutex<(usize, Option<Instant>, Duration)>);

impl BusyClock {
    fn begin(&self) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if g.0 == 0 {
            g.1 = Some(Instant::now());
        }
        g.0 += 1;
    }

    fn end(&self) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.0 -= 1;
        if g.0 == 0 {
            if let Some(t) = g.1.take() {
                g.2 += t.elapsed();
            }
        }
    }

    fn total(&self) -> Duration {
        let g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.2 + g.1.map_or(Duration::ZERO, |t| t.elapsed())
    }
}

/// A snapshot of the store's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DiskStats {
    pub slots_written: u64,
    pub slots_read: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub write_busy_s: f64,
    pub read_busy_s: f64,
    pub checksum_failures: u64,
    pub io_errors: u64,
}

impl DiskStats {
    pub fn write_gbps(&self) -> f64 {
        gbps(self.bytes_written, self.write_busy_s)
    }
    pub fn read_gbps(&self) -> f64 {
        gbps(self.bytes_read, self.read_busy_s)
    }
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

pub struct DiskStore {
    path: PathBuf,
    io: Box<dyn SlotIo>,
    layout: StoreLayout,
    fingerprint: u64,
    mode: IoMode,
    /// What each slot in use must hold; absent while a write is in flight, after one
    /// failed, and for slots never written (a map: memory follows use, not capacity).
    expected: Mutex<HashMap<DiskSlotId, SlotStamp>>,
    next_generation: AtomicU64,
    pub counters: DiskCounters,
    /// Holds the exclusive `flock` on the slot file for the store's life.
    _lock: File,
}

impl DiskStore {
    /// Opens (creating and preallocating as needed) the slot file in `dir`. A file of
    /// another size is discarded. `wrap` lets tests inject faults below the store.
    pub fn open(
        dir: &Path,
        layout: StoreLayout,
        fingerprint: u64,
        wrap: impl FnOnce(Box<dyn SlotIo>) -> Box<dyn SlotIo>,
    ) -> Result<Self> {
        let path = dir.join(SLOTS_FILE);
        let want = layout.check(dir)?;
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create --disk-offload-dir {}", dir.display()))?;
        // Never through a link, never another kind of file, never a file another name
        // shares (checked again on the handle): the slot file is truncated and overwritten.
        let lock = safe_file::open_private(&path, "the disk tier's slot file")?;
        lock_exclusive(&lock, &path)?;
        let fs = fs_name(dir);
        if lock.metadata()?.len() != want {
            lock.set_len(0)?; // another layout: nothing in it can be trusted
        }
        // SAFETY: fallocate on an open descriptor; the range is within i64 (checked).
        let len = i64::try_from(want).context("disk store size overflows")?;
        let rc = unsafe { libc::fallocate(lock.as_raw_fd(), 0, 0, len) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EOPNOTSUPP) => bail!(
                    "cannot preallocate {}: the {fs} file system does not support fallocate; \
                     put --disk-offload-dir on ext4, xfs or btrfs",
                    path.display()
                ),
                Some(libc::ENOSPC) => bail!(
                    "not enough space for the disk tier: {} needs {} on {fs}",
                    path.display(),
                    safe_file::human_bytes(want)
                ),
                _ => bail!("cannot preallocate {} on {fs}: {e}", path.display()),
            }
        }
        let (file, mode) = match open_direct(&path, &lock) {
            Ok(f) => (f, IoMode::Direct),
            Err(e) => (
                lock.try_clone()?,
                IoMode::Buffered {
                    reason: format!("{fs} refused O_DIRECT ({e})"),
                },
            ),
        };
        let start = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Ok(Self {
            path,
            io: wrap(Box::new(FileIo(file))),
            layout,
            fingerprint,
            mode,
            expected: Mutex::new(HashMap::new()),
            next_generation: AtomicU64::new(start),
            counters: DiskCounters::default(),
            _lock: lock,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn layout(&self) -> StoreLayout {
        self.layout
    }

    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    pub fn io_mode(&self) -> &IoMode {
        &self.mode
    }

    /// A zeroed staging buffer for one slot.
    pub fn slot_buffer(&self) -> Result<AlignedBuf> {
        AlignedBuf::zeroed(self.layout.slot_bytes())
    }

    /// The payload part of a slot buffer.
    pub fn payload_mut<'a>(&self, buf: &'a mut AlignedBuf) -> &'a mut [u8] {
        &mut buf.as_mut_slice()[ALIGN..ALIGN + self.layout.payload_bytes]
    }

    pub fn payload<'a>(&self, buf: &'a AlignedBuf) -> &'a [u8] {
        &buf.as_slice()[ALIGN..ALIGN + self.layout.payload_bytes]
    }

    fn set_expected(&self, slot: DiskSlotId, stamp: Option<SlotStamp>) {
        let mut e = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        match stamp {
            Some(st) => e.insert(slot, st),
            None => e.remove(&slot),
        };
    }

    pub fn expected(&self, slot: DiskSlotId) -> Option<SlotStamp> {
        let e = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        e.get(&slot).copied()
    }

    fn check_slot(&self, slot: DiskSlotId) -> Result<(), SlotError> {
        if slot as usize >= self.layout.num_slots {
            return Err(SlotError::Integrity {
                slot,
                why: "slot out of range",
            });
        }
        Ok(())
    }

    /// Writes the payload already placed in `buf` (see `payload_mut`) to `slot` under
    /// `key`, with a fresh generation. The slot is untrusted until the write has succeeded.
    pub fn write_slot(
        &self,
        slot: DiskSlotId,
        key: u64,
        buf: &mut AlignedBuf,
    ) -> Result<SlotStamp, SlotError> {
        self.check_slot(slot)?;
        self.set_expected(slot, None);
        let stamp = SlotStamp {
            key,
            generation: self.next_generation.fetch_add(1, Ordering::Relaxed),
        };
        let header = SlotHeader {
            fingerprint: self.fingerprint,
            key,
            generation: stamp.generation,
            payload_len: self.layout.payload_bytes as u64,
            checksum: crc32fast::hash(self.payload(buf)),
        };
        header.encode(&mut buf.as_mut_slice()[..HEADER_LEN]);
        let c = &self.counters;
        c.write_busy.begin();
        let r = self.io.write_at(buf.as_slice(), self.layout.offset(slot));
        c.write_busy.end();
        let want = buf.as_slice().len();
        match r {
            Ok(n) if n == want => {
                c.slots_written.fetch_add(1, Ordering::Relaxed);
                c.bytes_written.fetch_add(want as u64, Ordering::Relaxed);
                self.set_expected(slot, Some(stamp));
                Ok(stamp)
            }
            Ok(got) => {
                c.io_errors.fetch_add(1, Ordering::Relaxed);
                Err(SlotError::Short {
                    op: "write",
                    slot,
                    got,
                    want,
                })
            }
            Err(e) => {
                c.io_errors.fetch_add(1, Ordering::Relaxed);
                Err(e.into())
            }
        }
    }

    /// Reads `slot` into `buf` and checks it is exactly what was last written there (or
    /// adopted) for `key`: header, fingerprint, key, generation, length, payload checksum.
    pub fn read_slot(
        &self,
        slot: DiskSlotId,
        key: u64,
        buf: &mut AlignedBuf,
    ) -> Result<(), SlotError> {
        self.check_slot(slot)?;
        let stamp = self.expected(slot).ok_or(SlotError::Unknown(slot))?;
        if stamp.key != key {
            self.counters
                .checksum_failures
                .fetch_add(1, Ordering::Relaxed);
            return Err(SlotError::Integrity {
                slot,
                why: "holds another block",
            });
        }
        let c = &self.counters;
        c.read_busy.begin();
        let r = self
            .io
            .read_at(buf.as_mut_slice(), self.layout.offset(slot));
        c.read_busy.end();
        let want = buf.as_slice().len();
        match r {
            Ok(n) if n == want => {}
            Ok(got) => {
                c.io_errors.fetch_add(1, Ordering::Relaxed);
                return Err(SlotError::Short {
                    op: "read",
                    slot,
                    got,
                    want,
                });
            }
            Err(e) => {
                c.io_errors.fetch_add(1, Ordering::Relaxed);
                return Err(e.into());
            }
        }
        c.bytes_read.fetch_add(want as u64, Ordering::Relaxed);
        let verdict = self.verify(slot, stamp, buf.as_slice(), true);
        if verdict.is_err() {
            c.checksum_failures.fetch_add(1, Ordering::Relaxed);
        } else {
            c.slots_read.fetch_add(1, Ordering::Relaxed);
        }
        verdict
    }

    fn verify(
        &self,
        slot: DiskSlotId,
        stamp: SlotStamp,
        bytes: &[u8],
        payload: bool,
    ) -> Result<(), SlotError> {
        let bad = |why| Err(SlotError::Integrity { slot, why });
        let Some(h) = SlotHeader::decode(&bytes[..HEADER_LEN]) else {
            return bad("bad header (magic or header checksum)");
        };
        if h.fingerprint != self.fingerprint {
            return bad("written for another model or configuration");
        }
        if h.generation != stamp.generation {
            return bad("stale generation");
        }
        if h.key != stamp.key {
            return bad("holds another block");
        }
        if h.payload_len != self.layout.payload_bytes as u64 {
            return bad("wrong payload length");
        }
        if payload
            && crc32fast::hash(&bytes[ALIGN..ALIGN + self.layout.payload_bytes]) != h.checksum
        {
            return bad("payload checksum mismatch");
        }
        Ok(())
    }

    /// Trusts `slot` to hold `stamp` (from the index of an earlier process) if its header
    /// says so; the payload checksum is still verified on every read.
    pub fn adopt(&self, slot: DiskSlotId, stamp: SlotStamp) -> Result<(), SlotError> {
        self.check_slot(slot)?;
        let mut buf = AlignedBuf::zeroed(ALIGN).map_err(io::Error::other)?;
        let n = self
            .io
            .read_at(buf.as_mut_slice(), self.layout.offset(slot))?;
        if n != ALIGN {
            return Err(SlotError::Short {
                op: "read",
                slot,
                got: n,
                want: ALIGN,
            });
        }
        if let Err(e) = self.verify(slot, stamp, buf.as_slice(), false) {
            self.counters
                .checksum_failures
                .fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        self.next_generation
            .fetch_max(stamp.generation + 1, Ordering::Relaxed);
        self.set_expected(slot, Some(stamp));
        Ok(())
    }

    /// Forgets what a slot holds (it was freed): a later read of it fails.
    pub fn forget(&self, slot: DiskSlotId) {
        if (slot as usize) < self.layout.num_slots {
            self.set_expected(slot, None);
        }
    }

    pub fn sync_data(&self) -> io::Result<()> {
        self.io.sync_data()
    }

    pub fn stats(&self) -> DiskStats {
        let c = &self.counters;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DiskStats {
            slots_written: ld(&c.slots_written),
            slots_read: ld(&c.slots_read),
            bytes_written: ld(&c.bytes_written),
            bytes_read: ld(&c.bytes_read),
            write_busy_s: c.write_busy.total().as_secs_f64(),
            read_busy_s: c.read_busy.total().as_secs_f64(),
            checksum_failures: ld(&c.checksum_failures),
            io_errors: ld(&c.io_errors),
        }
    }
}

/// Takes the exclusive lock that makes a slot file one process's, or says who has it.
fn lock_exclusive(file: &File, path: &Path) -> Result<()> {
    // SAFETY: flock on an open descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        bail!(
            "{} is in use by another strata process (one disk tier per directory)",
            path.display()
        );
    }
    Ok(())
}

/// Fails if the slot file in `dir` exists and another process holds it: checked with the
/// flags, before a server binds its port or prints that it listens (the lock itself is
/// taken when the store opens). A file that is not there, or not a regular file, is left
/// for `StoreLayout::check` and `open` to judge.
pub fn check_not_in_use(dir: &Path) -> Result<()> {
    let path = dir.join(SLOTS_FILE);
    let Ok(f) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
    else {
        return Ok(());
    };
    if !f.metadata().is_ok_and(|m| m.is_file()) {
        return Ok(());
    }
    lock_exclusive(&f, &path) // released as `f` closes
}

/// The slot file reopened with `O_DIRECT` (not through a link, and only if it is still the
/// file `locked` holds).
fn open_direct(path: &Path, locked: &File) -> io::Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    if !safe_file::same_file(&f.metadata()?, &locked.metadata()?) {
        return Err(io::Error::other(
            "the slot file was replaced while being opened",
        ));
    }
    // Some file systems accept the flag at open and refuse the IO: probe one read.
    let mut buf = AlignedBuf::zeroed(ALIGN).map_err(io::Error::other)?;
    f.read_at(buf.as_mut_slice(), 0)?;
    Ok(f)
}

/// Refuses a slot file of `want` bytes that the file system holding `dir` has no room
/// for (counting the space an existing slot file already takes), before anything is
/// allocated or created for it.
pub fn check_space(dir: &Path, path: &Path, want: u64) -> Result<()> {
    // The directory may not exist yet: its nearest existing ancestor is on the same
    // file system (unless a mount is created in between, which fallocate then catches).
    let existing = dir
        .ancestors()
        .find(|d| d.exists())
        .unwrap_or(Path::new("."));
    let Some(free) = safe_file::free_bytes(existing) else {
        return Ok(()); // unknown: fallocate reports ENOSPC clearly
    };
    // An existing slot file of ours gives its blocks back when it is reused.
    let reusable = std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map_or(0, |m| {
            use std::os::unix::fs::MetadataExt;
            m.blocks().saturating_mul(512)
        });
    let room = free.saturating_add(reusable);
    if want > room {
        bail!(
            "not enough space for the disk tier: {} needs {} ({want} bytes) but {} has {} free; lower --max-disk-offload-blocks",
            path.display(),
            safe_file::human_bytes(want),
            fs_name(existing),
            safe_file::human_bytes(room)
        );
    }
    Ok(())
}

/// The file system's name, for error messages and the plan.
pub fn fs_name(dir: &Path) -> String {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return "unknown".into();
    };
    // SAFETY: statfs fills the zeroed struct for a valid C string path.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut s) } != 0 {
        return "unknown".into();
    }
    match s.f_type as i64 {
        0xEF53 => "ext4".into(),
        0x0102_1994 => "tmpfs".into(),
        0x794C_7630 => "overlayfs".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683E => "btrfs".into(),
        0x6969 => "nfs".into(),
        0x2FC1_2FC1 => "zfs".into(),
        0x6573_5546 => "fuse".into(),
        0xF2F5_2010 => "f2fs".into(),
        t => format!("file system 0x{t:x}"),
    }
}

/// The slot header, little-endian, with its own checksum so a torn header is caught.
/// Public for the fuzzer (`fuzz::disk`), which re-seals headers it rewrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotHeader {
    pub fingerprint: u64,
    pub key: u64,
    pub generation: u64,
    pub payload_len: u64,
    /// CRC32 of the payload.
    pub checksum: u32,
}

impl SlotHeader {
    /// Writes the header, and its own checksum, into `out[..HEADER_LEN]`.
    pub fn encode(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        out[8..16].copy_from_slice(&self.fingerprint.to_le_bytes());
        out[16..24].copy_from_slice(&self.key.to_le_bytes());
        out[24..32].copy_from_slice(&self.generation.to_le_bytes());
        out[32..40].copy_from_slice(&self.payload_len.to_le_bytes());
        out[40..44].copy_from_slice(&self.checksum.to_le_bytes());
        let hc = crc32fast::hash(&out[0..44]);
        out[44..48].copy_from_slice(&hc.to_le_bytes());
    }

    /// The header in `b[..HEADER_LEN]`, if `b` is that long and its magic and checksum
    /// are right.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b = b.get(..HEADER_LEN)?;
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        if u64_at(0) != MAGIC || crc32fast::hash(&b[0..44]) != u32_at(44) {
            return None;
        }
        Some(Self {
            fingerprint: u64_at(8),
            key: u64_at(16),
            generation: u64_at(24),
            payload_len: u64_at(32),
            checksum: u32_at(40),
        })
    }
}
