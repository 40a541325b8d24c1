//! `GET /metrics`: Prometheus text (OpenMetrics) through the `prometheus-client` crate.
//! What vLLM also measures carries vLLM's name and labels (`vllm:num_requests_running
//! {model_name, engine}`), so dashboards and autoscalers built for vLLM read strata; the
//! rest (tiers, transfers, disk) is `strata:`. The engine thread updates the gauges and
//! counters after every step; the registry is read only by the handler.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::api::Finish;
use super::kv_events::pub_socket::PeerStats;
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

/// vLLM's `vllm:request_success` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishedReason {
    pub finished_reason: &'static str,
}

pub struct Metrics {
    registry: Registry,
    // vLLM's names (labels model_name, engine).
    running: Gauge,
    waiting: Gauge,
    /// Used fraction of the GPU tier, 0..1 (vLLM's KV-cache usage).
    gpu_usage: Gauge<f64, AtomicU64>,
    /// Prompt tokens looked up in the prefix cache, and of them those found (vLLM counts
    /// both in tokens).
    prefix_queries: Counter,
    prefix_hits: Counter,
    preemptions: Counter,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    request_success: Family<FinishedReason, Counter>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    // strata's own.
    /// Used fraction of each tier, 0..1 (prefix-cache pages nobody holds count as free).
    kv_usage: Family<TierLabel, Gauge<f64, AtomicU64>>,
    kv_free_blocks: Family<TierLabel, Gauge>,
    blocks_stored: Counter,
    blocks_loaded: Counter,
    recomputations: Counter,
    blocks_stored_disk: Counter,
    blocks_loaded_disk: Counter,
    checksum_failures: Counter,
    prefix_blocks_from_disk: Counter,
    blocks_demoted: Counter,
    demotion_failures: Counter,
    /// Requests cancelled because their client went away.
    cancelled: Counter,
    kv_events_dropped: Counter,
    kv_event_peers: Gauge,
    kv_event_peers_refused: Counter,
    kv_event_peers_disconnected: Counter,
    kv_events_missed: Counter,
}

impl Metrics {
    /// `model_name` labels the vLLM-named metrics, as vLLM labels them.
    pub fn new(model_name: &str) -> Self {
        let mut m = Self {
            registry: Registry::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            gpu_usage: Gauge::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            preemptions: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            request_success: Family::default(),
            // 1 ms .. ~65 s
            ttft: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            // 1 ms .. ~4 s
            itl: Histogram::new(exponential_buckets(0.001, 2.0, 13)),
            // 10 ms .. ~11 min
            e2e: Histogram::new(exponential_buckets(0.01, 2.0, 17)),
            kv_usage: Family::default(),
            kv_free_blocks: Family::default(),
            blocks_stored: Counter::default(),
            blocks_loaded: Counter::default(),
            recomputations: Counter::default(),
            blocks_stored_disk: Counter::default(),
            blocks_loaded_disk: Counter::default(),
            checksum_failures: Counter::default(),
            prefix_blocks_from_disk: Counter::default(),
            blocks_demoted: Counter::default(),
            demotion_failures: Counter::default(),
            cancelled: Counter::default(),
            kv_events_dropped: Counter::default(),
            kv_event_peers: Gauge::default(),
            kv_event_peers_refused: Counter::default(),
            kv_event_peers_disconnected: Counter::default(),
            kv_events_missed: Counter::default(),
        };
        let v = m.registry.sub_registry_with_labels(
            [
                (
                    Cow::Borrowed("model_name"),
                    Cow::Owned(model_name.to_string()),
                ),
                (Cow::Borrowed("engine"), Cow::Borrowed("0")),
            ]
            .into_iter(),
        );
        v.register(
            "vllm:num_requests_running",
            "Requests in the running batch",
            m.running.clone(),
        );
        v.register(
            "vllm:num_requests_waiting",
            "Requests waiting to run, preempted ones included",
            m.waiting.clone(),
        );
        v.register(
            "vllm:kv_cache_usage_perc",
            "Used fraction of the GPU KV blocks (1 = full)",
            m.gpu_usage.clone(),
        );
        v.register(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in tokens looked up",
            m.prefix_queries.clone(),
        );
        v.register(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in cached tokens reused",
            m.prefix_hits.clone(),
        );
        v.register(
            "vllm:num_preemptions",
            "Preemptions of running requests",
            m.preemptions.clone(),
        );
        v.register(
            "vllm:prompt_tokens",
            "Prompt tokens of admitted requests",
            m.prompt_tokens.clone(),
        );
        v.register(
            "vllm:generation_tokens",
            "Generated tokens",
            m.generation_tokens.clone(),
        );
        v.register(
            "vllm:request_success",
            "Requests finished, by finish reason",
            m.request_success.clone(),
        );
        v.register(
            "vllm:time_to_first_token_seconds",
            "Time from a request's submission to the engine to its first token",
            m.ttft.clone(),
        );
        v.register(
            "vllm:inter_token_latency_seconds",
            "Time between successive tokens of a request",
            m.itl.clone(),
        );
        v.register(
            "vllm:e2e_request_latency_seconds",
            "Time from a request's submission to the engine to its end",
            m.e2e.clone(),
        );
        let r = &mut m.registry;
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
            "strata:num_requests_cancelled",
            "Requests cancelled because the client disconnected",
            m.cancelled.clone(),
        );
        r.register(
            "strata:kv_events_dropped",
            "KV-cache events dropped because the publisher fell behind",
            m.kv_events_dropped.clone(),
        );
        r.register(
            "strata:kv_event_peers",
            "Subscribers connected to the KV-event socket (handshaking or subscribed)",
            m.kv_event_peers.clone(),
        );
        r.register(
            "strata:kv_event_peers_refused",
            "KV-event connections closed at once because the peer cap was reached",
            m.kv_event_peers_refused.clone(),
        );
        r.register(
            "strata:kv_event_peers_disconnected",
            "KV-event peers closed for a protocol error, a handshake timeout or a stalled socket",
            m.kv_event_peers_disconnected.clone(),
        );
        r.register(
            "strata:kv_events_missed",
            "KV-event messages subscribers missed because they fell behind",
            m.kv_events_missed.clone(),
        );
        m
    }

    /// A request's first token (`first`) or a later one, `secs` after the one before (or
    /// after its submission).
    pub fn token(&self, first: bool, secs: f64) {
        if first {
            self.ttft.observe(secs);
        } else {
            self.itl.observe(secs);
        }
    }

    /// A request ended, `secs` after its submission.
    pub fn finished(&self, finish: Finish, secs: f64) {
        self.e2e.observe(secs);
        self.request_success
            .get_or_create(&FinishedReason {
                finished_reason: finish.as_str(),
            })
            .inc();
    }

    /// Advances the dropped-events counter to the publisher's total.
    pub fn kv_events_dropped(&self, total: u64) {
        let seen = self.kv_events_dropped.get();
        self.kv_events_dropped.inc_by(total.saturating_sub(seen));
    }

    /// Sets the KV-event socket's peer gauge and advances its counters to its totals (at
    /// each scrape: peers come and go while the engine is idle).
    pub fn kv_event_peers(&self, peers: &PeerStats) {
        let advance = |c: &Counter, total: u64| c.inc_by(total.saturating_sub(c.get()));
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        advance(&self.kv_event_peers_refused, load(&peers.refused));
        advance(&self.kv_event_peers_disconnected, load(&peers.disconnected));
        advance(&self.kv_events_missed, load(&peers.missed));
        self.kv_event_peers.set(load(&peers.connected) as i64);
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
            if label == GPU {
                self.gpu_usage.set(frac);
            }
            self.kv_usage.get_or_create(&label).set(frac);
            self.kv_free_blocks.get_or_create(&label).set(free as i64);
        }
        let advance = |c: &Counter, now: usize, before: usize| {
            c.inc_by(now.saturating_sub(before) as u64);
        };
        let (s, l) = (&stats.sched, &last.sched);
        let bs = sched.config().block_size;
        advance(
            &self.prefix_queries,
            s.prefix_queried_tokens,
            l.prefix_queried_tokens,
        );
        advance(
            &self.prefix_hits,
            s.prefix_hit_blocks * bs,
            l.prefix_hit_blocks * bs,
        );
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
    fn exposition_uses_vllms_names_and_labels_and_strata_names_for_the_rest() {
        let m = Metrics::new("smol");
        m.token(true, 0.01);
        m.finished(Finish::Stop, 0.5);
        let text = m.render();
        let labels = "{model_name=\"smol\",engine=\"0\"}";
        for name in [
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:num_preemptions_total",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:inter_token_latency_seconds_count",
        ] {
            let want = format!("{name}{labels} ");
            assert!(text.contains(&want), "{want} missing from\n{text}");
        }
        for want in [
            "vllm:time_to_first_token_seconds_bucket{model_name=\"smol\",engine=\"0\",le=",
            "vllm:e2e_request_latency_seconds_count{model_name=",
            "vllm:request_success_total{model_name=\"smol\",engine=\"0\",finished_reason=\"stop\"} 1",
            "strata:kv_blocks_stored_total ",
            "strata:kv_blocks_loaded_total ",
            "strata:num_recomputations_total ",
            "strata:kv_blocks_stored_disk_total ",
            "strata:kv_blocks_demoted_total ",
            "strata:kv_demotion_failures_total ",
            "strata:disk_checksum_failures_total ",
            "strata:prefix_blocks_from_disk_total ",
            "strata:num_requests_cancelled_total ",
            "strata:kv_events_dropped_total ",
            "strata:kv_event_peers ",
            "strata:kv_event_peers_refused_total ",
            "strata:kv_event_peers_disconnected_total ",
            "strata:kv_events_missed_total ",
        ] {
            assert!(text.contains(want), "{want} missing from\n{text}");
        }
        assert!(!text.contains("strata:num_requests_running"), "{text}");
    }
}
