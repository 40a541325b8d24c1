//! What the offload engine needs from a device: streams and events by id, copies, poison,
//! memory. `CudaOffloadDev` is the GPU; host implementations for tests without one live
//! in `crate::gpucheck::host_offload_dev`.

use super::context::CudaDevice;
use super::exec::Buf;
use super::ops::{dtod, dtoh, htod, poison, DPtr};
use super::trace::Tracer;
use crate::device::cpu::stream::TraceEvent;
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
