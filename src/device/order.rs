//! The stream-ordering checker: proves that work on different streams touching the same
//! memory is ordered by events, whatever the timing — ThreadSanitizer's vector clocks,
//! applied to device streams and the host.
//!
//! Why: the CPU device computes on the calling thread, so by the time a copy is queued the
//! compute it should wait for has already run, and the kernel emulator runs kernels at
//! their launch; a missing "copy waits for compute" edge never shows as wrong data on a
//! CPU, only as silent KV corruption on a GPU. The relation a GPU enforces is
//! happens-before over queued work, and this checks it deterministically.
//!
//! The model (CUDA's semantics, whatever the device underneath does):
//! - every actor (each stream, and the host) has a vector clock; an access is tagged with
//!   its actor's own component (its *epoch*);
//! - `record(s, e)` snapshots `s`'s clock into `e` (a newer record replaces the older, as
//!   `cudaEventRecord` does), then advances `s`'s epoch;
//! - `wait(s, e)` joins `e`'s newest snapshot into `s`'s clock (`cudaStreamWaitEvent`);
//! - the host learns what it synchronizes with: an event it queried complete or waited
//!   for, a stream or every stream it synchronized; work queued afterwards on any stream
//!   happens after all of that (it is queued later in real time), and host accesses made
//!   before queuing happen before it;
//! - access `a` happens before access `b` iff `a`'s epoch is in `b`'s actor's clock.
//!
//! Two accesses to overlapping elements of one allocation, at least one a write, by
//! different actors, neither happening before the other, are a race: the access that
//! completes the pair fails with an error naming both operations (actor, op, layer, span)
//! and the event that would have ordered them.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use anyhow::Result;

use super::handles::{EventId, MemId, Span, StreamRole};

/// Who touches memory: a stream, or the host itself (the disk tier's IO threads read and
/// write host staging memory directly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Actor {
    Host,
    Stream(StreamRole),
}

impl fmt::Display for Actor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Actor::Host => f.write_str("host"),
            Actor::Stream(s) => s.fmt(f),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

/// What an access was, for the report: the operation's name, its layer, the span it
/// declared as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    pub name: &'static str,
    pub layer: Option<usize>,
    pub span: Span,
}

impl Op {
    pub fn new(name: &'static str, layer: Option<usize>, span: Span) -> Self {
        Self { name, layer, span }
    }
}

/// One access as the shadow memory keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    actor: usize,
    epoch: u64,
    access: Access,
    op: Op,
}

/// The accesses a range of elements has seen: the last write and, after it, each actor's
/// newest read (an older read by the same actor is implied by the newer one).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Segment {
    end: usize,
    write: Option<Stamp>,
    reads: Vec<Stamp>,
}

impl Segment {
    fn same_state(&self, other: &Segment) -> bool {
        self.write == other.write && self.reads == other.reads
    }
}

type Clock = Vec<u64>;

fn join(into: &mut Clock, from: &Clock) {
    if into.len() < from.len() {
        into.resize(from.len(), 0);
    }
    for (a, &b) in into.iter_mut().zip(from) {
        *a = (*a).max(b);
    }
}

fn at(c: &Clock, actor: usize) -> u64 {
    c.get(actor).copied().unwrap_or(0)
}

/// An event's newest record: the recording stream's clock then.
struct Snapshot {
    clock: Clock,
    by: usize,
}

#[derive(Default)]
struct EventInfo {
    snapshot: Option<Snapshot>,
    /// The label of the first wait on it (`OffloadDevice::wait`'s `what`), for reports.
    label: Option<&'static str>,
}

const HOST: usize = 0;

/// The checker's state: clocks per actor, snapshots per event, and shadow memory per
/// allocation (segments of elements keyed by their first element).
pub struct OrderChecker {
    actors: Vec<Actor>, // index → actor; `HOST` first
    clocks: Vec<Clock>, // per actor
    events: Vec<EventInfo>,
    shadow: HashMap<MemId, BTreeMap<usize, Segment>>,
}

impl Default for OrderChecker {
    fn default() -> Self {
        Self::new()
    }
}

impl OrderChecker {
    pub fn new() -> Self {
        Self {
            actors: vec![Actor::Host],
            clocks: vec![vec![1]],
            events: Vec::new(),
            shadow: HashMap::new(),
        }
    }

    fn index(&mut self, a: Actor) -> usize {
        if let Some(i) = self.actors.iter().position(|&x| x == a) {
            return i;
        }
        self.actors.push(a);
        let i = self.actors.len() - 1;
        let mut c = vec![0; i + 1];
        c[i] = 1;
        self.clocks.push(c);
        i
    }

    /// Advances actor `i`'s epoch: what it does from now on is not covered by the clocks
    /// others took from it so far.
    fn tick(&mut self, i: usize) {
        let c = &mut self.clocks[i];
        if c.len() <= i {
            c.resize(i + 1, 0);
        }
        c[i] += 1;
    }

    /// Work queued on stream `s` now: after everything the host knows has happened, and
    /// after every host access so far.
    fn enqueue(&mut self, s: StreamRole) -> usize {
        let i = self.index(Actor::Stream(s));
        let host = self.clocks[HOST].clone();
        join(&mut self.clocks[i], &host);
        self.tick(HOST);
        i
    }

    fn event(&mut self, e: EventId) -> &mut EventInfo {
        if self.events.len() <= e.0 {
            self.events.resize_with(e.0 + 1, EventInfo::default);
        }
        &mut self.events[e.0]
    }

    /// `record(s, e)`.
    pub fn record(&mut self, s: StreamRole, e: EventId) {
        let i = self.enqueue(s);
        let clock = self.clocks[i].clone();
        self.event(e).snapshot = Some(Snapshot { clock, by: i });
        self.tick(i);
    }

    /// `wait(s, e)`: an event never recorded orders nothing (CUDA's wait on it returns
    /// at once).
    pub fn wait(&mut self, s: StreamRole, e: EventId, label: &'static str) {
        let i = self.enqueue(s);
        let info = self.event(e);
        info.label.get_or_insert(label);
        if let Some(snap) = &info.snapshot {
            let c = snap.clock.clone();
            join(&mut self.clocks[i], &c);
        }
    }

    /// The host saw `e` complete (a query that answered true, an event synchronize).
    pub fn host_saw(&mut self, e: EventId) {
        if let Some(snap) = &self.event(e).snapshot {
            let c = snap.clock.clone();
            join(&mut self.clocks[HOST], &c);
        }
    }

    /// The host synchronized with stream `s` (everything queued on it has run).
    pub fn host_synced(&mut self, s: StreamRole) {
        let i = self.index(Actor::Stream(s));
        let c = self.clocks[i].clone();
        join(&mut self.clocks[HOST], &c);
        self.tick(i);
    }

    /// The host synchronized with every stream.
    pub fn host_synced_all(&mut self) {
        for i in 1..self.actors.len() {
            let c = self.clocks[i].clone();
            join(&mut self.clocks[HOST], &c);
            self.tick(i);
        }
    }

    /// Declares that `actor` accesses `span` (queued on a stream, or done by the host
    /// now); errors if that races with an earlier access.
    pub fn access(&mut self, actor: Actor, access: Access, op: Op, span: Span) -> Result<()> {
        if span.len == 0 {
            return Ok(());
        }
        let i = match actor {
            Actor::Host => HOST,
            Actor::Stream(s) => self.enqueue(s),
        };
        let me = Stamp {
            actor: i,
            epoch: at(&self.clocks[i], i),
            access,
            op,
        };
        let (lo, hi) = (span.off, span.off + span.len);
        let segs = self.shadow.entry(span.mem).or_default();
        split(segs, lo);
        split(segs, hi);
        fill_gaps(segs, lo, hi);
        // Check every segment first, so a race leaves the shadow untouched.
        let clock = &self.clocks[i];
        let race = segs.range(lo..hi).find_map(|(&start, seg)| {
            let earlier = seg.write.iter().chain(match access {
                Access::Write => seg.reads.as_slice(),
                Access::Read => &[],
            });
            earlier
                .filter(|p| p.actor != i && p.epoch > at(clock, p.actor))
                .map(|p| (*p, (start, seg.end)))
                .next()
        });
        if let Some((prev, overlap)) = race {
            return Err(self.race(&prev, &me, span.mem, overlap));
        }
        let segs = self.shadow.get_mut(&span.mem).expect("shadow");
        for (_, seg) in segs.range_mut(lo..hi) {
            match access {
                Access::Write => {
                    seg.write = Some(me);
                    seg.reads.clear();
                }
                Access::Read => match seg.reads.iter_mut().find(|r| r.actor == i) {
                    Some(r) => *r = me,
                    None => seg.reads.push(me),
                },
            }
        }
        coalesce(segs, lo, hi);
        Ok(())
    }

    fn race(
        &self,
        prev: &Stamp,
        now: &Stamp,
        mem: MemId,
        (lo, hi): (usize, usize),
    ) -> anyhow::Error {
        let what = |s: &Stamp| {
            let verb = match s.access {
                Access::Read => "reads",
                Access::Write => "writes",
            };
            let layer =
                s.op.layer
                    .map(|l| format!(" (layer {l})"))
                    .unwrap_or_default();
            format!(
                "{} `{}`{layer} {verb} [{}, {})",
                self.actors[s.actor],
                s.op.name,
                s.op.span.off,
                s.op.span.off + s.op.span.len
            )
        };
        let hint = self.ordering_event(prev, now);
        anyhow::anyhow!(
            "stream-order race on allocation {} elements [{lo}, {hi}): {} with no happens-before path from {}; {hint}",
            mem.0,
            what(now),
            what(prev)
        )
    }

    /// Which event would have ordered `prev` before `now`: the first one recorded on
    /// `prev`'s stream after it, if any.
    fn ordering_event(&self, prev: &Stamp, now: &Stamp) -> String {
        let (from, to) = (self.actors[prev.actor], self.actors[now.actor]);
        let first = self
            .events
            .iter()
            .enumerate()
            .filter_map(|(id, e)| {
                let s = e.snapshot.as_ref()?;
                let epoch = at(&s.clock, prev.actor);
                (s.by == prev.actor && epoch >= prev.epoch).then_some((epoch, id, e.label))
            })
            .min();
        let sync = match to {
            Actor::Host => "the host must see it complete (query or synchronize)".to_string(),
            Actor::Stream(_) => format!("{to} must wait for it"),
        };
        match (from, first) {
            (Actor::Host, _) => format!("the host must do its access before queuing {to}'s"),
            (_, Some((_, id, label))) => {
                let label = label.map(|l| format!(" '{l}'")).unwrap_or_default();
                format!("event {id}{label} was recorded on {from} after it: {sync}")
            }
            (_, None) => {
                format!("no event was recorded on {from} after it: record one there; {sync}")
            }
        }
    }
}

/// Splits the segment containing `at` (if any) so that a segment starts there.
fn split(segs: &mut BTreeMap<usize, Segment>, at: usize) {
    let Some((&start, seg)) = segs.range_mut(..at).next_back() else {
        return;
    };
    if seg.end <= at {
        return;
    }
    let tail = Segment {
        end: seg.end,
        write: seg.write,
        reads: seg.reads.clone(),
    };
    seg.end = at;
    debug_assert!(start < at);
    segs.insert(at, tail);
}

/// Adds empty segments over the parts of `[lo, hi)` no segment covers.
fn fill_gaps(segs: &mut BTreeMap<usize, Segment>, lo: usize, hi: usize) {
    let mut gaps = Vec::new();
    let mut cur = lo;
    for (&start, seg) in segs.range(lo..hi) {
        if start > cur {
            gaps.push((cur, start));
        }
        cur = seg.end;
    }
    if cur < hi {
        gaps.push((cur, hi));
    }
    for (a, b) in gaps {
        segs.insert(
            a,
            Segment {
                end: b,
                write: None,
                reads: Vec::new(),
            },
        );
    }
}

/// Merges neighbouring segments with the same state in and around `[lo, hi)`, so the
/// shadow stays as coarse as the accesses (a layer written whole is one segment again).
fn coalesce(segs: &mut BTreeMap<usize, Segment>, lo: usize, hi: usize) {
    let first = segs.range(..lo).next_back().map_or(lo, |(&s, _)| s);
    let keys: Vec<usize> = segs.range(first..=hi).map(|(&k, _)| k).collect();
    let mut prev: Option<usize> = None;
    for k in keys {
        if let Some(p) = prev {
            let same = {
                let (a, b) = (&segs[&p], &segs[&k]);
                a.end == k && a.same_state(b)
            };
            if same {
                let b = segs.remove(&k).expect("segment");
                segs.get_mut(&p).expect("segment").end = b.end;
                continue;
            }
        }
        prev = Some(k);
    }
}

/// Whether the checker is on unless a caller says otherwise: in debug builds, in builds
/// with the `order-check` feature (every `cargo test`: the crate's dev-dependency on
/// itself turns it on), and where `STRATA_CHECK_ORDER=1`.
pub fn on_by_default() -> bool {
    if cfg!(debug_assertions) || cfg!(feature = "order-check") {
        return true;
    }
    std::env::var("STRATA_CHECK_ORDER").is_ok_and(|v| v == "1")
}

/// What a benchmark prints after its report when the checker is on by default: its
/// bookkeeping (a lock and interval maps for every copy and kernel) is in every offload
/// and serving timing, and `cargo test --release` leaves exactly such a
/// `target/release/strata` behind (the dev-dependency's feature), so a run timed after
/// the tests is not the binary a user runs.
pub fn timing_note() -> Option<&'static str> {
    on_by_default().then_some(
        "note: the stream-ordering checker is on (a debug or `cargo test` build, or \
         STRATA_CHECK_ORDER=1): the offload and serving timings above include its \
         bookkeeping; time a binary from `cargo build --release`",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: StreamRole = StreamRole::Compute;
    const P: StreamRole = StreamRole::Prefetch;
    const O: StreamRole = StreamRole::Offload(0);

    fn span(mem: usize, off: usize, len: usize) -> Span {
        Span {
            mem: MemId(mem),
            off,
            len,
        }
    }

    fn op(name: &'static str, s: Span) -> Op {
        Op::new(name, Some(3), s)
    }

    fn write(k: &mut OrderChecker, s: StreamRole, name: &'static str, sp: Span) -> Result<()> {
        k.access(Actor::Stream(s), Access::Write, op(name, sp), sp)
    }

    fn read(k: &mut OrderChecker, s: StreamRole, name: &'static str, sp: Span) -> Result<()> {
        k.access(Actor::Stream(s), Access::Read, op(name, sp), sp)
    }

    #[test]
    fn a_copy_that_reads_what_compute_wrote_without_waiting_is_a_race_naming_both_ops() {
        let mut k = OrderChecker::new();
        let slot = span(1, 0, 64);
        write(&mut k, C, "layer", slot).unwrap();
        k.record(C, EventId(0));
        let err = read(&mut k, O, "d2h-k", slot).unwrap_err().to_string();
        assert!(
            err.contains("d2h-offload-0 `d2h-k` (layer 3) reads [0, 64)"),
            "{err}"
        );
        assert!(
            err.contains("compute `layer` (layer 3) writes [0, 64)"),
            "{err}"
        );
        assert!(
            err.contains("event 0 was recorded on compute after it"),
            "{err}"
        );
        assert!(err.contains("d2h-offload-0 must wait for it"), "{err}");
        let err = read(&mut k, StreamRole::Miss, "miss", slot)
            .unwrap_err()
            .to_string();
        assert!(err.contains("event 0 was recorded on compute"), "{err}");
        write(&mut k, C, "layer", slot).unwrap();
        let err = read(&mut k, O, "d2h-k", slot).unwrap_err().to_string();
        assert!(
            err.contains("no event was recorded on compute after it"),
            "{err}"
        );
    }

    #[test]
    fn record_then_wait_orders_a_copy_after_compute() {
        let mut k = OrderChecker::new();
        let slot = span(1, 0, 64);
        write(&mut k, C, "layer", slot).unwrap();
        k.record(C, EventId(0));
        k.wait(O, EventId(0), "slot-compute-done");
        read(&mut k, O, "d2h-k", slot).unwrap();
        // And the next compute on the slot must wait for the offload in turn.
        k.record(O, EventId(1));
        let err = write(&mut k, C, "layer", slot).unwrap_err().to_string();
        assert!(
            err.contains("event 1 was recorded on d2h-offload-0"),
            "{err}"
        );
        k.wait(C, EventId(1), "slot-offload-done");
        write(&mut k, C, "layer", slot).unwrap();
    }

    #[test]
    fn a_wait_queued_before_the_record_it_needs_orders_nothing() {
        let mut k = OrderChecker::new();
        let slot = span(1, 0, 8);
        k.wait(O, EventId(0), "early"); // never recorded yet: returns at once
        write(&mut k, C, "layer", slot).unwrap();
        k.record(C, EventId(0));
        assert!(read(&mut k, O, "d2h", slot).is_err());
    }

    #[test]
    fn a_wait_sees_only_the_newest_record_of_an_event() {
        let mut k = OrderChecker::new();
        let (a, b) = (span(1, 0, 8), span(2, 0, 8));
        write(&mut k, C, "layer-a", a).unwrap();
        k.record(C, EventId(0));
        k.wait(O, EventId(0), "done");
        read(&mut k, O, "d2h-a", a).unwrap();
        // Re-recorded on the offload stream: a wait now orders after *its* work only.
        write(&mut k, C, "layer-b", b).unwrap();
        k.record(O, EventId(0));
        k.wait(P, EventId(0), "done");
        assert!(
            read(&mut k, P, "h2d-b", b).is_err(),
            "compute's write is not ordered"
        );
        read(&mut k, P, "h2d-a", a).unwrap(); // read-read never conflicts
    }

    #[test]
    fn ordering_is_transitive_through_streams() {
        let mut k = OrderChecker::new();
        let m = span(1, 0, 8);
        write(&mut k, C, "layer", m).unwrap();
        k.record(C, EventId(0));
        k.wait(O, EventId(0), "c");
        k.record(O, EventId(1));
        k.wait(P, EventId(1), "o");
        write(&mut k, P, "h2d", m).unwrap();
    }

    #[test]
    fn disjoint_spans_and_reads_never_race_and_one_stream_is_in_order() {
        let mut k = OrderChecker::new();
        write(&mut k, C, "layer", span(1, 0, 8)).unwrap();
        write(&mut k, P, "h2d", span(1, 8, 8)).unwrap();
        write(&mut k, P, "h2d", span(2, 0, 8)).unwrap();
        read(&mut k, C, "x", span(3, 0, 8)).unwrap();
        read(&mut k, P, "y", span(3, 4, 8)).unwrap();
        write(&mut k, P, "h2d", span(2, 0, 8)).unwrap();
        // A partial overlap is found: compute writes [0,8) of 1, prefetch now [4, 12).
        let err = write(&mut k, P, "h2d", span(1, 4, 8))
            .unwrap_err()
            .to_string();
        assert!(err.contains("elements [4, 8)"), "{err}");
    }

    #[test]
    fn a_write_after_unordered_reads_of_two_streams_is_a_race() {
        let mut k = OrderChecker::new();
        let m = span(1, 0, 8);
        read(&mut k, O, "d2h", m).unwrap();
        read(&mut k, P, "peer", m).unwrap();
        k.record(P, EventId(0));
        k.wait(C, EventId(0), "p");
        // Ordered after the prefetch stream's read, not the offload stream's.
        let err = write(&mut k, C, "layer", m).unwrap_err().to_string();
        assert!(err.contains("d2h-offload-0 `d2h`"), "{err}");
    }

    #[test]
    fn the_host_learns_by_query_sync_or_synchronize_and_later_work_follows() {
        let mut k = OrderChecker::new();
        let m = span(1, 0, 8);
        write(&mut k, P, "kv_load", m).unwrap();
        k.record(P, EventId(0));
        // Compute reading the loaded pages before the host saw the load finish: a race.
        assert!(read(&mut k, C, "forward", m).is_err());
        k.host_saw(EventId(0));
        read(&mut k, C, "forward", m).unwrap();
        // A host access of memory a stream wrote needs the host to have synchronized.
        let staging = span(2, 0, 4);
        write(&mut k, O, "stage-out", staging).unwrap();
        let err = k
            .access(Actor::Host, Access::Read, op("io-write", staging), staging)
            .unwrap_err()
            .to_string();
        assert!(err.contains("the host must see it complete"), "{err}");
        k.host_synced(O);
        k.access(Actor::Host, Access::Read, op("io-write", staging), staging)
            .unwrap();
        // Work the stream does after the host synchronized is not covered by it.
        write(&mut k, O, "stage-out", staging).unwrap();
        assert!(k
            .access(Actor::Host, Access::Read, op("io-write", staging), staging)
            .is_err());
        k.host_synced_all();
        k.access(Actor::Host, Access::Write, op("io-read", staging), staging)
            .unwrap();
        // Host accesses happen before work queued after them.
        read(&mut k, P, "stage-in", staging).unwrap();
    }

    #[test]
    fn a_host_access_after_work_was_queued_is_not_before_that_work() {
        let mut k = OrderChecker::new();
        let m = span(1, 0, 8);
        read(&mut k, P, "stage-in", m).unwrap();
        let err = k
            .access(Actor::Host, Access::Write, op("io-read", m), m)
            .unwrap_err()
            .to_string();
        assert!(err.contains("h2d-prefetch `stage-in`"), "{err}");
    }

    #[test]
    fn the_shadow_coalesces_back_to_one_segment_after_a_whole_write() {
        let mut k = OrderChecker::new();
        for r in 0..64 {
            write(&mut k, C, "row", span(1, r, 1)).unwrap();
        }
        assert_eq!(k.shadow[&MemId(1)].len(), 64);
        write(&mut k, C, "layer", span(1, 0, 64)).unwrap();
        assert_eq!(k.shadow[&MemId(1)].len(), 1);
    }
}
