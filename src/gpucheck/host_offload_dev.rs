//! The CUDA offload engine's device interface on host memory, for checking the engine
//! without a GPU: `ThreadedHostOffloadDev` runs the copy streams on worker threads with
//! CUDA's event semantics (and, optionally, random delays), which checks the engine's data
//! flow — offsets, the decode buffer, flushes, prefetches — and its *ordering*: a missing
//! wait lets a copy and the compute touch a slot in the wrong order.

use crate::device::cpu::stream::{CpuDevice, Event, OpInfo, Stream};
use crate::device::cuda::exec::Buf;
use crate::device::cuda::offload_dev::{Copy, EventId, HostMem, OffloadDev, StreamId};
use crate::device::cuda::ops::DPtr;
use anyhow::Result;

/// The copy streams as worker threads (the CPU device's `Stream`: in-order queues, events
/// with CUDA semantics); the compute stream is the host thread itself, since the kernel
/// emulator and the host twin run each kernel at its launch. So a wait on the compute
/// stream blocks the host until the event completes, and a record on it completes at
/// once. With `delay`, every copy and poison first sleeps a random while: offloads (D2H)
/// 10–30 ms, longer than a few layers of emulated compute, so a slot reused without
/// waiting for its offload is overwritten before the offload reads it; everything else
/// up to 0.5 ms, enough for compute to outrun a prefetch it does not wait for (decode
/// steps are short). Either missing wait changes the tokens.
pub struct ThreadedHostOffloadDev {
    streams: Vec<Option<Stream>>, // [COMPUTE] = None: the host thread
    events: Vec<Event>,
    delay: bool,
}

impl ThreadedHostOffloadDev {
    pub fn new(offload_streams: usize, delay: bool) -> Self {
        let dev = CpuDevice::new(0.0, false);
        let mut streams = vec![None, Some(Stream::new(&dev, "h2d-prefetch"))];
        for i in 0..offload_streams {
            streams.push(Some(Stream::new(&dev, &format!("d2h-offload-{i}"))));
        }
        Self {
            streams,
            events: Vec::new(),
            delay,
        }
    }

    /// Runs `f` now on the host (compute) or enqueues it on stream `s`.
    /// `long`: delay by more than a few layers of emulated compute.
    fn run(
        &self,
        s: StreamId,
        name: &'static str,
        bytes: usize,
        long: bool,
        f: impl FnOnce() + Send + 'static,
    ) {
        match &self.streams[s] {
            None => f(),
            Some(st) => {
                let delay = self.delay;
                let info = OpInfo {
                    name,
                    layer: None,
                    bytes,
                };
                st.launch(info, move || {
                    if delay {
                        let us = if long {
                            rand::random_range(10_000..30_000)
                        } else {
                            rand::random_range(0..500)
                        };
                        std::thread::sleep(std::time::Duration::from_micros(us));
                    }
                    f()
                });
            }
        }
    }
}

impl OffloadDev for ThreadedHostOffloadDev {
    fn num_offload_streams(&self) -> usize {
        self.streams.len() - 2
    }

    fn new_event(&mut self) -> Result<EventId> {
        self.events.push(Event::new());
        Ok(self.events.len() - 1)
    }

    fn wait(&self, s: StreamId, e: EventId) -> Result<()> {
        match &self.streams[s] {
            None => self.events[e].synchronize(),
            Some(st) => st.wait(&self.events[e], "event"),
        }
        Ok(())
    }

    fn record(&self, s: StreamId, e: EventId) -> Result<()> {
        let ev = &self.events[e];
        match &self.streams[s] {
            None => ev.complete_on_host(ev.record_on_host()),
            Some(st) => st.record(ev),
        }
        Ok(())
    }

    unsafe fn copy(
        &mut self,
        s: StreamId,
        name: &'static str,
        _l: usize,
        c: Copy,
        bytes: usize,
    ) -> Result<()> {
        // Addresses as integers: the worker thread only dereferences them when the
        // engine's events say the memory is ready (the contract under test).
        let (dst, src) = match c {
            Copy::H2D { dst, src } => (dst as usize, src as usize),
            Copy::D2H { dst, src } => (dst as usize, src as usize),
            Copy::D2D { dst, src } => (dst as usize, src as usize),
        };
        let offload = matches!(c, Copy::D2H { .. });
        self.run(s, name, bytes, offload, move || {
            // SAFETY: the caller vouches both ranges hold `bytes` and outlive the copy.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) }
        });
        Ok(())
    }

    unsafe fn poison(&self, s: StreamId, dst: DPtr, bytes: usize) -> Result<()> {
        let dst = dst as usize;
        self.run(s, "poison", bytes, false, move || {
            // SAFETY: the caller vouches `dst` holds `bytes`.
            unsafe { std::ptr::write_bytes(dst as *mut u8, 0xff, bytes) }
        });
        Ok(())
    }

    fn sync(&self, s: StreamId) -> Result<()> {
        if let Some(st) = &self.streams[s] {
            st.synchronize();
        }
        Ok(())
    }

    fn sync_all(&self) -> Result<()> {
        (0..self.streams.len()).try_for_each(|s| self.sync(s))
    }

    fn alloc_host(&self, bytes: usize) -> Result<(HostMem, *mut u8)> {
        let mut v = vec![0u128; bytes.div_ceil(16).max(1)]; // 16-byte aligned
        let p = v.as_mut_ptr() as *mut u8;
        Ok((HostMem::Vec(v), p))
    }

    fn alloc_device(&self, bytes: usize) -> Result<(Buf, DPtr)> {
        let v = vec![0u128; bytes.div_ceil(16).max(1)];
        let p = v.as_ptr() as DPtr;
        Ok((Buf::Host(v), p))
    }
}
