//! The harness can fail: a test-only switch that drops one event wait makes the sanitized
//! offload run diverge from the resident run.
//!
//! This is its own test binary so that no other test competes for the two cores: the race
//! shows when the compute stream outruns a delayed copy, and a compute thread descheduled
//! for longer than the sanitizer's copy delay could hide it. Each dropped wait gets up to
//! three attempts; in isolation the first one diverges.

mod common;

use std::sync::Arc;

use common::{scratch_dir, TinySpec};
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::engine::{self, GenerateOptions, SamplingParams};
use strata::kv::ContiguousKv;
use strata::model::{weights, Model, ModelConfig};
use strata::offload::{DropWait, OffloadConfig, OffloadEngine};

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
    for drop in [DropWait::DecodeSlotReady, DropWait::PrefillSlotReuse] {
        let diverged = (0..3).any(|_| {
            let cfg = OffloadConfig {
                num_kv_buffers: 2,
                block_size: 16,
                max_model_len: 128,
                sanitize: true,
                drop_wait: Some(drop),
                ..Default::default()
            };
            let mut kv = OffloadEngine::new(c, cfg).unwrap();
            match engine::generate_with(&model, &mut kv, 128, &prompt, &opts, &mut |_| Ok(())) {
                Ok(out) => out.token_ids != want,
                Err(_) => true,
            }
        });
        assert!(
            diverged,
            "dropping {drop:?} went unnoticed in three sanitized runs"
        );
    }
}
