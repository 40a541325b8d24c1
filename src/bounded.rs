//! Running untrusted work (a model file's chat template, a fuzz case) with a memory and a
//! time budget, failing with an error instead of exhausting the machine.
//!
//! Rust cannot turn an allocation failure into an error, and a template engine's values
//! (a string doubled by `~` forty times) are not bounded by its instruction fuel. So the
//! work runs on its own thread, and the global allocator (`BudgetAlloc`, installed for
//! every binary of the crate) counts that thread's live bytes: an allocation that would
//! pass the budget never returns; it raises the work's flag and parks the thread for good.
//! The caller sees the flag (or the deadline) and returns an error; the parked thread and
//! the memory it held, at most the budget, are leaked, which a process can afford for a
//! rare hostile input.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The budget of one piece of work.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most bytes the work's thread may hold at once.
    pub memory_bytes: usize,
    /// Longest the caller waits; the work is abandoned (its thread left running) after it.
    pub time: Duration,
    /// Stack of the work's thread (an overflow aborts the process: size it for the work).
    pub stack_bytes: usize,
}

/// The stack a spawned Rust thread gets by default.
pub const DEFAULT_STACK_BYTES: usize = 2 << 20;

/// Why bounded work did not finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exceeded {
    Memory,
    Time,
    /// No thread with the asked-for stack could be started (the machine is out of memory
    /// or of threads).
    NoThread,
}

impl std::fmt::Display for Exceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exceeded::Memory => f.write_str("memory budget exceeded"),
            Exceeded::Time => f.write_str("time budget exceeded"),
            Exceeded::NoThread => f.write_str("no thread could be started for it"),
        }
    }
}

thread_local! {
    /// Budget of this thread's live bytes; `usize::MAX` = not counted.
    static LIMIT: Cell<usize> = const { Cell::new(usize::MAX) };
    static LIVE: Cell<usize> = const { Cell::new(0) };
    /// The flag `run` watches, raised when the budget is passed.
    static FLAG: Cell<*const AtomicBool> = const { Cell::new(std::ptr::null()) };
    /// Set on bounded threads: their panics go back to the caller, who reports them.
    static QUIET_PANICS: Cell<bool> = const { Cell::new(false) };
}

/// Keeps the panic hook from printing (message, location, backtrace) for panics of bounded
/// work: they are returned to the caller, and a hostile input must not fill the log.
fn quiet_bounded_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET_PANICS.try_with(Cell::get).unwrap_or(false) {
                previous(info);
            }
        }));
    });
}

/// The message of a caught panic (its payload, when it is a string).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

/// Work abandoned so far (parked over its memory budget, or left running past its time).
static ABANDONED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many pieces of work this process has abandoned: each may still hold up to its
/// memory budget (the fuzzer restarts its worker process when this grows).
pub fn abandoned() -> usize {
    ABANDONED.load(Ordering::Relaxed)
}

/// The system allocator, counting the bytes of threads running under `run`.
pub struct BudgetAlloc;

// SAFETY: every call is forwarded to `System` unchanged; the bookkeeping only reads and
// writes this thread's const-initialised cells (no allocation, no unwinding).
unsafe impl GlobalAlloc for BudgetAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        refund(layout.size());
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            charge(new_size - layout.size());
        } else {
            refund(layout.size() - new_size);
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: BudgetAlloc = BudgetAlloc;

fn charge(bytes: usize) {
    // `try_with`: during thread teardown the cells may be gone; nothing is counted then.
    let Ok(limit) = LIMIT.try_with(Cell::get) else {
        return;
    };
    if limit == usize::MAX {
        return;
    }
    let Ok(live) = LIVE.try_with(|c| {
        let live = c.get().saturating_add(bytes);
        c.set(live);
        live
    }) else {
        return;
    };
    if live > limit {
        let flag = FLAG.try_with(Cell::get).unwrap_or(std::ptr::null());
        if !flag.is_null() {
            // SAFETY: `run` leaks one strong count of the flag to this thread.
            unsafe { (*flag).store(true, Ordering::SeqCst) };
        }
        loop {
            std::thread::park();
        }
    }
}

fn refund(bytes: usize) {
    let _ = LIVE.try_with(|c| c.set(c.get().saturating_sub(bytes)));
}

/// Runs `work` on a thread of its own under `limits`. A panic in `work` is resumed here
/// (without the panic hook printing it: the caller reports it).
pub fn run<T: Send + 'static>(
    limits: Limits,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Exceeded> {
    quiet_bounded_panics();
    let flag = Arc::new(AtomicBool::new(false));
    let leaked = Arc::into_raw(Arc::clone(&flag)) as usize;
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("bounded".into())
        .stack_size(limits.stack_bytes)
        .spawn(move || {
            QUIET_PANICS.with(|q| q.set(true));
            FLAG.with(|f| f.set(leaked as *const AtomicBool));
            LIVE.with(|c| c.set(0));
            LIMIT.with(|c| c.set(limits.memory_bytes));
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
            LIMIT.with(|c| c.set(usize::MAX));
            FLAG.with(|f| f.set(std::ptr::null()));
            // SAFETY: the count leaked above, given back now that nothing reads it.
            drop(unsafe { Arc::from_raw(leaked as *const AtomicBool) });
            let _ = tx.send(out);
        });
    let Ok(handle) = handle else {
        // SAFETY: the thread never started, so the count leaked for it is still ours.
        drop(unsafe { Arc::from_raw(leaked as *const AtomicBool) });
        return Err(Exceeded::NoThread);
    };
    let start = Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_millis(5)) {
            Ok(Ok(v)) => {
                let _ = handle.join();
                return Ok(v);
            }
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                unreachable!("the bounded thread sends before it ends")
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if flag.load(Ordering::SeqCst) {
                    ABANDONED.fetch_add(1, Ordering::Relaxed);
                    return Err(Exceeded::Memory);
                }
                if start.elapsed() > limits.time {
                    ABANDONED.fetch_add(1, Ordering::Relaxed);
                    return Err(Exceeded::Time);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: Limits = Limits {
        memory_bytes: 64 << 20,
        time: Duration::from_secs(20),
        stack_bytes: DEFAULT_STACK_BYTES,
    };

    #[test]
    fn work_within_budget_returns_its_value() {
        assert_eq!(run(SMALL, || vec![1u8; 1 << 20].len()), Ok(1 << 20));
    }

    #[test]
    fn an_allocation_past_the_budget_is_an_error_not_an_abort() {
        let r = run(SMALL, || vec![1u8; 1 << 30].len());
        assert_eq!(r, Err(Exceeded::Memory));
        // Growth by doubling is caught as well.
        let r = run(SMALL, || {
            let mut s = String::from("ab");
            for _ in 0..40 {
                s = format!("{s}{s}");
            }
            s.len()
        });
        assert_eq!(r, Err(Exceeded::Memory));
    }

    #[test]
    fn freed_memory_is_refunded() {
        let r = run(SMALL, || {
            for _ in 0..100 {
                drop(vec![0u8; 32 << 20]);
            }
        });
        assert_eq!(r, Ok(()));
    }

    #[test]
    fn work_past_its_deadline_is_abandoned() {
        let limits = Limits {
            time: Duration::from_millis(50),
            ..SMALL
        };
        let r = run(limits, || std::thread::sleep(Duration::from_secs(2)));
        assert_eq!(r, Err(Exceeded::Time));
    }
}
