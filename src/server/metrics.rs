//! `GET /metrics`: Prometheus text (OpenMetrics) through the `prometheus-client` crate.
//! What vLLM also measures carries vLLM's name and labels (`vllm:num_requests_running
//! {model_name, engine}`), so dashboards and autoscalers built for vLLM read strata; the
//! rest (tiers, transfers, disk) is `strata:`. Histogram buckets are vLLM's
//! (`vllm/v1/metrics/loggers.py`), those of token counts built from `--max-model-len`
//! once the model is loaded, as vLLM builds them. The engine thread updates the gauges
//! and counters after every step; the handler only reads.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
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

/// vLLM's buckets for the time to the first token.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for the time between tokens and per output token.
const TPOT_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's buckets for a request's phases (end to end, queued, prefill, decode, inference).
const REQUEST_LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's buckets for the tokens of one engine step.
const ITERATION_TOKEN_BUCKETS: [f64; 13] = [
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
/// vLLM's buckets for the `n` parameter.
const N_BUCKETS: [f64; 5] = [1.0, 2.0, 5.0, 10.0, 20.0];

/// vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `max`.
fn buckets_1_2_5(max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1usize;
    loop {
        for m in [1usize, 2, 5] {
            match m.checked_mul(scale) {
                Some(v) if v <= max => out.push(v as f64),
                _ => return out,
            }
        }
        scale = match scale.checked_mul(10) {
            Some(s) => s,
            None => return out,
        };
    }
}

/// vLLM's `vllm:cache_config_info` labels (an info metric: a gauge at 1), the cache
/// configuration as vLLM's `CacheConfig.metrics_info()` names it, plus strata's disk tier.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheConfigInfo {
    pub block_size: String,
    pub cache_dtype: String,
    pub enable_prefix_caching: String,
    pub num_gpu_blocks: String,
    pub num_cpu_blocks: String,
    pub num_disk_blocks: String,
    pub engine: String,
}

/// When a request reached each phase, for vLLM's per-request histograms.
#[derive(Debug, Clone, Copy)]
pub struct RequestTimes {
    /// Submitted to the engine.
    pub arrived: Instant,
    /// The start of the step that first computed any of it.
    pub scheduled: Option<Instant>,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
    pub prompt_tokens: usize,
    pub generation_tokens: usize,
    pub max_tokens: usize,
}

/// The histograms whose buckets depend on `--max-model-len` (vLLM's 1-2-5 token buckets),
/// registered once the model is loaded.
struct TokenHistograms {
    prompt: Histogram,
    generation: Histogram,
    max_tokens: Histogram,
}

pub struct Metrics {
    /// Behind a lock only for the registrations made once the model is loaded.
    registry: Mutex<Registry>,
    model_name: String,
    token_hists: OnceLock<TokenHistograms>,
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
    /// vLLM's older name for the inter-token latency, still read by dashboards.
    tpot: Histogram,
    request_tpot: Histogram,
    e2e: Histogram,
    queue_time: Histogram,
    prefill_time: Histogram,
    decode_time: Histogram,
    inference_time: Histogram,
    iteration_tokens: Histogram,
    params_n: Histogram,
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
    recurrent_state_bytes: Gauge,
    kv_event_peers_refused: Counter,
    kv_event_peers_disconnected: Counter,
    kv_events_missed: Counter,
}

impl Metrics {
    /// `model_name` labels the vLLM-named metrics, as vLLM labels them.
    pub fn new(model_name: &str) -> Self {
        let m = Self {
            registry: Mutex::new(Registry::default()),
            model_name: model_name.to_string(),
            token_hists: OnceLock::new(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            gpu_usage: Gauge::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            preemptions: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            request_success: Family::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(TPOT_BUCKETS),
            tpot: Histogram::new(TPOT_BUCKETS),
            request_tpot: Histogram::new(TPOT_BUCKETS),
            e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
            queue_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            prefill_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            decode_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            inference_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            iteration_tokens: Histogram::new(ITERATION_TOKEN_BUCKETS),
            params_n: Histogram::new(N_BUCKETS),
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
            recurrent_state_bytes: Gauge::default(),
            kv_event_peers_refused: Counter::default(),
            kv_event_peers_disconnected: Counter::default(),
            kv_events_missed: Counter::default(),
        };
        let mut registry = m.registry.lock().expect("not poisoned");
        let v = vllm_labelled(&mut registry, &m.model_name);
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
            "vllm:time_per_output_token_seconds",
            "Time between successive tokens of a request (vLLM's older name)",
            m.tpot.clone(),
        );
        v.register(
            "vllm:request_time_per_output_token_seconds",
            "A finished request's decode time divided by its tokens after the first",
            m.request_tpot.clone(),
        );
        v.register(
            "vllm:e2e_request_latency_seconds",
            "Time from a request's submission to the engine to its end",
            m.e2e.clone(),
        );
        v.register(
            "vllm:request_queue_time_seconds",
            "Time a request waited before its first step",
            m.queue_time.clone(),
        );
        v.register(
            "vllm:request_prefill_time_seconds",
            "Time from a request's first step to its first token",
            m.prefill_time.clone(),
        );
        v.register(
            "vllm:request_decode_time_seconds",
            "Time from a request's first token to its last",
            m.decode_time.clone(),
        );
        v.register(
            "vllm:request_inference_time_seconds",
            "Time from a request's first step to its last token",
            m.inference_time.clone(),
        );
        v.register(
            "vllm:iteration_tokens_total",
            "Tokens computed by one engine step (prompt and generated)",
            m.iteration_tokens.clone(),
        );
        v.register(
            "vllm:request_params_n",
            "The n parameter of finished requests",
            m.params_n.clone(),
        );
        let r = &mut *registry;
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
            "strata:recurrent_state_bytes",
            "Host memory held by the running requests' recurrent states (state-layer models such as Qwen3.5)",
            m.recurrent_state_bytes.clone(),
        );
        r.register(
            "strata:kv_events_missed",
            "KV-event messages subscribers missed because they fell behind",
            m.kv_events_missed.clone(),
        );
        drop(registry);
        m
    }

    /// Registers what depends on the loaded model: vLLM's token-count histograms (1-2-5
    /// buckets up to `max_model_len`) and `vllm:cache_config_info`. Once; later calls do
    /// nothing.
    pub fn engine_loaded(&self, max_model_len: usize, cache: CacheConfigInfo) {
        let buckets = buckets_1_2_5(max_model_len);
        let hists = TokenHistograms {
            prompt: Histogram::new(buckets.iter().copied()),
            generation: Histogram::new(buckets.iter().copied()),
            max_tokens: Histogram::new(buckets.iter().copied()),
        };
        let (prompt, generation, max_tokens) = (
            hists.prompt.clone(),
            hists.generation.clone(),
            hists.max_tokens.clone(),
        );
        if self.token_hists.set(hists).is_err() {
            return;
        }
        let mut registry = self.registry.lock().expect("not poisoned");
        let info = Family::<CacheConfigInfo, Gauge>::default();
        info.get_or_create(&cache).set(1);
        registry.register(
            "vllm:cache_config_info",
            "The KV cache's configuration (labels; the value is 1)",
            info,
        );
        let v = vllm_labelled(&mut registry, &self.model_name);
        v.register(
            "vllm:request_prompt_tokens",
            "Prompt tokens of finished requests",
            prompt,
        );
        v.register(
            "vllm:request_generation_tokens",
            "Generated tokens of finished requests",
            generation,
        );
        v.register(
            "vllm:request_params_max_tokens",
            "The max_tokens parameter of finished requests",
            max_tokens,
        );
    }

    /// A request's first token (`first`) or a later one, `secs` after the one before (or
    /// after its submission).
    pub fn token(&self, first: bool, secs: f64) {
        if first {
            self.ttft.observe(secs);
        } else {
            self.itl.observe(secs);
            self.tpot.observe(secs);
        }
    }

    /// A request ended at `now`: its end-to-end latency and phases (vLLM's definitions:
    /// queued until its first step, prefill until its first token, decode until its last,
    /// inference from its first step to its last token; a phase never reached counts 0).
    pub fn finished(&self, finish: Finish, t: &RequestTimes, now: Instant) {
        let secs = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64();
        self.e2e.observe(secs(t.arrived, now));
        let scheduled = t.scheduled.unwrap_or(now);
        self.queue_time.observe(secs(t.arrived, scheduled));
        let first = t.first_token.unwrap_or(scheduled);
        let last = t.last_token.unwrap_or(first);
        self.prefill_time.observe(secs(scheduled, first));
        self.decode_time.observe(secs(first, last));
        self.inference_time.observe(secs(scheduled, last));
        if t.generation_tokens > 1 {
            self.request_tpot
                .observe(secs(first, last) / (t.generation_tokens - 1) as f64);
        }
        self.params_n.observe(1.0); // n > 1 is refused
        if let Some(h) = self.token_hists.get() {
            h.prompt.observe(t.prompt_tokens as f64);
            h.generation.observe(t.generation_tokens as f64);
            h.max_tokens.observe(t.max_tokens as f64);
        }
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
        self.recurrent_state_bytes
            .set(stats.recurrent_state_bytes as i64);
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
        let step_tokens = stats.computed_tokens.saturating_sub(last.computed_tokens);
        if stats.steps > last.steps && step_tokens > 0 {
            self.iteration_tokens.observe(step_tokens as f64);
        }
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
        let registry = self.registry.lock().expect("not poisoned");
        encode(&mut out, &registry).expect("writing to a String cannot fail");
        out
    }
}

/// The sub-registry of vLLM-named metrics: labels `model_name` and `engine`, as vLLM's.
fn vllm_labelled<'a>(registry: &'a mut Registry, model_name: &str) -> &'a mut Registry {
    registry.sub_registry_with_labels(
        [
            (
                Cow::Borrowed("model_name"),
                Cow::Owned(model_name.to_string()),
            ),
            (Cow::Borrowed("engine"), Cow::Borrowed("0")),
        ]
        .into_iter(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache_info(gpu_blocks: usize) -> CacheConfigInfo {
        CacheConfigInfo {
            block_size: "16".into(),
            cache_dtype: "f16".into(),
            enable_prefix_caching: "True".into(),
            num_gpu_blocks: gpu_blocks.to_string(),
            num_cpu_blocks: "0".into(),
            num_disk_blocks: "0".into(),
            engine: "0".into(),
        }
    }

    fn times(prompt: usize, generated: usize) -> (RequestTimes, Instant) {
        use std::time::Duration;
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let t = RequestTimes {
            arrived: t0,
            scheduled: Some(at(400)),
            first_token: Some(at(1_000)),
            last_token: Some(at(3_000)),
            prompt_tokens: prompt,
            generation_tokens: generated,
            max_tokens: 64,
        };
        (t, at(3_100))
    }

    /// `name`'s sample with labels `labels` (the text between the braces), if present.
    fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
        let head = format!("{name}{{{labels}}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&head))
            .map(|v| v.parse().unwrap())
    }

    #[test]
    fn exposition_uses_vllms_names_and_labels_and_strata_names_for_the_rest() {
        let m = Metrics::new("smol");
        m.engine_loaded(2048, cache_info(128));
        m.token(true, 0.01);
        let (t, now) = times(100, 5);
        m.finished(Finish::Stop, &t, now);
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
            "vllm:time_per_output_token_seconds_count",
            "vllm:request_time_per_output_token_seconds_count",
            "vllm:request_queue_time_seconds_count",
            "vllm:request_prefill_time_seconds_count",
            "vllm:request_decode_time_seconds_count",
            "vllm:request_inference_time_seconds_count",
            "vllm:iteration_tokens_total_count",
            "vllm:request_params_n_count",
            "vllm:request_prompt_tokens_count",
            "vllm:request_generation_tokens_count",
            "vllm:request_params_max_tokens_count",
        ] {
            let want = format!("{name}{labels} ");
            assert!(text.contains(&want), "{want} missing from\n{text}");
        }
        for want in [
            "vllm:time_to_first_token_seconds_bucket{model_name=\"smol\",engine=\"0\",le=",
            "vllm:e2e_request_latency_seconds_count{model_name=",
            "vllm:request_success_total{model_name=\"smol\",engine=\"0\",finished_reason=\"stop\"} 1",
            "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"f16\",enable_prefix_caching=\"True\",num_gpu_blocks=\"128\",num_cpu_blocks=\"0\",num_disk_blocks=\"0\",engine=\"0\"} 1",
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

    #[test]
    fn a_finished_request_lands_in_vllms_buckets_phase_by_phase() {
        let m = Metrics::new("smol");
        m.engine_loaded(1000, cache_info(8));
        // Queued 0.4 s, prefill 0.6 s, decode 2 s over 4 tokens after the first (0.5 s
        // each), inference 2.6 s, end to end 3.1 s; 100 prompt and 5 generated tokens.
        let (t, now) = times(100, 5);
        m.finished(Finish::Length, &t, now);
        let text = m.render();
        let at = |name: &str, le: &str| {
            sample(
                &text,
                name,
                &format!("model_name=\"smol\",engine=\"0\",le=\"{le}\""),
            )
            .unwrap_or_else(|| panic!("{name} le={le} missing from\n{text}"))
        };
        // vLLM's request-latency buckets: 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, ...
        assert_eq!(at("vllm:request_queue_time_seconds_bucket", "0.3"), 0.0);
        assert_eq!(at("vllm:request_queue_time_seconds_bucket", "0.5"), 1.0);
        assert_eq!(at("vllm:request_prefill_time_seconds_bucket", "0.5"), 0.0);
        assert_eq!(at("vllm:request_prefill_time_seconds_bucket", "0.8"), 1.0);
        assert_eq!(at("vllm:request_decode_time_seconds_bucket", "1.5"), 0.0);
        assert_eq!(at("vllm:request_decode_time_seconds_bucket", "2.0"), 1.0);
        assert_eq!(at("vllm:request_inference_time_seconds_bucket", "2.5"), 0.0);
        assert_eq!(at("vllm:request_inference_time_seconds_bucket", "5.0"), 1.0);
        assert_eq!(at("vllm:e2e_request_latency_seconds_bucket", "2.5"), 0.0);
        assert_eq!(at("vllm:e2e_request_latency_seconds_bucket", "5.0"), 1.0);
        // Per output token: 2 s / 4 = 0.5 s, in vLLM's TPOT bucket 0.5.
        assert_eq!(
            at("vllm:request_time_per_output_token_seconds_bucket", "0.4"),
            0.0
        );
        assert_eq!(
            at("vllm:request_time_per_output_token_seconds_bucket", "0.5"),
            1.0
        );
        // Token counts in 1-2-5 buckets up to --max-model-len (1000): ..., 100, 200, 500, 1000.
        assert_eq!(at("vllm:request_prompt_tokens_bucket", "50.0"), 0.0);
        assert_eq!(at("vllm:request_prompt_tokens_bucket", "100.0"), 1.0);
        assert_eq!(at("vllm:request_prompt_tokens_bucket", "1000.0"), 1.0);
        assert_eq!(at("vllm:request_generation_tokens_bucket", "2.0"), 0.0);
        assert_eq!(at("vllm:request_generation_tokens_bucket", "5.0"), 1.0);
        assert_eq!(at("vllm:request_params_max_tokens_bucket", "100.0"), 1.0);
        assert!(
            !text.contains("le=\"2000.0\""),
            "a bucket past --max-model-len 1000 (vLLM stops at it)\n{text}"
        );
    }

    #[test]
    fn buckets_1_2_5_match_vllms_builder() {
        // vLLM: build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
        assert_eq!(buckets_1_2_5(100), [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]);
        assert_eq!(buckets_1_2_5(4), [1.0, 2.0]);
        assert!(buckets_1_2_5(usize::MAX).len() > 50);
    }
}
