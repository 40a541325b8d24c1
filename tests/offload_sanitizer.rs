//! The harness can fail: a test-only device that drops one event wait makes the sanitized
//! offload run diverge from the resident run. The fault lives here, in a wrapper around
//! the CPU device, not in the engine: the production engine has no fault switch.
//!
//! This is its own test binary so that no other test competes for the two cores: the race
//! shows when the compute stream outruns a delayed copy, and a compute thread descheduled
//! for longer than the sanitizer's copy delay could hide it. Each dropped wait gets up to
//! three attempts; in isolation the first one diverges.

mod common;

use std::sync::Arc;

use common::{scratch_dir, TinySpec};
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::device::cpu::ops::AttnHeads;
use strata::device::cpu::stream::TraceEvent;
use strata::device::DevPtr;
use strata::engine::{self, GenerateOptions, SamplingParams};
use strata::kv::ContiguousKv;
use strata::model::{weights, Model, ModelConfig};
use strata::offload::device::{EventId, MemId, OffloadDevice, Space, Span, StreamRole};
use strata::offload::engine::OFFLOAD_STREAMS;
use strata::offload::{CpuOffloadDevice, OffloadConfig, OffloadEngine};
use strata::sparse::SparseConfig;

/// The CPU device, but the compute stream skips every wait labelled `dropped`.
struct DroppingWait {
    dev: CpuOffloadDevice<f32>,
    dropped: &'static str,
}

impl OffloadDevice for DroppingWait {
    type Elem = f32;
    fn num_offload_streams(&self) -> usize {
        self.dev.num_offload_streams()
    }
    fn alloc(&mut self, space: Space, elems: usize) -> anyhow::Result<MemId> {
        self.dev.alloc(space, elems)
    }
    fn ptr(&self, mem: MemId) -> DevPtr<f32> {
        self.dev.ptr(mem)
    }
    fn host_ptr(&self, mem: MemId) -> anyhow::Result<*mut u8> {
        self.dev.host_ptr(mem)
    }
    fn new_event(&mut self) -> anyhow::Result<EventId> {
        self.dev.new_event()
    }
    fn wait(&mut self, s: StreamRole, e: EventId, what: &'static str) -> anyhow::Result<()> {
        if s == StreamRole::Compute && what == self.dropped {
            return Ok(());
        }
        self.dev.wait(s, e, what)
    }
    fn record(&mut self, s: StreamRole, e: EventId) -> anyhow::Result<()> {
        self.dev.record(s, e)
    }
    fn query(&mut self, e: EventId) -> anyhow::Result<bool> {
        self.dev.query(e)
    }
    fn copy(
        &mut self,
        s: StreamRole,
        name: &'static str,
        layer: usize,
        src: Span,
        dst: Span,
    ) -> anyhow::Result<()> {
        self.dev.copy(s, name, layer, src, dst)
    }
    fn poison(&mut self, s: StreamRole, dst: Span) -> anyhow::Result<()> {
        self.dev.poison(s, dst)
    }
    fn sync_all(&mut self) -> anyhow::Result<()> {
        self.dev.sync_all()
    }
    fn layer_begin(&mut self, layer: usize) -> anyhow::Result<()> {
        self.dev.layer_begin(layer)
    }
    fn layer_end(&mut self, layer: usize) -> anyhow::Result<()> {
        self.dev.layer_end(layer)
    }
    fn set_tracing(&mut self, on: bool) -> anyhow::Result<()> {
        self.dev.set_tracing(on)
    }
    fn take_trace(&mut self) -> anyhow::Result<Vec<TraceEvent>> {
        self.dev.take_trace()
    }
    fn page_bounds(
        &mut self,
        layer: usize,
        keys: Span,
        row: usize,
        page_size: usize,
        bounds: Span,
    ) -> anyhow::Result<()> {
        self.dev.page_bounds(layer, keys, row, page_size, bounds)
    }
    fn copy_query(&mut self, q: strata::kv::Query<f32>, dst: Span) -> anyhow::Result<()> {
        self.dev.copy_query(q, dst)
    }
    fn head_bounds(
        &mut self,
        layer: usize,
        q: strata::kv::Query<f32>,
        bounds: Span,
        heads: AttnHeads,
        pages: usize,
        page_size: usize,
    ) -> anyhow::Result<Vec<f32>> {
        self.dev
            .head_bounds(layer, q, bounds, heads, pages, page_size)
    }
}

#[test]
fn a_dropped_wait_is_caught_by_the_sanitizer() {
    let dir = scratch_dir("off_drop");
    TinySpec::llama().write(&dir, 21);
    let mut cfg =
        ModelConfig::from_hf_json(&std::fs::read_to_string(dir.join("config.json")).unwrap())
            .unwrap();
    let w = weights::load_safetensors(&dir, &mut cfg, false).unwrap();
    let model = Arc::new(Model::new(cfg, w));
    let c = &model.cfg;
    let mut rng = StdRng::seed_from_u64(3);
    let prompt: Vec<u32> = (0..50)
        .map(|_| rng.random_range(3..c.vocab_size as u32))
        .collect();
    let n = 30;
    let opts = GenerateOptions {
        max_tokens: n,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
    };
    let mut kv = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, prompt.len() + n);
    let want = engine::generate_with(
        &model,
        &mut kv,
        prompt.len() + n,
        &prompt,
        &opts,
        &mut |_| Ok(()),
    )
    .unwrap()
    .token_ids;
    let run_with = |dropped: &'static str, sparse: Option<SparseConfig>| {
        let cfg = OffloadConfig {
            num_kv_buffers: 2,
            block_size: 16,
            max_model_len: 128,
            sanitize: true,
            sparse,
            ..Default::default()
        };
        let dev = DroppingWait {
            dev: CpuOffloadDevice::new(0.0, true, OFFLOAD_STREAMS).unwrap(),
            dropped,
        };
        let mut kv = OffloadEngine::new(dev, c, cfg).unwrap();
        engine::generate_with(&model, &mut kv, 128, &prompt, &opts, &mut |_| Ok(()))
    };
    let run = |dropped| run_with(dropped, None);
    // The wrapper itself changes nothing when it drops nothing.
    assert_eq!(run("none").unwrap().token_ids, want);
    // Decode computes before its slot's prefetch landed; prefill overwrites a slot whose
    // previous layer is still being offloaded.
    for dropped in ["slot-ready", "slot-offload-done"] {
        let diverged = (0..3).any(|_| match run(dropped) {
            Ok(out) => out.token_ids != want,
            Err(_) => true,
        });
        assert!(
            diverged,
            "dropping the compute stream's {dropped:?} wait went unnoticed in three sanitized runs"
        );
    }
    // Sparse decode: attention before the missed pages landed.
    let sparse = Some(SparseConfig {
        budget: 32,
        page_size: 8,
    });
    let want = run_with("none", sparse).unwrap().token_ids;
    let diverged = (0..3).any(|_| match run_with("misses-fetched", sparse) {
        Ok(out) => out.token_ids != want,
        Err(_) => true,
    });
    assert!(
        diverged,
        "dropping sparse decode's misses-fetched wait went unnoticed in three sanitized runs"
    );
}
