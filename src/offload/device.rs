//! What the offload engine needs from a device: streams by role, events, memory in two
//! spaces, ranged copies checked against their allocations, poison, and trace marks. The
//! CPU device (`super::cpu_device`) and the CUDA device (`super::cuda_device`)
//! implement it; the engine (`super::engine`) is written once against it.

use anyhow::{bail, Result};

pub use crate::device::handles::{Allocations, EventId, MemId, Space, Span, StreamRole};

use crate::device::cpu::ops::AttnHeads;
use crate::device::cpu::stream::TraceEvent;
use crate::device::DevPtr;
use crate::kv::Query;

/// Errors unless `OffloadDevice::head_bounds`' arguments agree: `bounds` holds `pages`
/// pages of `[meta_rows(page_size), kv_dim]` and the query is one token's `[num_heads,
/// head_dim]` (both devices read exactly that much memory).
pub fn check_head_bounds(
    q_len: usize,
    bounds: Span,
    heads: AttnHeads,
    pages: usize,
    page_size: usize,
) -> Result<()> {
    let row = heads.num_kv_heads * heads.head_dim;
    let rows = crate::sparse::meta_rows(page_size);
    if bounds.len != pages * rows * row || q_len != heads.num_heads * heads.head_dim {
        bail!(
            "page scores: {pages} pages, {} bound values, query of {q_len}",
            bounds.len
        );
    }
    Ok(())
}

/// Errors unless `OffloadDevice::copy_query`'s query fills `dst` exactly and `dst` is
/// device memory (`space`: where it is).
pub fn check_copy_query(q_len: usize, dst: Span, space: Space) -> Result<()> {
    if space != Space::Device {
        bail!("sparse decode: a query is copied into device memory");
    }
    if q_len != dst.len {
        bail!(
            "sparse decode: a query of {q_len} values copied into {}",
            dst.len
        );
    }
    Ok(())
}

/// Errors unless `OffloadDevice::page_bounds`' spans agree: `keys` is whole
/// `page_size`-row pages of `row` elements and `bounds` holds their metadata
/// (`[pages, meta_rows(page_size), row]`). Returns the page count.
pub fn check_page_bounds(keys: Span, row: usize, page_size: usize, bounds: Span) -> Result<usize> {
    let rows = crate::sparse::meta_rows(page_size);
    let pages = bounds.len / (rows * row);
    if keys.len != pages * page_size * row || bounds.len != pages * rows * row {
        bail!(
            "page bounds: {} keys do not make {} bounds of {page_size}-row pages",
            keys.len,
            bounds.len
        );
    }
    Ok(pages)
}

/// `OffloadDevice::copy_runs` as one `copy` per run (its default, and the fallback of a
/// device that cannot batch on stream `s`).
pub fn copy_each<D: OffloadDevice + ?Sized>(
    d: &mut D,
    s: StreamRole,
    name: &'static str,
    layer: usize,
    (src, dst): (MemId, MemId),
    runs: &[(usize, usize, usize)],
) -> Result<()> {
    for &(src_off, dst_off, len) in runs {
        let span = |mem, off| Span { mem, off, len };
        d.copy(s, name, layer, span(src, src_off), span(dst, dst_off))?;
    }
    Ok(())
}

pub trait OffloadDevice {
    /// The KV element: any `KvElem` on the CPU device, bf16 on CUDA.
    type Elem;
    /// Streams in the offload pool (`StreamRole::Offload(0..n)`).
    fn num_offload_streams(&self) -> usize;
    /// `elems` zeroed elements in `space`; they live as long as the device.
    fn alloc(&mut self, space: Space, elems: usize) -> Result<MemId>;
    /// Where device allocation `mem` is, for the model's kernels.
    fn ptr(&self, mem: MemId) -> DevPtr<Self::Elem>;
    /// The host address of host allocation `mem` (pinned on CUDA), for what the host reads
    /// and writes itself (the disk tier's IO); an error for device memory.
    fn host_ptr(&self, mem: MemId) -> Result<*mut u8>;
    fn new_event(&mut self) -> Result<EventId>;
    /// Where a cache on this device keeps state layers' recurrent states: memory the
    /// model's kernels read, written in order with the compute stream. Default: host
    /// memory (the CPU device, where the compute stream is the calling thread).
    fn state_memory(&self) -> Result<std::sync::Arc<dyn crate::kv::state::StateMemory>> {
        Ok(std::sync::Arc::new(crate::kv::state::HostMemory))
    }
    /// Later work on `s` waits for `e`'s newest record (`what`: for traces and fault tests).
    fn wait(&mut self, s: StreamRole, e: EventId, what: &'static str) -> Result<()>;
    fn record(&mut self, s: StreamRole, e: EventId) -> Result<()>;
    /// Whether the work before `e`'s newest record has run (never blocks).
    fn query(&mut self, e: EventId) -> Result<bool>;
    /// Queues a copy of `src` into `dst` (equal lengths; both checked against their
    /// allocations). Ordering against other streams is the caller's, by events.
    fn copy(
        &mut self,
        s: StreamRole,
        name: &'static str,
        layer: usize,
        src: Span,
        dst: Span,
    ) -> Result<()>;
    /// Queues copies from allocation `src` to allocation `dst`, each run `(src offset, dst
    /// offset, elements)`, as one submission where the device can (sparse decode's
    /// scattered pages: one batched DMA rather than a copy per run, whose fixed cost would
    /// dominate small pages). Default: one `copy` per run.
    fn copy_runs(
        &mut self,
        s: StreamRole,
        name: &'static str,
        layer: usize,
        (src, dst): (MemId, MemId),
        runs: &[(usize, usize, usize)],
    ) -> Result<()> {
        copy_each(self, s, name, layer, (src, dst), runs)
    }
    /// Queues a fill of `dst` with 0xFF bytes: NaN in f32 and in bf16 (the sanitizer).
    fn poison(&mut self, s: StreamRole, dst: Span) -> Result<()>;
    /// Blocks the host until every stream has run everything queued.
    fn sync_all(&mut self) -> Result<()>;
    /// Trace marks around a layer's compute.
    fn layer_begin(&mut self, layer: usize) -> Result<()>;
    fn layer_end(&mut self, layer: usize) -> Result<()>;
    fn set_tracing(&mut self, on: bool) -> Result<()>;
    /// The ops traced so far (waits for them).
    fn take_trace(&mut self) -> Result<Vec<TraceEvent>>;
    /// Sparse decode, queued on the compute stream: the metadata of each `page_size`-row
    /// page of `keys` (`[pages · page_size, row]`: channel-wise min and max of K, the
    /// mask planes) into `bounds` (`[pages, meta_rows(page_size), row]`). Reference:
    /// `crate::sparse::page_bounds`.
    fn page_bounds(
        &mut self,
        layer: usize,
        keys: Span,
        row: usize,
        page_size: usize,
        bounds: Span,
    ) -> Result<()>;
    /// Sparse decode, queued on the compute stream: a copy of the model's query `q` (valid
    /// for this call only: the next layer overwrites it) into device memory `dst`, so that
    /// it can be scored once the layer's keys are stored (prefill's last token).
    fn copy_query(&mut self, q: Query<Self::Elem>, dst: Span) -> Result<()>;
    /// Sparse decode: the box bound of each of `pages` pages for each query head
    /// (`crate::sparse::head_bounds`, `[pages, num_heads]`) for one token's query `q`
    /// (`[num_heads, head_dim]`), after the compute stream's work so far. The host needs
    /// them to choose the pages and issue their copies, so this blocks (on CUDA: kernel,
    /// small D2H, stream synchronize).
    fn head_bounds(
        &mut self,
        layer: usize,
        q: Query<Self::Elem>,
        bounds: Span,
        heads: AttnHeads,
        pages: usize,
        page_size: usize,
    ) -> Result<Vec<f32>>;
}
