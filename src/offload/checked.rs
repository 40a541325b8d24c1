//! Any `OffloadDevice` under the stream-ordering checker (`crate::device::order`): every
//! call is forwarded, and first declared to the checker — copies read their source and
//! write their destination on their stream, poison writes, the sparse kernels read and
//! write their spans on the compute stream, records snapshot and waits join, a query that
//! answers "done" and every synchronize teach the host. What no device call shows (the
//! model's compute over a slot or over pages, the host's own reads and writes of staging
//! memory) its owner declares with `declare` and `host_access`.
//!
//! The engine and the serving pages hold their device through this wrapper, so the CPU
//! device, the kernel emulator's bf16 CPU device and the CUDA device are all checked the
//! same way. Off (`None`), each call costs one branch.

use anyhow::Result;

use super::device::{EventId, MemId, OffloadDevice, Space, Span, StreamRole};
use crate::device::cpu::ops::AttnHeads;
use crate::device::cpu::stream::TraceEvent;
use crate::device::order::{Access, Actor, Op, OrderChecker};
use crate::device::DevPtr;
use crate::kv::Query;

pub struct Checked<D> {
    d: D,
    order: Option<OrderChecker>,
}

impl<D: OffloadDevice> Checked<D> {
    /// `d` under the checker when `on`.
    pub fn new(d: D, on: bool) -> Self {
        Self {
            d,
            order: on.then(OrderChecker::new),
        }
    }

    pub fn is_checked(&self) -> bool {
        self.order.is_some()
    }

    /// The device itself, for settings no stream's order depends on (the CPU device's
    /// simulated link speed, which synchronizes its streams first).
    pub fn inner_mut(&mut self) -> &mut D {
        &mut self.d
    }

    /// Offload streams wrap around the pool, as the devices map them.
    fn role(&self, s: StreamRole) -> StreamRole {
        match s {
            StreamRole::Offload(i) => StreamRole::Offload(i % self.d.num_offload_streams().max(1)),
            s => s,
        }
    }

    fn on_stream(
        &mut self,
        s: StreamRole,
        name: &'static str,
        layer: Option<usize>,
        accesses: &[(Access, Span)],
    ) -> Result<()> {
        let s = self.role(s);
        if let Some(k) = &mut self.order {
            for &(a, span) in accesses {
                k.access(Actor::Stream(s), a, Op::new(name, layer, span), span)?;
            }
        }
        Ok(())
    }

    /// Declares what the work queued on `s` since its last event reads and writes beyond
    /// the device calls: the model's compute over a layer's slot or a step's pages.
    pub fn declare(
        &mut self,
        s: StreamRole,
        name: &'static str,
        layer: usize,
        accesses: &[(Access, Span)],
    ) -> Result<()> {
        self.on_stream(s, name, Some(layer), accesses)
    }

    /// Declares a read or write the host does itself, now (of host memory: staging).
    pub fn host_access(&mut self, name: &'static str, access: Access, span: Span) -> Result<()> {
        match &mut self.order {
            Some(k) => k.access(Actor::Host, access, Op::new(name, None, span), span),
            None => Ok(()),
        }
    }
}

impl<D: OffloadDevice> OffloadDevice for Checked<D> {
    type Elem = D::Elem;

    fn num_offload_streams(&self) -> usize {
        self.d.num_offload_streams()
    }

    fn alloc(&mut self, space: Space, elems: usize) -> Result<MemId> {
        self.d.alloc(space, elems)
    }

    fn ptr(&self, mem: MemId) -> DevPtr<Self::Elem> {
        self.d.ptr(mem)
    }

    fn host_ptr(&self, mem: MemId) -> Result<*mut u8> {
        self.d.host_ptr(mem)
    }

    fn state_memory(&self) -> Result<std::sync::Arc<dyn crate::kv::state::StateMemory>> {
        self.d.state_memory()
    }

    fn new_event(&mut self) -> Result<EventId> {
        self.d.new_event()
    }

    fn wait(&mut self, s: StreamRole, e: EventId, what: &'static str) -> Result<()> {
        let role = self.role(s);
        if let Some(k) = &mut self.order {
            k.wait(role, e, what);
        }
        self.d.wait(s, e, what)
    }

    fn record(&mut self, s: StreamRole, e: EventId) -> Result<()> {
        let role = self.role(s);
        if let Some(k) = &mut self.order {
            k.record(role, e);
        }
        self.d.record(s, e)
    }

    fn query(&mut self, e: EventId) -> Result<bool> {
        let done = self.d.query(e)?;
        if let (true, Some(k)) = (done, &mut self.order) {
            k.host_saw(e);
        }
        Ok(done)
    }

    fn copy(
        &mut self,
        s: StreamRole,
        name: &'static str,
        layer: usize,
        src: Span,
        dst: Span,
    ) -> Result<()> {
        let acc = [(Access::Read, src), (Access::Write, dst)];
        self.on_stream(s, name, Some(layer), &acc)?;
        self.d.copy(s, name, layer, src, dst)
    }

    fn copy_runs(
        &mut self,
        s: StreamRole,
        name: &'static str,
        layer: usize,
        (src, dst): (MemId, MemId),
        runs: &[(usize, usize, usize)],
    ) -> Result<()> {
        if self.order.is_some() {
            for &(so, d_off, len) in runs {
                let span = |mem, off| Span { mem, off, len };
                let acc = [
                    (Access::Read, span(src, so)),
                    (Access::Write, span(dst, d_off)),
                ];
                self.on_stream(s, name, Some(layer), &acc)?;
            }
        }
        self.d.copy_runs(s, name, layer, (src, dst), runs)
    }

    fn poison(&mut self, s: StreamRole, dst: Span) -> Result<()> {
        self.on_stream(s, "poison", None, &[(Access::Write, dst)])?;
        self.d.poison(s, dst)
    }

    fn sync_all(&mut self) -> Result<()> {
        self.d.sync_all()?;
        if let Some(k) = &mut self.order {
            k.host_synced_all();
        }
        Ok(())
    }

    fn layer_begin(&mut self, layer: usize) -> Result<()> {
        self.d.layer_begin(layer)
    }

    fn layer_end(&mut self, layer: usize) -> Result<()> {
        self.d.layer_end(layer)
    }

    fn set_tracing(&mut self, on: bool) -> Result<()> {
        self.d.set_tracing(on)
    }

    fn take_trace(&mut self) -> Result<Vec<TraceEvent>> {
        let t = self.d.take_trace()?; // waits for every stream
        if let Some(k) = &mut self.order {
            k.host_synced_all();
        }
        Ok(t)
    }

    fn page_bounds(
        &mut self,
        layer: usize,
        keys: Span,
        row: usize,
        page_size: usize,
        bounds: Span,
    ) -> Result<()> {
        let acc = [(Access::Read, keys), (Access::Write, bounds)];
        self.on_stream(StreamRole::Compute, "page-bounds", Some(layer), &acc)?;
        self.d.page_bounds(layer, keys, row, page_size, bounds)
    }

    fn copy_query(&mut self, q: Query<Self::Elem>, dst: Span) -> Result<()> {
        self.on_stream(
            StreamRole::Compute,
            "copy-query",
            None,
            &[(Access::Write, dst)],
        )?;
        self.d.copy_query(q, dst)
    }

    fn head_bounds(
        &mut self,
        layer: usize,
        q: Query<Self::Elem>,
        bounds: Span,
        heads: AttnHeads,
        pages: usize,
        page_size: usize,
    ) -> Result<Vec<f32>> {
        let acc = [(Access::Read, bounds)];
        self.on_stream(
            StreamRole::Compute,
            super::trace::PAGE_SCORES,
            Some(layer),
            &acc,
        )?;
        let out = self
            .d
            .head_bounds(layer, q, bounds, heads, pages, page_size)?;
        // It blocks until the compute stream has run it.
        if let Some(k) = &mut self.order {
            k.host_synced(StreamRole::Compute);
        }
        Ok(out)
    }
}
