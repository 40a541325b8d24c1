//! The asynchronous CPU device: streams are worker threads that run their queue in
//! order, events complete when their stream reaches them, and device and host memory are
//! separate allocations, so every offload and prefetch is a real copy running beside compute.
//!
//! Two debugging aids make ordering bugs visible: a link throttle (`link_gbps`) that makes
//! host↔device copies take as long as they would over PCIe, and a sanitizer that delays
//! every copy by a random amount (and lets the offload engine poison released slots).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

/// Where a buffer lives. Only host↔device copies cross the (simulated) link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemSpace {
    Device,
    Host,
}

/// Which way a copy crosses the host↔device link (only those are throttled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    None,
    H2D,
    D2H,
}

impl Link {
    pub fn between(src: MemSpace, dst: MemSpace) -> Self {
        match (src, dst) {
            (MemSpace::Host, MemSpace::Device) => Link::H2D,
            (MemSpace::Device, MemSpace::Host) => Link::D2H,
            _ => Link::None,
        }
    }
}

/// A block of f32 memory shared with stream workers. Access is ordered by streams and
/// events, exactly as with real device memory: the type system does not police it, the
/// event discipline (and the sanitizer) does.
pub struct Buffer {
    cell: Arc<BufCell>,
}

struct BufCell {
    data: UnsafeCell<Box<[f32]>>,
    len: usize,
    space: MemSpace,
}

// SAFETY: concurrent access is ordered by stream/event discipline, as for GPU memory.
unsafe impl Sync for BufCell {}
unsafe impl Send for BufCell {}

impl Clone for Buffer {
    fn clone(&self) -> Self {
        Self {
            cell: Arc::clone(&self.cell),
        }
    }
}

impl Buffer {
    /// Allocates `len` zeroed f32s, failing cleanly (not aborting) when memory runs out.
    pub fn alloc(len: usize, space: MemSpace) -> Result<Self> {
        let mut v: Vec<f32> = Vec::new();
        if v.try_reserve_exact(len).is_err() {
            let what = if space == MemSpace::Host {
                "host"
            } else {
                "device"
            };
            bail!(
                "out of {what} memory allocating {:.1} MiB",
                len as f64 * 4.0 / (1 << 20) as f64
            );
        }
        v.resize(len, 0.0);
        Ok(Self {
            cell: Arc::new(BufCell {
                data: UnsafeCell::new(v.into_boxed_slice()),
                len,
                space,
            }),
        })
    }

    pub fn len(&self) -> usize {
        self.cell.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn space(&self) -> MemSpace {
        self.cell.space
    }

    /// The first element. Streams and the model reach the buffer through this, a range at
    /// a time: no reference to the whole buffer is ever formed while a stream may be
    /// touching another part of it.
    pub fn as_ptr(&self) -> *mut f32 {
        // SAFETY: a pointer, not a reference, to the boxed slice's elements.
        unsafe { (*self.cell.data.get()).as_mut_ptr() }
    }

    /// `len` elements from `off`, as a shared slice.
    ///
    /// # Safety
    /// No stream may write the range while the slice lives; the caller must be ordered (by
    /// stream order or events) after every writer of the range.
    pub unsafe fn range(&self, off: usize, len: usize) -> &[f32] {
        assert!(off + len <= self.len(), "buffer range out of bounds");
        std::slice::from_raw_parts(self.as_ptr().add(off), len)
    }

    /// `len` elements from `off`, as an exclusive slice.
    ///
    /// # Safety
    /// As for `range`, and nothing else may read the range while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range_mut(&self, off: usize, len: usize) -> &mut [f32] {
        assert!(off + len <= self.len(), "buffer range out of bounds");
        std::slice::from_raw_parts_mut(self.as_ptr().add(off), len)
    }
}

/// An event: recorded on a stream, complete once that stream has run past it.
/// Re-recording targets the newest record, as `cudaEventRecord` does.
#[derive(Clone)]
pub struct Event {
    inner: Arc<EventInner>,
}

struct EventInner {
    state: Mutex<(u64, u64)>, // (records issued, records completed)
    cv: Condvar,
}

impl Default for Event {
    fn default() -> Self {
        Self::new()
    }
}

impl Event {
    pub fn new() -> Self {
        Self {
            inner: Arc::new(EventInner {
                state: Mutex::new((0, 0)),
                cv: Condvar::new(),
            }),
        }
    }

    /// True when every record issued so far has completed (an unrecorded event is complete).
    pub fn query(&self) -> bool {
        let s = self.inner.state.lock().expect("event lock");
        s.1 >= s.0
    }

    /// Blocks the host until the newest record completes.
    pub fn synchronize(&self) {
        let target = self.inner.state.lock().expect("event lock").0;
        self.wait_for(target);
    }

    /// Issues a record that the host completes itself with `complete_on_host` (a launch
    /// gate: streams waiting on it hold until the host has enqueued a whole step).
    pub fn record_on_host(&self) -> u64 {
        self.issue()
    }

    pub fn complete_on_host(&self, n: u64) {
        self.complete(n)
    }

    fn issue(&self) -> u64 {
        let mut s = self.inner.state.lock().expect("event lock");
        s.0 += 1;
        s.0
    }

    fn complete(&self, n: u64) {
        let mut s = self.inner.state.lock().expect("event lock");
        s.1 = s.1.max(n);
        self.inner.cv.notify_all();
    }

    fn target(&self) -> u64 {
        self.inner.state.lock().expect("event lock").0
    }

    fn wait_for(&self, n: u64) {
        let mut s = self.inner.state.lock().expect("event lock");
        while s.1 < n {
            s = self.inner.cv.wait(s).expect("event lock");
        }
    }
}

/// One op as the trace shows it.
#[derive(Clone, Debug)]
pub struct TraceEvent {
    pub stream: String,
    pub name: String,
    pub layer: Option<usize>,
    pub bytes: usize,
    pub start_us: f64,
    pub end_us: f64,
}

/// Shared settings and the trace of one CPU device.
pub struct CpuDevice {
    epoch: Instant,
    /// Simulated host↔device link speed in GB/s (f64 bits); 0 = unthrottled.
    link_gbps: AtomicU64,
    /// Random copy delays; the offload engine also poisons released slots.
    pub sanitize: bool,
    trace_on: AtomicBool,
    trace: Mutex<Vec<TraceEvent>>,
    /// One shared link per direction (full duplex, as PCIe: H2D and D2H do not slow each
    /// other), its bandwidth split evenly among the copies crossing it at once.
    link_h2d: SharedLink,
    link_d2h: SharedLink,
}

/// One direction of the simulated link, **processor sharing**: the copies crossing it at
/// once each move at an even share of its bandwidth, as a GPU's copy engines interleave
/// concurrent streams' copies over PCIe. So a small copy issued beside a large one (a
/// sparse decode miss beside the next layers' prefetch) takes about twice its own time,
/// not the large one's rest; the total rate never exceeds the link's. A fluid model kept in
/// virtual time: each copy sleeps until its own bytes are through, woken to recompute when
/// another copy leaves (its share grows).
#[derive(Default)]
struct SharedLink {
    state: Mutex<LinkState>,
    cv: Condvar,
}

#[derive(Default)]
struct LinkState {
    active: Vec<(u64, f64)>, // (copy, bytes still to cross)
    next: u64,
    updated: Option<Instant>, // when `active` was last brought forward
}

impl LinkState {
    /// Moves every active copy forward by its even share of the bytes `bytes_per_s` has
    /// carried since the last update.
    fn advance(&mut self, now: Instant, bytes_per_s: f64) {
        if let (Some(t), n) = (self.updated, self.active.len()) {
            if n > 0 {
                let each = now.saturating_duration_since(t).as_secs_f64() * bytes_per_s / n as f64;
                for a in &mut self.active {
                    a.1 -= each;
                }
            }
        }
        self.updated = Some(now);
    }
}

impl SharedLink {
    /// A copy of `bytes` starts crossing; `finish` blocks until it is through.
    fn start(&self, bytes: usize, bytes_per_s: f64) -> u64 {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.advance(Instant::now(), bytes_per_s);
        let id = s.next;
        s.next += 1;
        s.active.push((id, bytes as f64));
        id
    }

    fn finish(&self, id: u64, bytes_per_s: f64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            s.advance(Instant::now(), bytes_per_s);
            let left = s.active.iter().find(|a| a.0 == id).map_or(0.0, |a| a.1);
            if left <= 0.0 {
                break;
            }
            // At most a second at a time (the loop recomputes the rest): a wait computed
            // from an extreme speed can neither overflow `Duration` nor sleep for years
            // without looking again.
            let wait = (left * s.active.len() as f64 / bytes_per_s).clamp(0.0, 1.0);
            let wait = Duration::try_from_secs_f64(wait).unwrap_or(Duration::from_secs(1));
            s = self
                .cv
                .wait_timeout(s, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        s.active.retain(|a| a.0 != id);
        self.cv.notify_all(); // the others' shares grow: they recompute their deadlines
    }
}

impl CpuDevice {
    pub fn new(link_gbps: f64, sanitize: bool) -> Arc<Self> {
        Arc::new(Self {
            epoch: Instant::now(),
            link_gbps: AtomicU64::new(link_gbps.to_bits()),
            sanitize,
            trace_on: AtomicBool::new(false),
            trace: Mutex::new(Vec::new()),
            link_h2d: SharedLink::default(),
            link_d2h: SharedLink::default(),
        })
    }

    /// Simulated host↔device link speed in GB/s; 0 = unthrottled.
    pub fn link_gbps(&self) -> f64 {
        f64::from_bits(self.link_gbps.load(Ordering::Relaxed))
    }

    /// Copies started from now on cross a link of `gbps` (`strata bench offload` sizes it
    /// from compute measured just before each round).
    pub fn set_link_gbps(&self, gbps: f64) {
        self.link_gbps.store(gbps.to_bits(), Ordering::Relaxed);
    }

    pub fn set_tracing(&self, on: bool) {
        self.trace_on.store(on, Ordering::Relaxed);
    }

    pub fn take_trace(&self) -> Vec<TraceEvent> {
        std::mem::take(&mut *self.trace.lock().expect("trace lock"))
    }

    pub(crate) fn now_us(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1e6
    }

    pub(crate) fn record(&self, ev: TraceEvent) {
        if self.trace_on.load(Ordering::Relaxed) {
            self.trace.lock().expect("trace lock").push(ev);
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// An in-order queue of work run by its own thread.
pub struct Stream {
    name: String,
    tx: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    dev: Arc<CpuDevice>,
}

/// What a traced op is, for the trace and the throttle.
pub struct OpInfo {
    pub name: &'static str,
    pub layer: Option<usize>,
    pub bytes: usize,
}

impl Stream {
    pub fn new(dev: &Arc<CpuDevice>, name: &str) -> anyhow::Result<Self> {
        let (tx, rx) = channel::<Job>();
        let worker = crate::threads::spawn(&format!("stream-{name}"), move || {
            // The link throttle sleeps after each copy: with Linux's default 50 µs
            // timer slack every small copy would cost ~50 µs more than its bytes.
            #[cfg(target_os = "linux")]
            // SAFETY: sets this thread's timer slack; no pointers involved.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
            }
            for job in rx {
                job();
            }
        })?;
        Ok(Self {
            name: name.to_string(),
            tx: Some(tx),
            worker: Some(worker),
            dev: Arc::clone(dev),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn push(&self, job: Job) {
        self.tx
            .as_ref()
            .expect("stream open")
            .send(job)
            .expect("stream worker alive");
    }

    /// Enqueues `f`; it runs after everything enqueued before it on this stream.
    pub fn launch(&self, info: OpInfo, f: impl FnOnce() + Send + 'static) {
        let dev = Arc::clone(&self.dev);
        let stream = self.name.clone();
        self.push(Box::new(move || {
            let start = dev.now_us();
            f();
            let end = dev.now_us();
            dev.record(TraceEvent {
                stream,
                name: info.name.into(),
                layer: info.layer,
                bytes: info.bytes,
                start_us: start,
                end_us: end,
            });
        }));
    }

    /// Enqueues an async copy of `len` f32s, `src[src_off..]` → `dst[dst_off..]`.
    #[allow(clippy::too_many_arguments)]
    pub fn copy(
        &self,
        name: &'static str,
        layer: Option<usize>,
        src: &Buffer,
        src_off: usize,
        dst: &Buffer,
        dst_off: usize,
        len: usize,
    ) {
        assert!(
            src_off + len <= src.len() && dst_off + len <= dst.len(),
            "copy {name} out of bounds"
        );
        let link = Link::between(src.space(), dst.space());
        let (s, d) = (
            src.as_ptr().wrapping_add(src_off),
            dst.as_ptr().wrapping_add(dst_off),
        );
        // The clones keep both buffers alive until the copy has run.
        let keep = (src.clone(), dst.clone());
        // SAFETY: in bounds (above) of buffers kept alive by `keep`; ordering is the
        // caller's contract (events).
        unsafe {
            self.copy_raw(
                name,
                layer,
                s as *const u8,
                d as *mut u8,
                len * 4,
                link,
                keep,
            )
        }
    }

    /// Enqueues an async copy of `bytes` from `src` to `dst`. Copies that cross the link
    /// are throttled to its speed; under the sanitizer every copy first sleeps a random
    /// while, so a missing wait shows up. `keep` is dropped after the copy ran.
    ///
    /// # Safety
    /// Both ranges must be valid for `bytes` until the copy has run (`keep` may own them);
    /// ordering against other streams is the caller's, by events.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn copy_raw(
        &self,
        name: &'static str,
        layer: Option<usize>,
        src: *const u8,
        dst: *mut u8,
        bytes: usize,
        link: Link,
        keep: impl Send + 'static,
    ) {
        self.copy_batch_raw(name, layer, vec![(src, dst, bytes)], link, keep)
    }

    /// Enqueues several copies (`(src, dst, bytes)`, all crossing `link` the same way) as
    /// one op: one copy on the link, throttled for their total bytes (sharing the link with
    /// other streams' copies meanwhile), as one batched DMA submission
    /// (`cudaMemcpyBatchAsync`) moves scattered ranges.
    ///
    /// # Safety
    /// As for `copy_raw`, for every range.
    pub unsafe fn copy_batch_raw(
        &self,
        name: &'static str,
        layer: Option<usize>,
        copies: Vec<(*const u8, *mut u8, usize)>,
        link: Link,
        keep: impl Send + 'static,
    ) {
        let dev = Arc::clone(&self.dev);
        // Addresses as integers: the worker dereferences them when the copy runs.
        let copies: Vec<(usize, usize, usize)> = copies
            .into_iter()
            .map(|(s, d, n)| (s as usize, d as usize, n))
            .collect();
        let bytes = copies.iter().map(|c| c.2).sum();
        self.launch(OpInfo { name, layer, bytes }, move || {
            if dev.sanitize {
                std::thread::sleep(Duration::from_micros(rand::random_range(0..1500)));
            }
            let gbps = dev.link_gbps();
            let link = match (gbps > 0.0, link) {
                (false, _) | (_, Link::None) => None,
                (true, Link::H2D) => Some(&dev.link_h2d),
                (true, Link::D2H) => Some(&dev.link_d2h),
            };
            let bytes_per_s = gbps * 1e9;
            let on_link = link.map(|l| l.start(bytes, bytes_per_s));
            for (src, dst, n) in copies {
                // SAFETY: the caller's contract (valid ranges, ordered by events).
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
            }
            if let (Some(link), Some(id)) = (link, on_link) {
                link.finish(id, bytes_per_s);
            }
            drop(keep);
        });
    }

    /// Enqueues a record of `ev`: it completes when this stream reaches this point.
    pub fn record(&self, ev: &Event) {
        let n = ev.issue();
        let ev = ev.clone();
        self.push(Box::new(move || ev.complete(n)));
    }

    /// Makes later work on this stream wait for the newest record of `ev` (as of now).
    /// A wait that actually stalls the stream shows in the trace as `wait:<what>`.
    pub fn wait(&self, ev: &Event, what: &'static str) {
        let n = ev.target();
        if n == 0 {
            return;
        }
        let ev = ev.clone();
        let dev = Arc::clone(&self.dev);
        let stream = self.name.clone();
        self.push(Box::new(move || {
            if ev.inner.state.lock().expect("event lock").1 >= n {
                return;
            }
            let start = dev.now_us();
            ev.wait_for(n);
            dev.record(TraceEvent {
                stream,
                name: format!("wait:{what}"),
                layer: None,
                bytes: 0,
                start_us: start,
                end_us: dev.now_us(),
            });
        }));
    }

    /// Enqueues a fill of `bytes` at `dst` with `byte` (the sanitizer's poison).
    ///
    /// # Safety
    /// As for `copy_raw`.
    pub unsafe fn fill_raw(
        &self,
        name: &'static str,
        layer: Option<usize>,
        dst: *mut u8,
        bytes: usize,
        byte: u8,
    ) {
        let dst = dst as usize;
        self.launch(OpInfo { name, layer, bytes }, move || {
            // SAFETY: the caller's contract.
            unsafe { std::ptr::write_bytes(dst as *mut u8, byte, bytes) }
        });
    }

    /// Blocks the host until everything enqueued so far has run.
    pub fn synchronize(&self) {
        let ev = Event::new();
        self.record(&ev);
        ev.synchronize();
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        drop(self.tx.take()); // closes the queue; the worker drains it and exits
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_stream_runs_in_order() {
        let dev = CpuDevice::new(0.0, false);
        let s = Stream::new(&dev, "s").unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..50 {
            let log = log.clone();
            s.launch(
                OpInfo {
                    name: "op",
                    layer: None,
                    bytes: 0,
                },
                move || log.lock().unwrap().push(i),
            );
        }
        s.synchronize();
        assert_eq!(*log.lock().unwrap(), (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn a_wait_holds_a_copy_until_the_event_is_reached() {
        let dev = CpuDevice::new(0.0, false);
        let (compute, copy) = (
            Stream::new(&dev, "compute").unwrap(),
            Stream::new(&dev, "copy").unwrap(),
        );
        let src = Buffer::alloc(4, MemSpace::Device).unwrap();
        let dst = Buffer::alloc(4, MemSpace::Host).unwrap();
        let done = Event::new();
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let g = gate.clone();
        let s2 = src.clone();
        compute.launch(
            OpInfo {
                name: "produce",
                layer: None,
                bytes: 0,
            },
            move || {
                // Block until the test opens the gate, then write.
                let (m, cv) = &*g;
                let mut open = m.lock().unwrap();
                while !*open {
                    open = cv.wait(open).unwrap();
                }
                unsafe { s2.range_mut(0, 4).copy_from_slice(&[1.0, 2.0, 3.0, 4.0]) };
            },
        );
        compute.record(&done);
        copy.wait(&done, "done");
        copy.copy("d2h", None, &src, 0, &dst, 0, 4);
        let copied = Event::new();
        copy.record(&copied);
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            !done.query() && !copied.query(),
            "the copy ran before its event"
        );
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        copied.synchronize();
        assert!(done.query());
        assert_eq!(unsafe { dst.range(0, 4) }, &[1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn a_wait_targets_the_record_current_when_it_was_enqueued() {
        let dev = CpuDevice::new(0.0, false);
        let (a, b) = (
            Stream::new(&dev, "a").unwrap(),
            Stream::new(&dev, "b").unwrap(),
        );
        let ev = Event::new();
        assert!(ev.query(), "a never-recorded event is complete");
        let hits = Arc::new(AtomicUsize::new(0));
        a.record(&ev); // record 1
        a.synchronize();
        b.wait(&ev, "ev"); // waits for record 1 only: must not block on the later record 2
        let h = hits.clone();
        b.launch(
            OpInfo {
                name: "after",
                layer: None,
                bytes: 0,
            },
            move || {
                h.fetch_add(1, Ordering::SeqCst);
            },
        );
        let gate = Arc::new(Mutex::new(()));
        let hold = gate.lock().unwrap();
        let g = gate.clone();
        a.launch(
            OpInfo {
                name: "block",
                layer: None,
                bytes: 0,
            },
            move || drop(g.lock().unwrap()),
        );
        a.record(&ev); // record 2, stuck behind "block"
        b.synchronize();
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        assert!(!ev.query(), "record 2 is still pending");
        drop(hold);
        ev.synchronize();
        assert!(ev.query());
    }

    #[test]
    fn the_link_throttle_slows_host_device_copies_only() {
        let dev = CpuDevice::new(0.1, false); // 0.1 GB/s: 4 MB takes 40 ms
        let s = Stream::new(&dev, "copy").unwrap();
        let n = 1 << 20;
        let (d1, d2, h) = (
            Buffer::alloc(n, MemSpace::Device).unwrap(),
            Buffer::alloc(n, MemSpace::Device).unwrap(),
            Buffer::alloc(n, MemSpace::Host).unwrap(),
        );
        let t = Instant::now();
        s.copy("d2d", None, &d1, 0, &d2, 0, n);
        s.synchronize();
        let d2d = t.elapsed();
        let t = Instant::now();
        s.copy("d2h", None, &d1, 0, &h, 0, n);
        s.synchronize();
        let d2h = t.elapsed();
        assert!(
            d2h >= Duration::from_millis(40),
            "throttled copy took {d2h:?}"
        );
        assert!(d2d < d2h, "device-to-device copies are not throttled");
    }

    #[test]
    fn copies_on_the_link_at_once_share_its_bandwidth() {
        // 0.1 GB/s: the large copy takes 40 ms alone, the small one 4 ms alone.
        let dev = CpuDevice::new(0.1, false);
        let (big, small) = (
            Stream::new(&dev, "big").unwrap(),
            Stream::new(&dev, "small").unwrap(),
        );
        let (n, m) = (1_000_000, 100_000); // f32s: 4 MB and 0.4 MB
        let (h, d) = (
            Buffer::alloc(n, MemSpace::Host).unwrap(),
            Buffer::alloc(n, MemSpace::Device).unwrap(),
        );
        let t = Instant::now();
        big.copy("big", None, &h, 0, &d, 0, n);
        std::thread::sleep(Duration::from_millis(5));
        let t_small = Instant::now();
        small.copy("small", None, &h, 0, &d, 0, m);
        small.synchronize();
        let small_took = t_small.elapsed();
        big.synchronize();
        let all = t.elapsed();
        // Sharing: ~8 ms (half the link for 4 ms of bytes); first come, first served would
        // make it wait for the large copy's ~35 ms left.
        assert!(
            small_took < Duration::from_millis(25),
            "small copy took {small_took:?}"
        );
        // The link's total rate is not exceeded: 4.4 MB at 0.1 GB/s.
        assert!(all >= Duration::from_millis(44), "both took {all:?}");
    }

    #[test]
    fn allocation_failure_is_an_error() {
        let err = Buffer::alloc(usize::MAX / 8, MemSpace::Host)
            .err()
            .expect("cannot allocate that much");
        assert!(err.to_string().contains("out of host memory"), "{err}");
    }
}
