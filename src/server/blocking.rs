//! The threads that render chat templates and tokenize prompts off the async workers: a
//! fixed pool started with the server, one per core (so at most that many run at once;
//! admitted requests queue for a turn). Not tokio's blocking pool, which starts threads on
//! demand and panics when it cannot: under a process or thread limit every request died
//! mid-connection. Here a thread that cannot start is an error at start-up, and a job that
//! panics is an error answer, its thread kept.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

use anyhow::Result;
use tokio::sync::oneshot;

use super::error::ApiError;

type Job = Box<dyn FnOnce() + Send>;

pub struct BlockingPool {
    tx: Mutex<Sender<Job>>,
}

impl BlockingPool {
    /// Starts `threads` threads (at least one).
    pub fn new(threads: usize) -> Result<Self> {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx: Arc<Mutex<Receiver<Job>>> = Arc::clone(&rx);
            crate::threads::spawn(&format!("strata-tokenize-{i}"), move || loop {
                let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                match job {
                    Ok(job) => job(),
                    Err(_) => return, // the pool is gone
                }
            })?;
        }
        Ok(Self { tx: Mutex::new(tx) })
    }

    /// Runs `f` on a pool thread and waits for its answer.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let (done, answer) = oneshot::channel();
        let job: Job = Box::new(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .unwrap_or_else(|_| Err(ApiError::internal("tokenizing the request failed")));
            let _ = done.send(r);
        });
        self.tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
        answer
            .await
            .map_err(|_| ApiError::unavailable("the server is shutting down"))?
    }
}
