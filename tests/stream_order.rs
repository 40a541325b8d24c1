//! The stream-ordering checker (`strata::device::order`) over the real schedules: layerwise
//! offload (prefill slot reuse, decode prefetch across step boundaries, decode-buffer
//! flushes, several requests in one engine), sparse decode (moves inside the slot, miss
//! fetches), verified sparse decode (verify steps offloading from the slot, rewinds) and
//! the serving path (preemption stores, loads, recomputation), each run with
//! the checker on and its tokens compared with the plain run. A missing edge is an error
//! the run returns, whatever the timing.
//!
//! These are the suites `scripts/mutate-order.py` runs after deleting each `wait` and each
//! `record` of the engine, the serving transfers and sparse decode in turn: every deletion
//! must make one of them fail (docs/offload.md, "Proof by mutation").

mod common;

use std::sync::Arc;

use common::{scratch_dir, TinySpec};
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::engine::verified::generate_verified;
use strata::engine::{self, GenerateOptions, GenerationOutput, SamplingParams};
use strata::gpucheck::serve_checks::{disk_case, serve_case};
use strata::kv::{ContiguousKv, KvCache};
use strata::model::random::Shape;
use strata::model::Model;
use strata::offload::{CpuOffloadEngine, OffloadConfig, OffloadControl};
use strata::serve::{Engine, EngineConfig};
use strata::sparse::SparseConfig;

/// Five layers, so that rings of two to four slots are reused within one prefill.
fn model() -> Arc<Model> {
    let spec = TinySpec {
        layers: 5,
        ..TinySpec::llama()
    };
    common::load_tiny(spec, "stream_order_model", 7)
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: n,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
    }
}

fn prompt(rng: &mut StdRng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|_| rng.random_range(3..vocab as u32))
        .collect()
}

fn plain(model: &Arc<Model>, prompt: &[u32], n: usize) -> GenerationOutput {
    let c = &model.cfg;
    let cap = prompt.len() + n;
    let mut kv = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, cap);
    engine::generate_with(model, &mut kv, cap, prompt, &greedy(n), &mut |_| Ok(())).unwrap()
}

fn checked(cfg: OffloadConfig) -> OffloadConfig {
    OffloadConfig {
        check_order: true,
        ..cfg
    }
}

/// Runs each prompt in turn on one engine (each request resets it); panics with the
/// checker's report on a race.
fn run_all(
    model: &Arc<Model>,
    cfg: OffloadConfig,
    prompts: &[Vec<u32>],
    n: usize,
) -> (Vec<GenerationOutput>, CpuOffloadEngine) {
    let mut kv = CpuOffloadEngine::on_cpu(&model.cfg, checked(cfg)).unwrap();
    assert!(kv.order_checked());
    let cap = kv.capacity();
    let outs = prompts
        .iter()
        .map(|p| {
            engine::generate_with(model, &mut kv, cap, p, &greedy(n), &mut |_| Ok(()))
                .unwrap_or_else(|e| panic!("{e:#}"))
        })
        .collect();
    (outs, kv)
}

#[test]
fn offload_prefill_and_decode_are_proven_ordered_across_ring_and_block_sizes() {
    let model = model();
    let mut rng = StdRng::seed_from_u64(11);
    let vocab = model.cfg.vocab_size;
    // Prompts with and without a partial last block; decode crosses block boundaries, so
    // the decode buffer flushes and the next prefetch reads the flushed block.
    let prompts: Vec<_> = [21, 16, 3].map(|l| prompt(&mut rng, l, vocab)).into();
    let n = 19;
    for (nb, bs) in [(2, 4), (3, 8), (4, 4), (6, 16)] {
        let cfg = OffloadConfig {
            num_kv_buffers: nb,
            block_size: bs,
            max_model_len: 48,
            ..Default::default()
        };
        let (outs, _) = run_all(&model, cfg, &prompts, n);
        for (p, out) in prompts.iter().zip(&outs) {
            let want = plain(&model, p, n);
            assert_eq!(out.token_ids, want.token_ids, "ring {nb}, block {bs}");
        }
    }
}

#[test]
fn sparse_decode_moves_and_misses_are_proven_ordered() {
    let model = model();
    let mut rng = StdRng::seed_from_u64(12);
    let prompts = vec![prompt(&mut rng, 150, model.cfg.vocab_size)];
    let n = 30;
    for nb in [2, 3] {
        let cfg = OffloadConfig {
            num_kv_buffers: nb,
            block_size: 16,
            max_model_len: 200,
            sparse: Some(SparseConfig {
                budget: 48,
                page_size: 8,
            }),
            ..Default::default()
        };
        let (outs, kv) = run_all(&model, cfg.clone(), &prompts, n);
        let stats = kv.sparse_stats().unwrap();
        assert!(stats.miss_pages > 0 && stats.hit_pages > 0, "{stats:?}");
        // The same selections with the sanitizer's delays and poison.
        let sanitized = OffloadConfig {
            sanitize: true,
            ..cfg
        };
        let (again, _) = run_all(&model, sanitized, &prompts, n);
        assert_eq!(again[0].token_ids, outs[0].token_ids, "ring {nb}");
    }
}

#[test]
fn verified_sparse_decode_extensions_and_rewinds_are_proven_ordered() {
    let model = model();
    let mut rng = StdRng::seed_from_u64(13);
    let p = prompt(&mut rng, 70, model.cfg.vocab_size);
    let n = 30;
    let want = plain(&model, &p, n);
    // Blocks of 8 and drafts of 5: verify steps fill blocks from the slot and rewinds
    // land in blocks already flushed.
    for nb in [2, 4] {
        let cfg = checked(OffloadConfig {
            num_kv_buffers: nb,
            block_size: 8,
            max_model_len: 110,
            sparse: Some(SparseConfig {
                budget: 24,
                page_size: 4,
            }),
            ..Default::default()
        });
        let mut kv = CpuOffloadEngine::on_cpu(&model.cfg, cfg).unwrap();
        assert!(kv.order_checked());
        let cap = kv.capacity();
        let out = generate_verified(&*model, &mut kv, cap, &p, &greedy(n), 5, &mut |_| Ok(()))
            .unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(out.token_ids, want.token_ids, "ring {nb}");
    }
}

/// The CPU model over pages on the CPU device: what `strata serve` runs without a GPU.
/// Routed experts streamed to the (emulated) GPU a layer at a time: a slot refilled while
/// the step goes on (1 and 3 slots for gpt-oss's 4 experts layers), the next step's
/// first layers prefetched during this one's last, with the KV offloaded too.
#[test]
fn streamed_experts_are_proven_ordered() {
    use strata::gpucheck::emu::{emulator_expert_stream, emulator_offload_engine, EmuExec};
    use strata::gpucheck::model_checks::expert_stream_case;
    let model = common::tiny_gpt_oss("stream_order_experts");
    let mut rng = StdRng::seed_from_u64(3);
    let p = prompt(&mut rng, 20, model.cfg.vocab_size);
    let exec = Arc::new(EmuExec::new().unwrap());
    let rows = expert_stream_case(
        exec,
        &emulator_offload_engine,
        &emulator_expert_stream,
        "gpt-oss tiny",
        &model,
        &p,
        &greedy(6),
        &[1, 3],
    )
    .unwrap();
    all_pass(&rows);
}

fn cpu_engine(m: &Arc<Model>, c: &EngineConfig) -> anyhow::Result<Engine> {
    Engine::new(Arc::clone(m), c.clone())
}

fn all_pass(rows: &[strata::gpucheck::kernels::CheckRow]) {
    let failed: Vec<_> = rows.iter().filter(|r| !r.pass).collect();
    assert!(failed.is_empty(), "{failed:#?}");
}

#[test]
fn cpu_serving_stores_loads_and_recomputation_are_proven_ordered() {
    let rows =
        serve_case(&cpu_engine, "tiny", Shape::tiny(), true).unwrap_or_else(|e| panic!("{e:#}"));
    all_pass(&rows);
}

#[test]
fn the_disk_tier_staging_is_proven_ordered() {
    let dir = scratch_dir("stream_order_disk");
    let rows =
        disk_case(&cpu_engine, "tiny", Shape::tiny(), &dir).unwrap_or_else(|e| panic!("{e:#}"));
    all_pass(&rows);
}

#[test]
fn serving_stores_loads_and_recomputation_are_proven_ordered() {
    // The serving engine on the kernel emulator's device pages: preemption with host
    // offload and with recomputation, tokens bitwise those of the unconstrained run.
    let make = strata::gpucheck::emu::emulator_serve_engine;
    let rows = serve_case(&make, "tiny", Shape::tiny(), false).unwrap_or_else(|e| panic!("{e:#}"));
    let failed: Vec<_> = rows.iter().filter(|r| !r.pass).collect();
    assert!(failed.is_empty(), "{failed:#?}");
}
