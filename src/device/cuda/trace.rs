//! Timed CUDA events around each traced op, turned into the CPU device's `TraceEvent`s
//! (microseconds since a base event on the compute stream), so `--trace-out` writes the
//! same Chrome/Perfetto trace on both devices. Off by default: timed events cost more
//! to record than the timing-free ones the engine orders its streams with.

use super::context::CudaDevice;
use crate::device::cpu::stream::TraceEvent;
use anyhow::{anyhow, Result};
use cudarc::driver::{sys, CudaEvent, CudaStream};

struct Op {
    stream: String,
    name: &'static str,
    layer: Option<usize>,
    bytes: usize,
    start: CudaEvent,
    end: CudaEvent,
}

#[derive(Default)]
pub struct Tracer {
    base: Option<CudaEvent>,
    ops: Vec<Op>,
}

fn timed(dev: &CudaDevice) -> Result<CudaEvent> {
    dev.context()
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| anyhow!("cuEventCreate failed: {e:?}"))
}

fn rec(e: &CudaEvent, st: &CudaStream) -> Result<()> {
    e.record(st)
        .map_err(|e| anyhow!("cuEventRecord failed: {e:?}"))
}

impl Tracer {
    pub fn on(&self) -> bool {
        self.base.is_some()
    }

    /// Starts tracing: time zero is now on `compute`.
    pub fn enable(&mut self, dev: &CudaDevice, compute: &CudaStream) -> Result<()> {
        let base = timed(dev)?;
        rec(&base, compute)?;
        self.base = Some(base);
        self.ops.clear();
        Ok(())
    }

    /// Records the start of an op on `st` (None when tracing is off).
    pub fn start(&self, dev: &CudaDevice, st: &CudaStream) -> Result<Option<CudaEvent>> {
        if !self.on() {
            return Ok(None);
        }
        let e = timed(dev)?;
        rec(&e, st)?;
        Ok(Some(e))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn end(
        &mut self,
        dev: &CudaDevice,
        st: &CudaStream,
        start: Option<CudaEvent>,
        stream: &str,
        name: &'static str,
        layer: Option<usize>,
        bytes: usize,
    ) -> Result<()> {
        let Some(start) = start else { return Ok(()) };
        let end = timed(dev)?;
        rec(&end, st)?;
        self.ops.push(Op {
            stream: stream.to_string(),
            name,
            layer,
            bytes,
            start,
            end,
        });
        Ok(())
    }

    /// Waits for every traced op and converts them; tracing stays on with a new base.
    pub fn take(&mut self) -> Result<Vec<TraceEvent>> {
        let Some(base) = &self.base else {
            return Ok(Vec::new());
        };
        let us = |e: &CudaEvent| -> Result<f64> {
            Ok(base
                .elapsed_ms(e)
                .map_err(|e| anyhow!("cuEventElapsedTime failed: {e:?}"))? as f64
                * 1e3)
        };
        let mut out = Vec::with_capacity(self.ops.len());
        for op in self.ops.drain(..) {
            out.push(TraceEvent {
                stream: op.stream,
                name: op.name.to_string(),
                layer: op.layer,
                bytes: op.bytes,
                start_us: us(&op.start)?,
                end_us: us(&op.end)?,
            });
        }
        Ok(out)
    }

    pub fn disable(&mut self) {
        self.base = None;
        self.ops.clear();
    }
}
