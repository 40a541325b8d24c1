//! Model files stay memory-mapped — the weights share the page cache, and a multi-GiB file
//! is not copied — and a file truncated underneath its mapping cannot kill the process.
//!
//! Reading a mapped page that the file no longer has raises SIGBUS, which by default ends
//! the process mid-request (the server loses every request in flight). Of the ways out, a
//! private copy doubles the memory of every model for a rare mistake, and a lease is only
//! granted to the file's owner and only warns. So the fault is made survivable instead: a
//! SIGBUS handler that finds the faulting address inside a registered model mapping maps a
//! zero page over it (anonymous, `MAP_FIXED`), records that the file changed (`changed`),
//! and returns, so the read completes with zeros. Whoever used the weights checks
//! `changed()` and fails with an error; the server answers 503 from then on (its weights
//! are no longer the file's: restart it). A fault anywhere else goes to the handler that
//! was there before (Rust's stack-overflow reporter, or the default action).

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

use anyhow::{bail, Result};

/// Mappings watched at once (a model is a handful of files).
const SLOTS: usize = 64;
/// `[start, end)` of each watched mapping; 0, 0 = free.
static STARTS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static ENDS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static CHANGED: AtomicBool = AtomicBool::new(false);
static PAGE: AtomicUsize = AtomicUsize::new(4096);
/// The SIGBUS action before ours, for faults outside model mappings.
static mut PREVIOUS: Option<libc::sigaction> = None;
static INSTALL: Once = Once::new();

/// Whether a mapped model file shrank under this process (its weights now read zeros).
pub fn changed() -> bool {
    CHANGED.load(Ordering::SeqCst)
}

/// An error if a mapped model file changed underneath this process.
pub fn check_unchanged() -> Result<()> {
    if changed() {
        bail!("a model file was truncated or replaced while it was mapped; the weights read since are not the file's (restart)");
    }
    Ok(())
}

/// A read-only map of a model file, watched for truncation while it lives.
pub struct ModelMap {
    map: memmap2::Mmap,
    slot: Option<usize>,
}

impl ModelMap {
    pub fn map(file: &std::fs::File) -> std::io::Result<Self> {
        install();
        // SAFETY: read-only; a file truncated under the map is caught by the handler above
        // (reads see zeros, `changed()` is set); one rewritten in place is the user's.
        let map = unsafe { memmap2::Mmap::map(file) }?;
        let (start, end) = (map.as_ptr() as usize, map.as_ptr() as usize + map.len());
        let slot = (0..SLOTS).find(|&i| {
            STARTS[i]
                .compare_exchange(0, start, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        });
        if let Some(i) = slot {
            ENDS[i].store(end, Ordering::SeqCst);
        }
        Ok(Self { map, slot })
    }
}

impl Deref for ModelMap {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl Drop for ModelMap {
    fn drop(&mut self) {
        // Unwatched before the map goes: a later mapping may reuse the addresses.
        if let Some(i) = self.slot {
            ENDS[i].store(0, Ordering::SeqCst);
            STARTS[i].store(0, Ordering::SeqCst);
        }
    }
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: sysconf has no preconditions; sigaction gets valid, owned structs, and
        // PREVIOUS is written once here, before our handler can run.
        unsafe {
            PAGE.store(
                libc::sysconf(libc::_SC_PAGESIZE).max(4096) as usize,
                Ordering::SeqCst,
            );
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &action, &mut old) == 0 {
                PREVIOUS = Some(old);
            }
        }
    });
}

/// The SIGBUS handler: async-signal-safe (atomics, `mmap`, `sigaction` only).
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let page = PAGE.load(Ordering::Relaxed);
    let watched = (0..SLOTS).any(|i| {
        let (s, e) = (
            STARTS[i].load(Ordering::SeqCst),
            ENDS[i].load(Ordering::SeqCst),
        );
        s != 0 && (s..e).contains(&addr)
    });
    if watched {
        let at = addr / page * page;
        // SAFETY: replaces one page of a read-only model mapping with a zero page; no Rust
        // object owns that page's contents beyond reading them.
        let p = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            CHANGED.store(true, Ordering::SeqCst);
            return; // the read is retried and sees zeros
        }
    }
    // Not ours: hand the fault to whoever had it before.
    // SAFETY: PREVIOUS was written before this handler was installed, and is only read.
    let previous = unsafe { *std::ptr::addr_of!(PREVIOUS) };
    match previous {
        Some(old) if old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN => {
            if old.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the previous handler was installed as an SA_SIGINFO handler.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(old.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: as above, a plain handler.
                let f: extern "C" fn(libc::c_int) =
                    unsafe { std::mem::transmute(old.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // The default action: restore it; returning re-runs the read, which faults again
            // and ends the process as it would have without us.
            // SAFETY: a valid, zeroed sigaction asking for SIG_DFL.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            }
        }
    }
}
