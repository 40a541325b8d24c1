//! The offload engine's CPU device: the compute stream is the calling thread (the model
//! computes a layer between `begin_layer` and `end_layer`, as a GPU would run the kernels
//! queued there), the prefetch and offload streams are worker threads with CUDA's event
//! semantics, and host and device memory are separate allocations, so every offload and
//! prefetch is a real copy running beside compute. A wait on the compute stream blocks the
//! calling thread until the event completes; a record on it completes at once.
//!
//! Debugging aids: a link throttle (`link_gbps`: host↔device copies take as long as over
//! PCIe) and a sanitizer (random copy delays, so a missing wait changes the tokens).
//!
//! Elements are `T`: f32 for the CPU model, bf16 for the CUDA model on the kernel emulator
//! (whose kernels read host memory), so the one engine runs under both without a GPU.

use std::marker::PhantomData;
use std::sync::Arc;

use anyhow::{bail, Result};

use super::device::{
    check_copy_query, check_head_bounds, check_page_bounds, copy_each, Allocations, EventId, MemId,
    OffloadDevice, Space, Span, StreamRole,
};
use crate::device::cpu::ops::AttnHeads;
use crate::device::cpu::stream::{CpuDevice, Event, Link, MemSpace, Stream, TraceEvent};
use crate::device::DevPtr;
use crate::device::KvElem;
use crate::kv::Query;

pub struct CpuOffloadDevice<T> {
    dev: Arc<CpuDevice>,
    prefetch: Stream,
    miss: Stream,    // sparse decode's misses
    staging: Stream, // the disk tier's staging copies
    offload: Vec<Stream>,
    events: Vec<Event>,
    mem: Allocations<Vec<u128>>, // u128: 16-byte aligned, as kernels' vector loads expect
    layer_start: f64,
    _elem: PhantomData<fn() -> T>,
}

impl<T> CpuOffloadDevice<T> {
    /// `link_gbps` 0: unthrottled.
    pub fn new(link_gbps: f64, sanitize: bool, offload_streams: usize) -> anyhow::Result<Self> {
        let dev = CpuDevice::new(link_gbps, sanitize);
        Ok(Self {
            prefetch: Stream::new(&dev, "h2d-prefetch")?,
            miss: Stream::new(&dev, "h2d-miss")?,
            staging: Stream::new(&dev, "disk-staging")?,
            offload: (0..offload_streams)
                .map(|i| Stream::new(&dev, &format!("d2h-offload-{i}")))
                .collect::<anyhow::Result<_>>()?,
            dev,
            events: Vec::new(),
            mem: Allocations::default(),
            layer_start: 0.0,
            _elem: PhantomData,
        })
    }

    /// The simulated link's speed from now on, once the copies queued so far are done.
    pub fn set_link_gbps(&mut self, gbps: f64) {
        self.sync_streams();
        self.dev.set_link_gbps(gbps);
    }

    fn sync_streams(&self) {
        self.prefetch.synchronize();
        self.miss.synchronize();
        self.staging.synchronize();
        for o in &self.offload {
            o.synchronize();
        }
    }

    /// `None`: the compute stream, which is the calling thread.
    fn stream(&self, s: StreamRole) -> Option<&Stream> {
        match s {
            StreamRole::Compute => None,
            StreamRole::Prefetch => Some(&self.prefetch),
            StreamRole::Miss => Some(&self.miss),
            StreamRole::Staging => Some(&self.staging),
            StreamRole::Offload(i) => Some(&self.offload[i % self.offload.len()]),
        }
    }

    fn addr(&self, s: Span) -> Result<*mut u8> {
        self.mem.check(s)?;
        let base = self.mem.get(s.mem).as_ptr() as *mut u8;
        Ok(base.wrapping_add(s.off * std::mem::size_of::<T>()))
    }

    fn space(&self, m: MemId) -> MemSpace {
        match self.mem.space(m) {
            Space::Host => MemSpace::Host,
            Space::Device => MemSpace::Device,
        }
    }

    fn trace_compute(&self, name: &str, layer: Option<usize>, bytes: usize, start_us: f64) {
        self.dev.record(TraceEvent {
            stream: "compute".into(),
            name: name.into(),
            layer,
            bytes,
            start_us,
            end_us: self.dev.now_us(),
        });
    }
}

impl<T: KvElem> OffloadDevice for CpuOffloadDevice<T> {
    type Elem = T;

    fn num_offload_streams(&self) -> usize {
        self.offload.len()
    }

    fn alloc(&mut self, space: Space, elems: usize) -> Result<MemId> {
        let bytes = elems
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| anyhow::anyhow!("offload buffer size overflows"))?;
        let mut v: Vec<u128> = Vec::new();
        let words = bytes.div_ceil(16).max(1);
        if v.try_reserve_exact(words).is_err() {
            let what = if space == Space::Host {
                "host"
            } else {
                "device"
            };
            bail!(
                "out of {what} memory allocating {:.1} MiB",
                bytes as f64 / (1 << 20) as f64
            );
        }
        v.resize(words, 0);
        Ok(self.mem.add(v, space, elems))
    }

    fn ptr(&self, mem: MemId) -> DevPtr<T> {
        DevPtr::from_addr(self.mem.get(mem).as_ptr() as u64)
    }

    fn host_ptr(&self, mem: MemId) -> Result<*mut u8> {
        if self.mem.space(mem) != Space::Host {
            bail!("allocation {} is device memory, not host memory", mem.0);
        }
        Ok(self.mem.get(mem).as_ptr() as *mut u8)
    }

    fn new_event(&mut self) -> Result<EventId> {
        self.events.push(Event::new());
        Ok(EventId(self.events.len() - 1))
    }

    fn wait(&mut self, s: StreamRole, e: EventId, what: &'static str) -> Result<()> {
        let ev = &self.events[e.0];
        match self.stream(s) {
            Some(st) => st.wait(ev, what),
            None if !ev.query() => {
                let start = self.dev.now_us();
                ev.synchronize();
                self.trace_compute(&format!("wait:{what}"), None, 0, start);
            }
            None => {}
        }
        Ok(())
    }

    fn record(&mut self, s: StreamRole, e: EventId) -> Result<()> {
        let ev = &self.events[e.0];
        match self.stream(s) {
            Some(st) => st.record(ev),
            None => ev.complete_on_host(ev.record_on_host()),
        }
        Ok(())
    }

    fn query(&mut self, e: EventId) -> Result<bool> {
        Ok(self.events[e.0].query())
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
        let (from, to) = (self.addr(src)?, self.addr(dst)?);
        let bytes = src.len * std::mem::size_of::<T>();
        if bytes == 0 {
            return Ok(());
        }
        let link = Link::between(self.space(src.mem), self.space(dst.mem));
        match self.stream(s) {
            // SAFETY: both spans are inside allocations this device owns for its whole
            // life (checked above); ordering against the other streams is by events.
            Some(st) => unsafe { st.copy_raw(name, Some(layer), from, to, bytes, link, ()) },
            None => {
                let start = self.dev.now_us();
                // SAFETY: as above; the compute stream is this thread, so the copy is now.
                unsafe { std::ptr::copy(from, to, bytes) };
                self.trace_compute(name, Some(layer), bytes, start);
            }
        }
        Ok(())
    }

    fn copy_runs(
        &mut self,
        s: StreamRole,
        name: &'static str,
        layer: usize,
        (src, dst): (MemId, MemId),
        runs: &[(usize, usize, usize)],
    ) -> Result<()> {
        let Some(st) = self.stream(s) else {
            // The compute stream is this thread: nothing to batch.
            return copy_each(self, s, name, layer, (src, dst), runs);
        };
        let elem = std::mem::size_of::<T>();
        let mut copies = Vec::with_capacity(runs.len());
        for &(src_off, dst_off, len) in runs {
            let span = |mem, off| Span { mem, off, len };
            let (a, b) = (span(src, src_off), span(dst, dst_off));
            self.mem.check_copy(name, a, b)?;
            if len > 0 {
                copies.push((self.addr(a)? as *const u8, self.addr(b)?, len * elem));
            }
        }
        if copies.is_empty() {
            return Ok(());
        }
        let link = Link::between(self.space(src), self.space(dst));
        // SAFETY: every span lies inside an allocation this device owns for its whole life
        // (checked above); ordering against the other streams is by events.
        unsafe { st.copy_batch_raw(name, Some(layer), copies, link, ()) };
        Ok(())
    }

    fn poison(&mut self, s: StreamRole, dst: Span) -> Result<()> {
        let to = self.addr(dst)?;
        let bytes = dst.len * std::mem::size_of::<T>();
        match self.stream(s) {
            // SAFETY: inside an allocation this device owns (checked by `addr`).
            Some(st) => unsafe { st.fill_raw("poison", None, to, bytes, 0xff) },
            // SAFETY: as above, now, on the compute stream (this thread).
            None => unsafe { std::ptr::write_bytes(to, 0xff, bytes) },
        }
        Ok(())
    }

    fn sync_all(&mut self) -> Result<()> {
        self.sync_streams();
        Ok(())
    }

    fn layer_begin(&mut self, _layer: usize) -> Result<()> {
        self.layer_start = self.dev.now_us();
        Ok(())
    }

    fn layer_end(&mut self, layer: usize) -> Result<()> {
        self.trace_compute("layer", Some(layer), 0, self.layer_start);
        Ok(())
    }

    fn set_tracing(&mut self, on: bool) -> Result<()> {
        self.dev.set_tracing(on);
        Ok(())
    }

    fn take_trace(&mut self) -> Result<Vec<TraceEvent>> {
        self.sync_all()?;
        Ok(self.dev.take_trace())
    }

    fn page_bounds(
        &mut self,
        layer: usize,
        keys: Span,
        row: usize,
        page_size: usize,
        bounds: Span,
    ) -> Result<()> {
        check_page_bounds(keys, row, page_size, bounds)?;
        if keys.mem == bounds.mem {
            bail!("page bounds: keys and bounds share an allocation");
        }
        let start = self.dev.now_us();
        let (k, b) = (self.addr(keys)? as *const T, self.addr(bounds)? as *mut T);
        // SAFETY: both spans lie inside distinct allocations (checked above); the compute
        // stream is this thread and owns the slot, decode buffer and bounds it reads and
        // writes (the engine waited for their copies).
        let (k, b) = unsafe {
            (
                std::slice::from_raw_parts(k, keys.len),
                std::slice::from_raw_parts_mut(b, bounds.len),
            )
        };
        crate::sparse::page_bounds(k, row, page_size, b);
        self.trace_compute("page-bounds", Some(layer), 0, start);
        Ok(())
    }

    fn copy_query(&mut self, q: Query<T>, dst: Span) -> Result<()> {
        let to = self.addr(dst)?;
        check_copy_query(q.len, dst, self.mem.space(dst.mem))?;
        // SAFETY: `dst` lies inside an allocation of this device (checked by `addr`), which
        // only the compute stream (this thread) touches; the query is the model's, in host
        // memory, `q.len` elements valid for this call (`KvCache::select_rows`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                q.ptr.as_host_ptr() as *const u8,
                to,
                q.len * std::mem::size_of::<T>(),
            )
        };
        Ok(())
    }

    fn head_bounds(
        &mut self,
        layer: usize,
        q: Query<T>,
        bounds: Span,
        heads: AttnHeads,
        pages: usize,
        page_size: usize,
    ) -> Result<Vec<f32>> {
        check_head_bounds(q.len, bounds, heads, pages, page_size)?;
        let start = self.dev.now_us();
        // SAFETY: the bounds lie inside an allocation of this device (checked by `addr`);
        // the compute stream (this thread) wrote them and nothing else writes them
        // meanwhile. The query is the model's, in host memory, valid for this call
        // (`KvCache::select_rows`).
        let (b, q) = unsafe {
            (
                std::slice::from_raw_parts(self.addr(bounds)? as *const T, bounds.len),
                std::slice::from_raw_parts(q.ptr.as_host_ptr() as *const T, q.len),
            )
        };
        let out = crate::sparse::head_bounds(q, b, heads, pages, page_size);
        self.trace_compute(super::trace::PAGE_SCORES, Some(layer), 0, start);
        Ok(out)
    }
}

impl<T> Drop for CpuOffloadDevice<T> {
    /// The streams must not outlive the memory their queued copies address.
    fn drop(&mut self) {
        self.sync_streams();
    }
}
