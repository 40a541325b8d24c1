//! What the offload engine needs from a device: streams and events by id, copies, poison,
//! memory. `CudaOffloadDev` is the GPU. Without one: `HostOffloadDev` runs every copy at
//! once on host memory (waits and records are no-ops: everything is already in order),
//! which checks the engine's data flow — offsets, the decode buffer, flushes, prefetches;
//! `ThreadedHostOffloadDev` runs the copy streams on worker threads with CUDA's event
//! semantics and random delays, which also checks the engine's *ordering*: a missing
//! wait lets a copy and the compute touch a slot in the wrong order.

use super::context::CudaDevice;
use super::exec::Buf;
use super::ops::{dtod, dtoh, htod, poison, DPtr};
use super::trace::Tracer;
use crate::device::cpu::stream::{CpuDevice, Event, OpInfo, Stream, TraceEvent};
use anyhow::{anyhow, Result};
use cudarc::driver::{CudaEvent, CudaStream, PinnedHostSlice};
use std::sync::Arc;

/// 0: compute (the model's stream), 1: H2D prefetch, 2..: the D2H offload pool.
pub type StreamId = usize;
pub const COMPUTE: StreamId = 0;
pub const PREFETCH: StreamId = 1;
pub type EventId = usize;

#[derive(Clone, Copy, Debug)]
pub enum Copy {
    H2D { dst: DPtr, src: *const u8 },
    D2H { dst: *mut u8, src: DPtr },
    D2D { dst: DPtr, src: DPtr },
}

/// Host memory owned by a device: pinned on CUDA.
pub enum HostMem {
    Pinned(PinnedHostSlice<u8>),
    Vec(Vec<u128>),
}

pub trait OffloadDev {
    fn num_offload_streams(&self) -> usize;
    fn new_event(&mut self) -> Result<EventId>;
    fn wait(&self, s: StreamId, e: EventId) -> Result<()>;
    fn record(&self, s: StreamId, e: EventId) -> Result<()>;
    /// # Safety
    /// Both sides of `c` must hold `bytes` and outlive the copy.
    unsafe fn copy(
        &mut self,
        s: StreamId,
        name: &'static str,
        layer: usize,
        c: Copy,
        bytes: usize,
    ) -> Result<()>;
    /// Fills with 0xFF (bf16 NaN).
    ///
    /// # Safety
    /// `dst` must hold `bytes`.
    unsafe fn poison(&self, s: StreamId, dst: DPtr, bytes: usize) -> Result<()>;
    fn sync(&self, s: StreamId) -> Result<()>;
    fn sync_all(&self) -> Result<()>;
    fn alloc_host(&self, bytes: usize) -> Result<(HostMem, *mut u8)>;
    fn alloc_device(&self, bytes: usize) -> Result<(Buf, DPtr)>;
    /// Trace marks around a layer's compute (the host devices trace nothing).
    fn layer_begin(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }
    fn layer_end(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }
    fn set_tracing(&mut self, _on: bool) -> Result<()> {
        Ok(())
    }
    fn take_trace(&mut self) -> Result<Vec<TraceEvent>> {
        Ok(Vec::new())
    }
}

pub struct CudaOffloadDev {
    dev: Arc<CudaDevice>,
    streams: Vec<(Arc<CudaStream>, String)>,
    events: Vec<CudaEvent>,
    tracer: Tracer,
    layer_start: Option<CudaEvent>,
}

fn drv(r: Result<(), cudarc::driver::DriverError>, what: &str) -> Result<()> {
    r.map_err(|e| anyhow!("{what} failed: {e:?}"))
}

impl CudaOffloadDev {
    /// `compute`: the model's stream; `offload_streams` D2H streams are created.
    pub fn new(
        dev: Arc<CudaDevice>,
        compute: Arc<CudaStream>,
        offload_streams: usize,
    ) -> Result<Self> {
        let mut streams = vec![
            (compute, "compute".to_string()),
            (dev.new_stream()?, "h2d-prefetch".to_string()),
        ];
        for i in 0..offload_streams {
            streams.push((dev.new_stream()?, format!("d2h-offload-{i}")));
        }
        Ok(Self {
            dev,
            streams,
            events: Vec::new(),
            tracer: Tracer::default(),
            layer_start: None,
        })
    }
}

impl OffloadDev for CudaOffloadDev {
    fn num_offload_streams(&self) -> usize {
        self.streams.len() - 2
    }

    fn new_event(&mut self) -> Result<EventId> {
        self.events.push(self.dev.new_event()?);
        Ok(self.events.len() - 1)
    }

    fn wait(&self, s: StreamId, e: EventId) -> Result<()> {
        drv(self.streams[s].0.wait(&self.events[e]), "cuStreamWaitEvent")
    }

    fn record(&self, s: StreamId, e: EventId) -> Result<()> {
        drv(self.events[e].record(&self.streams[s].0), "cuEventRecord")
    }

    unsafe fn copy(
        &mut self,
        s: StreamId,
        name: &'static str,
        layer: usize,
        c: Copy,
        bytes: usize,
    ) -> Result<()> {
        let (st, sname) = (&self.streams[s].0, &self.streams[s].1);
        nvtx::range_push!("{name} L{layer} {bytes} B");
        let start = self.tracer.start(&self.dev, st)?;
        match c {
            Copy::H2D { dst, src } => htod(st, dst, src, bytes)?,
            Copy::D2H { dst, src } => dtoh(st, dst, src, bytes)?,
            Copy::D2D { dst, src } => dtod(st, dst, src, bytes)?,
        }
        self.tracer
            .end(&self.dev, st, start, sname, name, Some(layer), bytes)?;
        nvtx::range_pop!();
        Ok(())
    }

    unsafe fn poison(&self, s: StreamId, dst: DPtr, bytes: usize) -> Result<()> {
        poison(&self.streams[s].0, dst, bytes)
    }

    fn sync(&self, s: StreamId) -> Result<()> {
        drv(self.streams[s].0.synchronize(), "cuStreamSynchronize")
    }

    fn sync_all(&self) -> Result<()> {
        (0..self.streams.len()).try_for_each(|s| self.sync(s))
    }

    fn alloc_host(&self, bytes: usize) -> Result<(HostMem, *mut u8)> {
        let mut h = self.dev.alloc_pinned::<u8>(bytes.max(1))?;
        // as_mut_ptr only waits on the slice's own event, never recorded: every copy uses
        // the raw pointer (see ops.rs for why).
        let p = h
            .as_mut_ptr()
            .map_err(|e| anyhow!("pinned host memory: {e:?}"))?;
        Ok((HostMem::Pinned(h), p))
    }

    fn alloc_device(&self, bytes: usize) -> Result<(Buf, DPtr)> {
        let st = &self.streams[COMPUTE].0;
        let b = self.dev.alloc_zeros::<u8>(st, bytes.max(1))?;
        let p = super::ops::dptr(&b, st);
        Ok((Buf::Cuda(b), p))
    }

    fn layer_begin(&mut self, _layer: usize) -> Result<()> {
        self.layer_start = self.tracer.start(&self.dev, &self.streams[COMPUTE].0)?;
        Ok(())
    }

    fn layer_end(&mut self, layer: usize) -> Result<()> {
        let start = self.layer_start.take();
        let (st, name) = (&self.streams[COMPUTE].0, &self.streams[COMPUTE].1);
        self.tracer
            .end(&self.dev, st, start, name, "layer", Some(layer), 0)
    }

    fn set_tracing(&mut self, on: bool) -> Result<()> {
        if on {
            self.tracer.enable(&self.dev, &self.streams[COMPUTE].0)
        } else {
            self.tracer.disable();
            Ok(())
        }
    }

    fn take_trace(&mut self) -> Result<Vec<TraceEvent>> {
        self.tracer.take()
    }
}

/// Everything at once, in program order, on host memory (see the module doc).
pub struct HostOffloadDev {
    pub offload_streams: usize,
}

impl OffloadDev for HostOffloadDev {
    fn num_offload_streams(&self) -> usize {
        self.offload_streams
    }

    fn new_event(&mut self) -> Result<EventId> {
        Ok(0)
    }

    fn wait(&self, _s: StreamId, _e: EventId) -> Result<()> {
        Ok(())
    }

    fn record(&self, _s: StreamId, _e: EventId) -> Result<()> {
        Ok(())
    }

    unsafe fn copy(
        &mut self,
        _s: StreamId,
        _n: &'static str,
        _l: usize,
        c: Copy,
        bytes: usize,
    ) -> Result<()> {
        let (dst, src) = match c {
            Copy::H2D { dst, src } => (dst as *mut u8, src),
            Copy::D2H { dst, src } => (dst, src as *const u8),
            Copy::D2D { dst, src } => (dst as *mut u8, src as *const u8),
        };
        std::ptr::copy(src, dst, bytes);
        Ok(())
    }

    unsafe fn poison(&self, _s: StreamId, dst: DPtr, bytes: usize) -> Result<()> {
        std::ptr::write_bytes(dst as *mut u8, 0xff, bytes);
        Ok(())
    }

    fn sync(&self, _s: StreamId) -> Result<()> {
        Ok(())
    }

    fn sync_all(&self) -> Result<()> {
        Ok(())
    }

    fn alloc_host(&self, bytes: usize) -> Result<(HostMem, *mut u8)> {
        let mut v = vec![0u128; bytes.div_ceil(16).max(1)];
        let p = v.as_mut_ptr() as *mut u8;
        Ok((HostMem::Vec(v), p))
    }

    fn alloc_device(&self, bytes: usize) -> Result<(Buf, DPtr)> {
        let v = vec![0u128; bytes.div_ceil(16).max(1)];
        let p = v.as_ptr() as DPtr;
        Ok((Buf::Host(v), p))
    }
}

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
        HostOffloadDev { offload_streams: 0 }.alloc_host(bytes)
    }

    fn alloc_device(&self, bytes: usize) -> Result<(Buf, DPtr)> {
        HostOffloadDev { offload_streams: 0 }.alloc_device(bytes)
    }
}
