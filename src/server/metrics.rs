//! `GET /metrics`: Prometheus text (OpenMetrics) through the `prometheus-client` crate, with
//! names in vLLM's style (`strata:num_requests_running`). The engine thread updates the
//! gauges and counters after every step; the registry is read only by the handler.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::serve::scheduler::Scheduler;
use crate::serve::EngineStats;

/// The KV tier a gauge describes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabel {
    pub tier: &'static str,
}

const GPU: TierLabel = TierLabel { tier: "gpu" };
const CPU: TierLabel = TierLabel { tier: "cpu" };
const DISK: TierLabel = TierLabel { tier: "disk" };

pub struct Metrics {
    registry: Registry,
    running: Gauge,
    waiting: Gauge,
    /// Used fraction of each tier, 0..1 (prefix-cache pages nobody holds count as free).
    kv_usage: Family<TierLabel, Gauge<f64, AtomicU64>>,
    kv_free_blocks: Family<TierLabel, Gauge>,
    preemptions: Counter,
    blocks_stored: Counter,
    blocks_loaded: Counter,
    recomputations: Counter,
    blocks_stored_disk: Counter,
    blocks_loaded_disk: Counter,
    checksum_failures: Counter,
    prefix_blocks_from_disk: Counter,
    blocks_demoted: Counter,
    demotion_failures: Counter,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    /// Requests cancelled because their client went away.
    cancelled: Counter,
    pub ttft: Histogram,
    pub itl: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Family::default(),
            kv_free_blocks: Family::default(),
            preemptions: Counter::default(),
            blocks_stored: Counter::default(),
            blocks_loaded: Counter::default(),
            recomputations: Counter::default(),
            blocks_stored_disk: Counter::default(),
            blocks_loaded_disk: Counter::default(),
            checksum_failures: Counter::default(),
            prefix_blocks_from_disk: Counter::default(),
            blocks_demoted: Counter::default(),
            demotion_failures: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            cancelled: Counter::default(),
            // 1 ms .. ~65 s
            ttft: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            // 1 ms .. ~4 s
            itl: Histogram::new(exponential_buckets(0.001, 2.0, 13)),
        };
        let r = &mut m.registry;
        r.register(
            "strata:num_requests_running",
            "Requests in the running batch",
            m.running.clone(),
        );
        r.register(
            "strata:num_requests_waiting",
            "Requests waiting to run, preempted ones included",
            m.waiting.clone(),
        );
        r.register(
            "strata:kv_cache_usage_perc",
            "Used fraction of the KV blocks of each tier (1 = full)",
            m.kv_usage.clone(),
        );
        r.register(
            "strata:kv_cache_free_blocks",
            "Free KV blocks of each tier",
            m.kv_free_blocks.clone(),
        );
        r.register(
            "strata:num_preemptions",
            "Preemptions of running requests",
            m.preemptions.clone(),
        );
        r.register(
            "strata:kv_blocks_stored",
            "KV blocks offloaded to the host tier",
            m.blocks_stored.clone(),
        );
        r.register(
            "strata:kv_blocks_loaded",
            "KV blocks loaded back from the host tier",
            m.blocks_loaded.clone(),
        );
        r.register(
            "strata:num_recomputations",
            "Preempted requests whose KV was dropped and recomputed",
            m.recomputations.clone(),
        );
        r.register(
            "strata:kv_blocks_stored_disk",
            "KV blocks written to the disk tier (victims and prefix write-throughs)",
            m.blocks_stored_disk.clone(),
        );
        r.register(
            "strata:kv_blocks_loaded_disk",
            "KV blocks loaded back from the disk tier",
            m.blocks_loaded_disk.clone(),
        );
        r.register(
            "strata:disk_checksum_failures",
            "Disk-tier slots refused on read (header or checksum mismatch); the request recomputed",
            m.checksum_failures.clone(),
        );
        r.register(
            "strata:prefix_blocks_from_disk",
            "Prefix-cache blocks served from the disk tier (e.g. after a restart)",
            m.prefix_blocks_from_disk.clone(),
        );
        r.register(
            "strata:kv_blocks_demoted",
            "Host-resident KV blocks of the least recently preempted requests moved to disk",
            m.blocks_demoted.clone(),
        );
        r.register(
            "strata:kv_demotion_failures",
            "Demotions to disk that failed; the request recomputes",
            m.demotion_failures.clone(),
        );
        r.register(
            "strata:prompt_tokens",
            "Prompt tokens of admitted requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "strata:generation_tokens",
            "Generated tokens",
            m.generation_tokens.clone(),
        );
        r.register(
            "strata:num_requests_cancelled",
            "Requests cancelled because the client disconnected",
            m.cancelled.clone(),
        );
        r.register(
            "strata:time_to_first_token_seconds",
            "Time from a request's submission to the engine to its first token",
            m.ttft.clone(),
        );
        r.register(
            "strata:inter_token_latency_seconds",
            "Time between successive tokens of a request",
            m.itl.clone(),
        );
        m
    }

    /// Sets the gauges from the scheduler and advances the counters to the engine's totals.
    pub fn observe_engine(&self, sched: &Scheduler, stats: &EngineStats, last: &mut EngineStats) {
        self.running.set(sched.num_running() as i64);
        self.waiting.set(sched.num_waiting() as i64);
        let bm = &sched.bm;
        let tiers = [
            (GPU, bm.num_pages(), bm.available_pages()),
            (CPU, bm.num_slots(), bm.free_slots()),
            (DISK, bm.num_disk_slots(), bm.free_disk_slots()),
        ];
        for (label, total, free) in tiers {
            let used = total.saturating_sub(free);
            let frac = if total == 0 {
                0.0
            } else {
                used as f64 / total as f64
            };
            self.kv_usage.get_or_create(&label).set(frac);
            self.kv_free_blocks.get_or_create(&label).set(free as i64);
        }
        let advance = |c: &Counter, now: usize, before: usize| {
            c.inc_by(now.saturating_sub(before) as u64);
        };
        let (s, l) = (&stats.sched, &last.sched);
        advance(&self.preemptions, s.preemptions, l.preemptions);
        advance(&self.blocks_stored, s.blocks_stored, l.blocks_stored);
        advance(&self.blocks_loaded, s.blocks_loaded, l.blocks_loaded);
        advance(&self.recomputations, s.recomputations, l.recomputations);
        advance(
            &self.blocks_stored_disk,
            s.blocks_stored_disk,
            l.blocks_stored_disk,
        );
        advance(
            &self.blocks_loaded_disk,
            s.blocks_loaded_disk,
            l.blocks_loaded_disk,
        );
        advance(
            &self.prefix_blocks_from_disk,
            s.prefix_blocks_from_disk,
            l.prefix_blocks_from_disk,
        );
        advance(&self.blocks_demoted, s.blocks_demoted, l.blocks_demoted);
        advance(
            &self.demotion_failures,
            s.demotion_failures,
            l.demotion_failures,
        );
        self.checksum_failures.inc_by(
            stats
                .disk
                .checksum_failures
                .saturating_sub(last.disk.checksum_failures),
        );
        advance(&self.prompt_tokens, stats.prompt_tokens, last.prompt_tokens);
        advance(
            &self.generation_tokens,
            stats.generated_tokens,
            last.generated_tokens,
        );
        *last = *stats;
    }

    pub fn request_cancelled(&self) {
        self.cancelled.inc();
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_uses_the_documented_names() {
        let m = Metrics::new();
        m.ttft.observe(0.01);
        let text = m.render();
        for name in [
            "strata:num_requests_running ",
            "strata:num_requests_waiting ",
            "strata:num_preemptions_total ",
            "strata:kv_blocks_stored_total ",
            "strata:kv_blocks_loaded_total ",
            "strata:num_recomputations_total ",
            "strata:kv_blocks_stored_disk_total ",
            "strata:kv_blocks_demoted_total ",
            "strata:kv_demotion_failures_total ",
            "strata:disk_checksum_failures_total ",
            "strata:prefix_blocks_from_disk_total ",
            "strata:prompt_tokens_total ",
            "strata:generation_tokens_total ",
            "strata:time_to_first_token_seconds_bucket",
            "strata:inter_token_latency_seconds_count ",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
    }
}
