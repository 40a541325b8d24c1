//! A fixed pool of IO threads. Slot reads and writes block in `pread`/`pwrite`, so they
//! run here, several at once (the queue depth an SSD needs), never on the engine thread.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Task = Box<dyn FnOnce() + Send>;

pub struct IoPool {
    tx: Option<Sender<Task>>,
    threads: Vec<JoinHandle<()>>,
}

impl IoPool {
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Task>();
        let rx = Arc::new(Mutex::new(rx));
        let threads = (0..threads.max(1))
            .map(|i| {
                let rx: Arc<Mutex<Receiver<Task>>> = Arc::clone(&rx);
                std::thread::Builder::new()
                    .name(format!("disk-io-{i}"))
                    .spawn(move || loop {
                        let task = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                        match task {
                            Ok(t) => t(),
                            Err(_) => return, // pool dropped
                        }
                    })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Self {
            tx: Some(tx),
            threads,
        })
    }

    pub fn spawn(&self, task: impl FnOnce() + Send + 'static) {
        if let Some(tx) = &self.tx {
            // The threads live as long as the pool, so the send cannot fail.
            let _ = tx.send(Box::new(task));
        }
    }
}

impl Drop for IoPool {
    /// Finishes the queued tasks, then joins the threads.
    fn drop(&mut self) {
        drop(self.tx.take());
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
