//! The offload engine's CUDA device: the model's compute stream, an H2D prefetch stream,
//! sparse decode's H2D miss stream and a pool of D2H offload streams; CUDA events; pinned
//! host KV and device memory; async copies on raw addresses (see `ops` for why not
//! cudarc's safe copies) traced with timed events and NVTX ranges when asked; sparse
//! decode's kernels (`crate::device::cuda::sparse`) on the compute stream. KV in bf16.

use crate::device::cpu::ops::AttnHeads;
use crate::device::cpu::stream::TraceEvent;
use crate::device::cuda::context::CudaDevice;
use crate::device::cuda::ops::{dptr, dtod, dtoh, htod, poison, Kernels};
use crate::device::cuda::trace::Tracer;
use crate::device::DevPtr;
use crate::kv::Query;
use crate::offload::device::{
    check_copy_query, check_head_bounds, check_page_bounds, Allocations, EventId, MemId,
    OffloadDevice, Space, Span, StreamRole,
};
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use half::bf16;
use std::sync::Arc;

/// bf16.
const ELEM: usize = 2;

/// An allocation (kept alive) and its address.
enum Mem {
    Pinned(#[allow(dead_code)] PinnedHostSlice<u8>, *mut u8),
    Device(#[allow(dead_code)] CudaSlice<u8>, DevPtr<u8>),
}

// SAFETY: the pointer addresses the pinned allocation owned beside it, which moves with it
// and lives as long; nothing else holds it (the serving engine moves its device to the
// engine thread, which then alone uses it).
unsafe impl Send for Mem {}

pub struct CudaOffloadDevice {
    dev: Arc<CudaDevice>,
    compute: (Arc<CudaStream>, String),
    prefetch: (Arc<CudaStream>, String),
    miss: (Arc<CudaStream>, String),
    staging: (Arc<CudaStream>, String),
    offload: Vec<(Arc<CudaStream>, String)>,
    events: Vec<CudaEvent>,
    /// Sparse decode's kernels (loaded on first use) and its per-head bounds, f32
    /// `[pages, num_heads]`, grown as the context grows.
    kernels: Kernels,
    scores: Option<(CudaSlice<f32>, usize)>, // (buffer, elements)
    mem: Allocations<Mem>,
    tracer: Tracer,
    layer_start: Option<CudaEvent>,
}

/// A device address as the raw copies take it.
fn dev(addr: u64) -> DevPtr<u8> {
    DevPtr::from_addr(addr)
}

fn drv(r: Result<(), cudarc::driver::DriverError>, what: &str) -> Result<()> {
    r.map_err(|e| anyhow!("{what} failed: {e:?}"))
}

impl CudaOffloadDevice {
    /// `compute`: the model's stream; `offload_streams` D2H streams are created.
    pub fn new(
        dev: Arc<CudaDevice>,
        compute: Arc<CudaStream>,
        offload_streams: usize,
    ) -> Result<Self> {
        let named = |s: Arc<CudaStream>, n: &str| (s, n.to_string());
        Ok(Self {
            compute: named(compute, "compute"),
            prefetch: named(dev.new_stream()?, "h2d-prefetch"),
            miss: named(dev.new_stream()?, "h2d-miss"),
            staging: named(dev.new_stream()?, "disk-staging"),
            offload: (0..offload_streams)
                .map(|i| Ok(named(dev.new_stream()?, &format!("d2h-offload-{i}"))))
                .collect::<Result<_>>()?,
            kernels: Kernels::new(dev.clone()),
            scores: None,
            dev,
            events: Vec::new(),
            mem: Allocations::default(),
            tracer: Tracer::default(),
            layer_start: None,
        })
    }

    fn stream(&self, s: StreamRole) -> &(Arc<CudaStream>, String) {
        match s {
            StreamRole::Compute => &self.compute,
            StreamRole::Prefetch => &self.prefetch,
            StreamRole::Miss => &self.miss,
            StreamRole::Staging => &self.staging,
            StreamRole::Offload(i) => &self.offload[i % self.offload.len()],
        }
    }

    /// The span's address: a host pointer or a device address, by its allocation.
    fn addr(&self, s: Span) -> Result<u64> {
        self.mem.check(s)?;
        let off = (s.off * ELEM) as u64;
        Ok(match self.mem.get(s.mem) {
            Mem::Pinned(_, p) => *p as u64 + off,
            Mem::Device(_, p) => p.addr() + off,
        })
    }

    fn all_streams(&self) -> impl Iterator<Item = &Arc<CudaStream>> {
        [&self.compute, &self.prefetch, &self.miss, &self.staging]
            .into_iter()
            .chain(&self.offload)
            .map(|(s, _)| s)
    }
}

impl OffloadDevice for CudaOffloadDevice {
    type Elem = bf16;

    fn num_offload_streams(&self) -> usize {
        self.offload.len()
    }

    fn alloc(&mut self, space: Space, elems: usize) -> Result<MemId> {
        let bytes = elems
            .checked_mul(ELEM)
            .ok_or_else(|| anyhow!("offload buffer size overflows"))?
            .max(1);
        let mem = match space {
            Space::Host => {
                let mut h = self.dev.alloc_pinned::<u8>(bytes)?;
                // as_mut_ptr only waits on the slice's own event, never recorded: every
                // copy uses the raw pointer (see ops.rs for why).
                let p = h
                    .as_mut_ptr()
                    .map_err(|e| anyhow!("pinned host memory: {e:?}"))?;
                Mem::Pinned(h, p)
            }
            Space::Device => {
                let st = &self.compute.0;
                let b = self.dev.alloc_zeros::<u8>(st, bytes)?;
                let p = dptr(&b, st);
                Mem::Device(b, p)
            }
        };
        Ok(self.mem.add(mem, space, elems))
    }

    fn ptr(&self, mem: MemId) -> DevPtr<bf16> {
        match self.mem.get(mem) {
            Mem::Device(_, p) => p.cast(),
            Mem::Pinned(_, p) => DevPtr::from_addr(*p as u64), // mapped pinned memory
        }
    }

    fn host_ptr(&self, mem: MemId) -> Result<*mut u8> {
        match self.mem.get(mem) {
            Mem::Pinned(_, p) => Ok(*p),
            Mem::Device(..) => bail!("allocation {} is device memory, not host memory", mem.0),
        }
    }

    /// The GPU's memory, zeroed and written on the compute stream.
    fn state_memory(&self) -> Result<Arc<dyn crate::kv::state::StateMemory>> {
        let exec =
            crate::device::cuda::exec::CudaExec::new(self.dev.clone(), self.compute.0.clone())?;
        Ok(Arc::new(crate::kv::state::ExecMemory(Arc::new(exec))))
    }

    fn new_event(&mut self) -> Result<EventId> {
        self.events.push(self.dev.new_event()?);
        Ok(EventId(self.events.len() - 1))
    }

    fn wait(&mut self, s: StreamRole, e: EventId, _what: &'static str) -> Result<()> {
        drv(
            self.stream(s).0.wait(&self.events[e.0]),
            "cuStreamWaitEvent",
        )
    }

    fn record(&mut self, s: StreamRole, e: EventId) -> Result<()> {
        drv(self.events[e.0].record(&self.stream(s).0), "cuEventRecord")
    }

    fn query(&mut self, e: EventId) -> Result<bool> {
        Ok(self.events[e.0].is_complete())
    }

    fn copy(
        &mut self,
        s: StreamRole,
        name: &'static str,
        layer: usize,
        src: Span,
        dst: Span,
    ) -> Result<()> {
        self.mem.check_copy(name, src, dst)?;
        let (from, to, bytes) = (self.addr(src)?, self.addr(dst)?, src.len * ELEM);
        if bytes == 0 {
            return Ok(());
        }
        let (st, sname) = self.stream(s).clone();
        let st = &st;
        nvtx::range_push!("{name} L{layer} {bytes} B");
        let start = self.tracer.start(&self.dev, st)?;
        // SAFETY: both spans lie inside allocations this device owns for its whole life
        // (checked by `addr`); the engine orders the copy against the kernels by events.
        unsafe {
            match (self.mem.space(src.mem), self.mem.space(dst.mem)) {
                (Space::Host, Space::Device) => htod(st, dev(to), from as *const u8, bytes)?,
                (Space::Device, Space::Host) => dtoh(st, to as *mut u8, dev(from), bytes)?,
                (Space::Device, Space::Device) => dtod(st, dev(to), dev(from), bytes)?,
                (Space::Host, Space::Host) => bail!("offload copy {name}: host to host"),
            }
        }
        self.tracer
            .end(&self.dev, st, start, &sname, name, Some(layer), bytes)?;
        nvtx::range_pop!();
        Ok(())
    }

    fn poison(&mut self, s: StreamRole, dst: Span) -> Result<()> {
        let (to, bytes) = (self.addr(dst)?, dst.len * ELEM);
        match self.mem.space(dst.mem) {
            // SAFETY: inside an allocation this device owns (checked by `addr`).
            Space::Device => unsafe { poison(&self.stream(s).0, dev(to), bytes) },
            Space::Host => {
                // Host memory is poisoned from the host: every stream must be idle.
                self.sync_all()?;
                // SAFETY: as above; the streams are idle.
                unsafe { std::ptr::write_bytes(to as *mut u8, 0xff, bytes) };
                Ok(())
            }
        }
    }

    fn sync_all(&mut self) -> Result<()> {
        for st in self.all_streams() {
            drv(st.synchronize(), "cuStreamSynchronize")?;
        }
        Ok(())
    }

    fn layer_begin(&mut self, _layer: usize) -> Result<()> {
        self.layer_start = self.tracer.start(&self.dev, &self.compute.0)?;
        Ok(())
    }

    fn layer_end(&mut self, layer: usize) -> Result<()> {
        let start = self.layer_start.take();
        let (st, name) = &self.compute;
        self.tracer
            .end(&self.dev, st, start, name, "layer", Some(layer), 0)
    }

    fn set_tracing(&mut self, on: bool) -> Result<()> {
        if on {
            self.tracer.enable(&self.dev, &self.compute.0)
        } else {
            self.tracer.disable();
            Ok(())
        }
    }

    fn take_trace(&mut self) -> Result<Vec<TraceEvent>> {
        self.tracer.take()
    }

    fn page_bounds(
        &mut self,
        _layer: usize,
        keys: Span,
        row: usize,
        page_size: usize,
        bounds: Span,
    ) -> Result<()> {
        let pages = check_page_bounds(keys, row, page_size, bounds)?;
        let (k, b) = (self.addr(keys)?, self.addr(bounds)?);
        let on_device = |m| self.mem.space(m) == Space::Device;
        if !on_device(keys.mem) || !on_device(bounds.mem) {
            bail!("page bounds: keys and bounds must be device memory");
        }
        let l = crate::device::cuda::sparse::page_bounds(
            dev(k).cast(),
            dev(b).cast(),
            pages,
            page_size,
            row,
            crate::sparse::KEY_BITS,
        );
        self.kernels.launch(&self.compute.0, &l)
    }

    fn copy_query(&mut self, q: Query<bf16>, dst: Span) -> Result<()> {
        let to = self.addr(dst)?;
        check_copy_query(q.len, dst, self.mem.space(dst.mem))?;
        // SAFETY: `dst` lies inside an allocation this device owns (checked by `addr`); the
        // query is the model's device buffer, `q.len` elements, read in compute-stream order.
        unsafe { dtod(&self.compute.0, dev(to), q.ptr.cast(), q.len * ELEM) }
    }

    fn head_bounds(
        &mut self,
        _layer: usize,
        q: Query<bf16>,
        bounds: Span,
        heads: AttnHeads,
        pages: usize,
        page_size: usize,
    ) -> Result<Vec<f32>> {
        check_head_bounds(q.len, bounds, heads, pages, page_size)?;
        let b = self.addr(bounds)?;
        let n = pages * heads.num_heads;
        let st = self.compute.0.clone();
        if self.scores.as_ref().is_none_or(|(_, cap)| *cap < n) {
            // The old buffer is idle: every call synchronizes before returning.
            let cap = n.max(1).next_power_of_two();
            self.scores = Some((self.dev.alloc_zeros::<f32>(&st, cap)?, cap));
        }
        let (buf, _) = self.scores.as_ref().expect("allocated above");
        let out = dptr(buf, &st);
        let l = crate::device::cuda::sparse::head_bounds(
            q.ptr,
            dev(b).cast(),
            out,
            pages,
            page_size,
            heads,
            crate::sparse::KEY_BITS,
        );
        self.kernels.launch(&st, &l)?;
        let mut host = vec![0f32; n];
        // SAFETY: `out` holds at least `n` f32; `host` outlives the copy, which the
        // synchronize below waits for.
        unsafe { dtoh(&st, host.as_mut_ptr() as *mut u8, out.cast(), n * 4)? };
        drv(st.synchronize(), "cuStreamSynchronize")?;
        Ok(host)
    }
}

impl Drop for CudaOffloadDevice {
    /// Queued copies address this device's memory: let them finish first.
    fn drop(&mut self) {
        let _ = self.sync_all();
    }
}

/// The offload engine on the GPU, bf16 KV.
pub type CudaOffloadEngine = crate::offload::OffloadEngine<CudaOffloadDevice>;

/// The engine on `compute`'s GPU, beside the model.
pub fn offload_engine(
    dev: Arc<CudaDevice>,
    compute: Arc<CudaStream>,
    model: &crate::model::ModelConfig,
    cfg: crate::offload::OffloadConfig,
) -> Result<CudaOffloadEngine> {
    if cfg.link_gbps > 0.0 {
        crate::device::DeviceKind::Cuda.require(crate::device::Feature::SimulatedLink)?;
    }
    let d = CudaOffloadDevice::new(dev, compute, crate::offload::engine::OFFLOAD_STREAMS)?;
    crate::offload::OffloadEngine::new(d, model, cfg)
}
