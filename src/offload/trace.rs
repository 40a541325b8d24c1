//! Chrome / Perfetto trace output (`--trace-out`) and overlap figures read from a trace.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};

use crate::device::cpu::stream::TraceEvent;

/// Checks before a run that its trace can be written to `path` (creating or truncating a
/// regular file there, never through a symbolic link: `safe_file::create_private`), so an
/// unwritable `--trace-out` fails before any output is produced.
pub fn check_trace_out(path: &Path) -> Result<()> {
    crate::safe_file::create_private(path, "--trace-out").map(drop)
}

/// Writes `events` as Chrome trace JSON: one track per stream, one slice per op with
/// its layer and bytes. Open in ui.perfetto.dev or chrome://tracing.
pub fn write_chrome_trace(path: &Path, events: &[TraceEvent]) -> Result<()> {
    let mut tids: BTreeMap<&str, usize> = BTreeMap::new();
    for e in events {
        let n = tids.len();
        tids.entry(e.stream.as_str()).or_insert(n);
    }
    let mut out = Vec::with_capacity(events.len() + tids.len());
    for (name, tid) in &tids {
        out.push(serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}));
    }
    for e in events {
        out.push(serde_json::json!({
            "name": e.name, "cat": if is_transfer(e) { "transfer" } else { "compute" }, "ph": "X",
            "pid": 1, "tid": tids[e.stream.as_str()], "ts": e.start_us, "dur": (e.end_us - e.start_us).max(0.0),
            "args": {"layer": e.layer, "bytes": e.bytes, "stream": e.stream},
        }));
    }
    let doc = serde_json::json!({"traceEvents": out, "displayTimeUnit": "ms"});
    let mut f = crate::safe_file::create_private(path, "--trace-out")?;
    std::io::Write::write_all(&mut f, &serde_json::to_vec(&doc)?)
        .with_context(|| format!("writing trace {}", path.display()))
}

/// Host↔device copies (the link traffic).
pub fn is_transfer(e: &TraceEvent) -> bool {
    e.name.starts_with("h2d") || e.name.starts_with("d2h")
}

fn is_compute(e: &TraceEvent) -> bool {
    e.stream == "compute" && !e.name.starts_with("wait:")
}

/// Union of intervals, sorted and merged.
fn merged(mut iv: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    iv.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<(f64, f64)> = Vec::new();
    for (s, e) in iv {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Fraction of link-busy time during which the compute stream was also busy
/// (1.0 = every transfer hidden behind compute).
pub fn overlap_fraction(events: &[TraceEvent]) -> f64 {
    let xfer = merged(
        events
            .iter()
            .filter(|e| is_transfer(e))
            .map(|e| (e.start_us, e.end_us))
            .collect(),
    );
    let comp = merged(
        events
            .iter()
            .filter(|e| is_compute(e))
            .map(|e| (e.start_us, e.end_us))
            .collect(),
    );
    let total: f64 = xfer.iter().map(|(s, e)| e - s).sum();
    if total <= 0.0 {
        return 0.0;
    }
    let mut both = 0.0;
    for &(s, e) in &xfer {
        for &(cs, ce) in &comp {
            let (a, b) = (s.max(cs), e.min(ce));
            if b > a {
                both += b - a;
            }
        }
    }
    both / total
}

/// The names sparse decode's work carries in a trace: the page scoring (the devices'
/// `head_bounds`), the moves of prefetched pages inside the slot (the engine's `select`),
/// and the compute stream's waits for the missed pages and for a slot's prefetch (the
/// engine's `wait`s, traced as `wait:` and what they name).
pub const PAGE_SCORES: &str = "page-scores";
pub const MOVES: [&str; 2] = ["move-k", "move-v"];
const MISSES_WAIT: &str = "wait:misses-fetched";
const SLOT_WAIT: &str = "wait:slot-ready";

/// Where a sparse decode step's own work goes, in ms a step (a trace of `steps` steps):
/// what the compute stream spends beside the model's compute.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct SparseStepParts {
    /// Scoring the pages (the box bound of every candidate page for every query head).
    pub scoring_ms: f64,
    /// Waiting for the pages the prefetch missed.
    pub miss_waits_ms: f64,
    /// Moving prefetched pages to their places in the slot.
    pub moves_ms: f64,
    /// Waiting for a layer's prefetch (the link behind).
    pub prefetch_waits_ms: f64,
}

impl SparseStepParts {
    pub fn of(events: &[TraceEvent], steps: usize) -> Self {
        let ms = |names: &[&str]| {
            events
                .iter()
                .filter(|e| e.stream == "compute" && names.contains(&e.name.as_str()))
                .map(|e| (e.end_us - e.start_us).max(0.0))
                .fold(0.0, |a, d| a + d) // (an empty `sum` is -0.0, printed "-0.00")
                / 1e3
                / steps.max(1) as f64
        };
        Self {
            scoring_ms: ms(&[PAGE_SCORES]),
            miss_waits_ms: ms(&[MISSES_WAIT]),
            moves_ms: ms(&MOVES),
            prefetch_waits_ms: ms(&[SLOT_WAIT]),
        }
    }
}

/// Bytes moved over the link, per direction: (host→device, device→host).
pub fn link_bytes(events: &[TraceEvent]) -> (usize, usize) {
    let sum = |p: &str| {
        events
            .iter()
            .filter(|e| e.name.starts_with(p))
            .map(|e| e.bytes)
            .sum()
    };
    (sum("h2d"), sum("d2h"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(stream: &str, name: &str, s: f64, e: f64) -> TraceEvent {
        TraceEvent {
            stream: stream.into(),
            name: name.into(),
            layer: None,
            bytes: 10,
            start_us: s,
            end_us: e,
        }
    }

    #[test]
    fn overlap_counts_only_time_shared_with_compute() {
        let evs = [
            ev("compute", "layer", 0.0, 10.0),
            ev("h2d-prefetch", "h2d-k", 5.0, 15.0), // half hidden
            ev("compute", "wait:slot-ready", 10.0, 15.0), // a stall is not compute
        ];
        assert!((overlap_fraction(&evs) - 0.5).abs() < 1e-9);
        assert_eq!(link_bytes(&evs), (10, 0));
    }

    #[test]
    fn sparse_step_parts_sum_the_compute_streams_sparse_work_per_step() {
        let evs = [
            ev("compute", "layer", 0.0, 100.0),
            ev("compute", PAGE_SCORES, 0.0, 400.0),
            ev("compute", PAGE_SCORES, 500.0, 600.0),
            ev("compute", "move-k", 600.0, 700.0),
            ev("compute", "move-v", 700.0, 900.0),
            ev("compute", "wait:misses-fetched", 900.0, 1000.0),
            ev("compute", "wait:slot-ready", 1000.0, 1050.0),
            ev("h2d-miss", "h2d-miss-k", 0.0, 5000.0), // not the compute stream's
        ];
        let p = SparseStepParts::of(&evs, 2);
        assert_eq!(
            p,
            SparseStepParts {
                scoring_ms: 0.25,
                miss_waits_ms: 0.05,
                moves_ms: 0.15,
                prefetch_waits_ms: 0.025,
            }
        );
    }

    #[test]
    fn trace_json_has_one_track_per_stream() {
        let dir = std::env::temp_dir().join(format!("strata-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.json");
        write_chrome_trace(
            &p,
            &[
                ev("compute", "layer", 0.0, 1.0),
                ev("d2h-offload-0", "d2h-k", 0.5, 2.0),
            ],
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        let evs = v["traceEvents"].as_array().unwrap();
        assert_eq!(evs.iter().filter(|e| e["ph"] == "M").count(), 2);
        assert_eq!(evs.iter().filter(|e| e["ph"] == "X").count(), 2);
        assert_eq!(
            evs.iter().find(|e| e["name"] == "d2h-k").unwrap()["cat"],
            "transfer"
        );
    }
}
