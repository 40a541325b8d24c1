//! Layerwise offload is bit-for-bit: greedy tokens (and their log-probabilities' bits)
//! with the offload engine equal those with everything resident, in every KV element
//! (`common::KV_DTYPES`, each against the resident cache of its own element), across ring
//! sizes, block sizes, prompt lengths and decode that crosses block boundaries; under the
//! sanitizer too; and the sanitizer catches a dropped event wait.

mod common;

use std::sync::Arc;

use common::{greedy, random_prompt, TinySpec, KV_DTYPES};
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::device::KvDtype;
use strata::engine::{self, GenerationOutput};
use strata::kv::KvCache;
use strata::model::Model;
use strata::offload::{CpuOffloadDevice, CpuOffloadEngine, OffloadConfig, OffloadEngine};

fn tiny(spec: TinySpec, name: &str) -> Arc<Model> {
    common::load_tiny(spec, name, 21)
}

/// Tokens and the bits of their log-probabilities.
type Run = (Vec<u32>, Vec<u32>);

fn run(out: GenerationOutput) -> Run {
    let bits = out.logprobs.iter().map(|x| x.to_bits()).collect();
    (out.token_ids, bits)
}

fn plain(model: &Arc<Model>, kv: KvDtype, prompt: &[u32], n: usize) -> Run {
    run(common::generate_plain(
        model,
        kv,
        prompt,
        &greedy(n),
        prompt.len() + n,
    ))
}

fn offload_cfg(nb: usize, bs: usize, max_len: usize) -> OffloadConfig {
    OffloadConfig {
        num_kv_buffers: nb,
        block_size: bs,
        max_model_len: max_len,
        ..Default::default()
    }
}

fn offloaded(
    model: &Arc<Model>,
    kv: KvDtype,
    cfg: OffloadConfig,
    prompt: &[u32],
    n: usize,
) -> anyhow::Result<Run> {
    strata::with_kv_elem!(kv, T => {
        let mut kv = OffloadEngine::<CpuOffloadDevice<T>>::on_cpu(&model.cfg, cfg)?;
        let cap = kv.capacity();
        let out = engine::generate_with(model, &mut kv, cap, prompt, &greedy(n), &mut |_| Ok(()))?;
        Ok(run(out))
    })
}

#[test]
fn tiny_models_match_across_ring_and_block_sizes() {
    let mut rng = StdRng::seed_from_u64(1);
    for (spec, name) in [
        (TinySpec::llama(), "off_llama"),
        (TinySpec::qwen3(), "off_qwen3"),
    ] {
        let model = tiny(spec, name);
        for &len in &[1usize, 37, 100] {
            let prompt = random_prompt(&mut rng, len, model.cfg.vocab_size);
            let n = 40; // crosses 16- and 32-token block boundaries
            for kv in KV_DTYPES {
                let want = plain(&model, kv, &prompt, n);
                for nb in [2, 3, 4, 8] {
                    for bs in [16, 32, 64, 1024] {
                        let cfg = offload_cfg(nb, bs, len + n);
                        let got = offloaded(&model, kv, cfg, &prompt, n).unwrap();
                        assert_eq!(
                            got, want,
                            "{name} {kv}: prompt {len}, num_kv_buffers {nb}, block_size {bs}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn smollm2_matches_with_offload() {
    let (model, tok) = Model::load(&common::require_default_model(), false).unwrap();
    let text = "The history of the lighthouse begins in ancient times. ".repeat(20);
    let prompt = tok
        .encode(
            &tok.apply_chat_template(&format!("{text}\nSummarize this."))
                .unwrap(),
            false,
        )
        .unwrap();
    assert!(
        prompt.len() % 16 != 0 && prompt.len() > 200,
        "prompt length {}",
        prompt.len()
    );
    let n = 24;
    for kv in KV_DTYPES {
        let want = plain(&model, kv, &prompt, n);
        for (nb, bs) in [(2, 16), (3, 64), (4, 256), (8, 1024)] {
            let cfg = offload_cfg(nb, bs, prompt.len() + n);
            let got = offloaded(&model, kv, cfg, &prompt, n).unwrap();
            assert_eq!(got, want, "{kv}: num_kv_buffers {nb}, block_size {bs}");
        }
    }
}

#[test]
fn sanitized_runs_match_on_random_prompts() {
    let model = tiny(TinySpec::llama(), "off_sanitize");
    let mut rng = StdRng::seed_from_u64(2);
    for case in 0..12 {
        let len = rng.random_range(1..90);
        let n = rng.random_range(1..40);
        let nb = rng.random_range(2..6);
        let bs = [8, 16, 32, 128][rng.random_range(0..4)];
        let prompt = random_prompt(&mut rng, len, model.cfg.vocab_size);
        let kv = KV_DTYPES[case % KV_DTYPES.len()];
        let want = plain(&model, kv, &prompt, n);
        let cfg = OffloadConfig {
            sanitize: true,
            ..offload_cfg(nb, bs, len + n)
        };
        let got = offloaded(&model, kv, cfg, &prompt, n).unwrap();
        assert_eq!(
            got, want,
            "case {case} {kv}: prompt {len}, decode {n}, num_kv_buffers {nb}, block_size {bs}"
        );
    }
}

#[test]
fn requests_in_one_process_match_fresh_processes() {
    let model = tiny(TinySpec::qwen3(), "off_seq");
    let mut rng = StdRng::seed_from_u64(4);
    let prompts: Vec<Vec<u32>> = [70, 5, 33, 64]
        .iter()
        .map(|&l| random_prompt(&mut rng, l, model.cfg.vocab_size))
        .collect();
    let n = 20;
    let cfg = OffloadConfig {
        sanitize: true,
        ..offload_cfg(3, 16, 96)
    };
    let mut shared = CpuOffloadEngine::on_cpu(&model.cfg, cfg.clone()).unwrap();
    let cap = shared.capacity();
    for (i, p) in prompts.iter().enumerate() {
        let fresh = offloaded(&model, KvDtype::F32, cfg.clone(), p, n).unwrap();
        let reused =
            engine::generate_with(&model, &mut shared, cap, p, &greedy(n), &mut |_| Ok(()))
                .unwrap();
        assert_eq!(run(reused), fresh, "request {i} after {i} others");
        assert_eq!(
            fresh,
            plain(&model, KvDtype::F32, p, n),
            "request {i} vs resident KV"
        );
    }
}

#[test]
fn bad_settings_are_refused() {
    let model = tiny(TinySpec::llama(), "off_bad");
    let c = &model.cfg;
    let err = |cfg: OffloadConfig| {
        CpuOffloadEngine::on_cpu(c, cfg)
            .err()
            .expect("must fail")
            .to_string()
    };
    assert!(err(offload_cfg(1, 16, 64)).contains("--num-kv-buffers must be in 2..="));
    assert!(err(offload_cfg(65, 16, 64)).contains("--num-kv-buffers must be in 2..="));
    assert!(err(offload_cfg(2, 1 << 20, 64)).contains("--block-size 1048576 is too large"));
    assert!(err(offload_cfg(2, 0, 64)).contains("--block-size must be at least 1"));
    // Host KV smaller than the prompt: a clean error from the step, not a panic.
    let cfg = OffloadConfig {
        num_cpu_blocks: Some(1),
        ..offload_cfg(2, 16, 64)
    };
    let r = offloaded(&model, KvDtype::Bf16, cfg, &[5; 40], 4);
    assert!(r.unwrap_err().to_string().contains("offload KV is full"));
}

/// `n` greedy tokens of `prompt` with offload, for each `(num_kv_buffers, block_size,
/// sanitize)` of `rings`, equal the resident run's tokens and log-prob bits.
fn offload_equals_resident(
    model: &Arc<Model>,
    kv: KvDtype,
    prompt: &[u32],
    n: usize,
    rings: &[(usize, usize, bool)],
    what: &str,
) {
    let want = plain(model, kv, prompt, n);
    for &(nb, bs, sanitize) in rings {
        let cfg = OffloadConfig {
            sanitize,
            ..offload_cfg(nb, bs, prompt.len() + n)
        };
        let got = offloaded(model, kv, cfg, prompt, n).unwrap();
        let len = prompt.len();
        assert_eq!(
            got, want,
            "{what} {kv}: prompt {len}, num_kv_buffers {nb}, block_size {bs}"
        );
    }
}

/// Sliding-window layers keep only the blocks their window reaches, in a ring that wraps
/// many times over a long run: tokens and log-prob bits still equal the resident run, in
/// every KV element, across ring sizes and block sizes (windows of 1, under a block,
/// across blocks), under the sanitizer too (stale rows outside the window are NaN).
#[test]
fn sliding_window_layers_match_resident_with_bounded_host_kv() {
    let mut rng = StdRng::seed_from_u64(5);
    for window in [1, 7, 20, 64] {
        let model = common::tiny_gemma3(window);
        for &len in &[1usize, 37, 100] {
            let prompt = random_prompt(&mut rng, len, model.cfg.vocab_size);
            let n = 40;
            let rings = [
                (2, 4, true),
                (3, 16, false),
                (4, 32, true),
                (8, 1024, false),
            ];
            for kv in KV_DTYPES {
                offload_equals_resident(
                    &model,
                    kv,
                    &prompt,
                    n,
                    &rings,
                    &format!("window {window}"),
                );
            }
        }
    }
}

/// The plan counts a windowed layer's ring, not the context: 5 windowed layers of 6 hold
/// ⌈(20 − 1) / 4⌉ + 1 = 6 blocks each instead of the context's 35.
#[test]
fn memory_plan_counts_window_rings() {
    let model = common::tiny_gemma3(20);
    let cfg = offload_cfg(2, 4, 140);
    let plan = cfg.plan_for(&model.cfg, 4).unwrap();
    let block = 2 * 4 * model.cfg.kv_dim() * 4; // K and V, 4 tokens, f32
    assert_eq!((plan.windowed_layers, plan.window_blocks), (5, 6));
    assert_eq!(plan.host_kv_bytes, (35 + 5 * 6) * block);
    assert!(plan
        .to_string()
        .contains("5 sliding-window layers hold 6 blocks each"));
}

/// gpt-oss (transformers' tiny random checkpoint: windowed and full layers alternating,
/// window 32, attention sinks, 32 experts): offload equals the resident run in tokens and
/// log-prob bits, the windowed layers in their rings, for prompts inside and far beyond
/// the window.
#[test]
fn gpt_oss_matches_resident_with_offload() {
    let model = common::tiny_gpt_oss("offload_gpt_oss");
    let mut rng = StdRng::seed_from_u64(62);
    for &len in &[1usize, 45, 150] {
        let prompt = random_prompt(&mut rng, len, model.cfg.vocab_size);
        let n = 24;
        for kv in [KvDtype::F32, KvDtype::F16] {
            offload_equals_resident(
                &model,
                kv,
                &prompt,
                n,
                &[(2, 4, true), (4, 16, false)],
                "gpt-oss",
            );
        }
    }
}

/// Qwen3.5 (transformers' tiny random checkpoint: three Gated DeltaNet state layers to
/// every full-attention one): offload equals the resident run in tokens and log-prob bits
/// across ring and block sizes, under the sanitizer too; the state layers keep no host
/// blocks and move nothing (their recurrent state stays with the compute), and the memory
/// plan says so.
#[test]
fn qwen35_matches_resident_with_offload_and_its_state_layers_hold_no_kv() {
    let moe = common::tiny_qwen35_moe("offload_qwen35_moe");
    let prompt = random_prompt(&mut StdRng::seed_from_u64(36), 60, moe.cfg.vocab_size);
    offload_equals_resident(
        &moe,
        KvDtype::F16,
        &prompt,
        24,
        &[(2, 4, true)],
        "Qwen3.5 MoE",
    );
    let model = common::tiny_qwen35("offload_qwen35");
    let mut rng = StdRng::seed_from_u64(35);
    for &len in &[1usize, 45, 150] {
        let prompt = random_prompt(&mut rng, len, model.cfg.vocab_size);
        for kv in [KvDtype::F32, KvDtype::F16] {
            offload_equals_resident(
                &model,
                kv,
                &prompt,
                24,
                &[(2, 4, true), (4, 16, false), (3, 256, true)],
                "Qwen3.5",
            );
        }
    }
    let plan = offload_cfg(2, 4, 140).plan_for(&model.cfg, 4).unwrap();
    let block = 2 * 4 * model.cfg.kv_dim() * 4; // K and V, 4 tokens, f32
    assert_eq!(plan.host_kv_bytes, 2 * 35 * block, "only the 2 full layers");
    assert_eq!(plan.state_layers, 6);
    // Per state layer: conv tail 3 × 1024 channels, matrix 32 heads × 16 × 16; f32.
    assert_eq!(plan.state_bytes, 6 * 4 * (3 * 1024 + 32 * 16 * 16));
    assert!(
        plan.to_string().contains("6 state layers hold no KV"),
        "{plan}"
    );
}
