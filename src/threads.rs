//! Starting threads: one place for the error a refused `clone` becomes. A process or
//! thread limit (`ulimit -u`, a container's pids limit) makes thread creation fail with
//! EAGAIN; `std::thread::spawn` and tokio's `spawn_blocking` panic then, which left
//! `strata serve` answering "still loading" for ever. Every long-lived thread of strata
//! starts here and its failure is one error line (docs/errors.md).

use std::thread::JoinHandle;

/// Starts a thread named `name` running `f`, or says why it could not.
pub fn spawn<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> anyhow::Result<JoinHandle<T>> {
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(f)
        .map_err(|e| refused(name, &e))
}

/// The error for a thread (`what`) the system would not start.
pub fn refused(what: &str, e: &dyn std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!(
        "cannot start a thread ({what}): {e}; the process or thread limit (`ulimit -u`, a container's pids limit) may be too low"
    )
}

/// Checks that `n` more threads can run at once (started together, then ended), for a
/// library that panics — or worse, deadlocks unwinding — when it cannot start its own
/// (tokio's runtime builder). A check, not a reservation: a limit reached in between
/// still fails there.
pub fn probe(what: &str, n: usize) -> anyhow::Result<()> {
    let mut started = Vec::with_capacity(n);
    let mut result = Ok(());
    for i in 0..n {
        // Each waits until its sender is dropped: all of them are alive at once.
        let (hold, held) = std::sync::mpsc::channel::<()>();
        match std::thread::Builder::new()
            .name(format!("probe-{i}"))
            .spawn(move || {
                let _ = held.recv();
            }) {
            Ok(t) => started.push((hold, t)),
            Err(e) => {
                result = Err(refused(what, &e));
                break;
            }
        }
    }
    for (hold, t) in started {
        drop(hold);
        let _ = t.join();
    }
    result
}
