//! End-to-end tests of the serving engine on a tiny random model: with greedy sampling
//! and so few GPU blocks that preemption happens often, every request's tokens equal its
//! tokens in an unconstrained run, with offload and with recomputation, in every KV
//! element (`common::KV_DTYPES`: each against the unconstrained run of its own element).

mod common;

use std::sync::Arc;

use common::{
    scratch_dir, serve_config as config_kv, serve_requests as requests, serve_sched as sched,
    TinySpec, KV_DTYPES,
};
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::device::KvDtype;
use strata::engine::{GenerateOptions, SamplingParams};
use strata::model::Model;
use strata::serve::transfer::ChaosBackend;
use strata::serve::{Engine, EngineConfig, RequestParams, SchedulerConfig};
use strata::server::engine_thread::{self, Event};
use strata::server::metrics::Metrics;

fn tiny_model(name: &str) -> Arc<Model> {
    let dir = scratch_dir(name);
    TinySpec::llama().write(&dir, 7);
    Model::load(&dir, false).unwrap().0
}

fn config(gpu: usize, cpu: usize, sanitize: bool) -> EngineConfig {
    config_kv(KvDtype::F32, gpu, cpu, sanitize)
}

fn working_set(p: &[Vec<u32>], r: &[RequestParams]) -> usize {
    p.iter()
        .zip(r)
        .map(|(p, r)| (p.len() + r.max_tokens).div_ceil(4))
        .sum()
}

#[test]
fn preempted_requests_match_an_unconstrained_run_with_offload_and_with_recompute() {
    let model = tiny_model("serve_engine_accuracy");
    for (kv, shared) in KV_DTYPES.into_iter().flat_map(|k| [(k, 0), (k, 16)]) {
        let config = |gpu, cpu, sanitize| config_kv(kv, gpu, cpu, sanitize);
        let (prompts, params) = requests(11 + shared as u64, 8, shared);
        let ws = working_set(&prompts, &params);
        let mut free = Engine::new(model.clone(), config(ws, 0, false)).unwrap();
        let want_lp = free.generate_with_logprobs(&prompts, &params).unwrap();
        let want: Vec<Vec<u32>> = want_lp.iter().map(|(t, _)| t.clone()).collect();
        assert_eq!(free.stats().sched.preemptions, 0);
        if shared > 0 {
            assert!(free.stats().sched.prefix_hit_blocks > 0);
        }
        assert!(want
            .iter()
            .zip(&params)
            .all(|(w, p)| w.len() == p.max_tokens));
        // A third of the working set, counting the shared prefix once; every request still
        // fits alone.
        let tight = (ws - (prompts.len() - 1) * shared / 4) / 3;
        assert!(tight * 4 >= 70 + 40);
        for cpu in [0, 1000] {
            let mut e = Engine::new(model.clone(), config(tight, cpu, false)).unwrap();
            let got_lp = e.generate_with_logprobs(&prompts, &params).unwrap();
            let got: Vec<Vec<u32>> = got_lp.iter().map(|(t, _)| t.clone()).collect();
            let st = e.stats().sched;
            assert!(
                st.preemptions >= 3,
                "{kv} shared {shared} cpu {cpu}: {st:?}"
            );
            // Bitwise, not just argmax-equal: every token's log-probability is identical.
            for (i, ((_, g), (_, w))) in got_lp.iter().zip(&want_lp).enumerate() {
                assert_eq!(
                    g, w,
                    "{kv} shared {shared} cpu {cpu}: request {i} logprobs differ"
                );
            }
            if cpu == 0 {
                assert_eq!(st.recomputations, st.preemptions);
                assert_eq!(st.blocks_stored, 0);
            } else {
                assert!(st.blocks_stored > 0 && st.blocks_loaded > 0, "{st:?}");
            }
            if shared > 0 {
                assert!(st.prefix_hit_blocks > 0, "{st:?}");
            }
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{kv} shared {shared} cpu {cpu}: request {i} differs");
            }
            let bm = &e.scheduler().bm;
            assert_eq!(bm.available_pages(), bm.num_pages());
            assert_eq!(bm.free_slots(), bm.num_slots());
        }
    }
}

#[test]
fn late_random_order_and_failed_transfers_keep_tokens_exact() {
    // Copies are delayed at random (sanitizer), completions are reported late and out of
    // order, and a quarter of the jobs fail after running: a page reused under an
    // in-flight store, or a half-moved block, would change the tokens.
    let model = tiny_model("serve_engine_chaos");
    let (prompts, params) = requests(5, 8, 8);
    let ws = working_set(&prompts, &params);
    for kv in KV_DTYPES {
        let want = Engine::new(model.clone(), config_kv(kv, ws, 0, false))
            .unwrap()
            .generate(&prompts, &params)
            .unwrap();
        for (seed, cpu) in [(1, 1000), (2, 1000), (3, 12)] {
            let cfg = config_kv(kv, ws / 3, cpu, true);
            let mut e = Engine::with_backend(model.clone(), cfg, |b| {
                Box::new(ChaosBackend::new(b, seed, 0.3, 0.25))
            })
            .unwrap();
            let got = e.generate(&prompts, &params).unwrap();
            let st = e.stats().sched;
            assert!(st.preemptions > 0 && st.blocks_stored > 0, "{st:?}");
            assert_eq!(got, want, "{kv} seed {seed}: {st:?}");
        }
    }
}

#[test]
fn serving_equals_generate_bitwise_however_the_prompt_is_chunked() {
    // `engine::generate` runs the whole prompt in one forward over a contiguous cache; the
    // engine cuts it into 8-token chunks batched with other requests over pages. The
    // kernels are batch-invariant, so the log-probabilities are the same bits.
    let model = tiny_model("serve_engine_contiguous");
    let (prompts, params) = requests(9, 4, 0);
    for kv in KV_DTYPES {
        let got = Engine::new(model.clone(), config_kv(kv, 200, 0, false))
            .unwrap()
            .generate_with_logprobs(&prompts, &params)
            .unwrap();
        for (i, p) in prompts.iter().enumerate() {
            let opts = GenerateOptions {
                max_tokens: params[i].max_tokens,
                sampling: SamplingParams::default(),
                stop_ids: vec![],
            };
            let want = common::generate_plain(&model, kv, p, &opts, 512);
            assert_eq!(got[i].0, want.token_ids, "{kv} request {i}");
            assert_eq!(bits(&got[i].1), bits(&want.logprobs), "{kv} request {i}");
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_requests_logprobs_are_bitwise_equal_alone_and_among_1_to_15_companions_under_preemption() {
    let model = tiny_model("serve_engine_invariance");
    let mut rng = StdRng::seed_from_u64(77);
    let target: Vec<u32> = (0..60).map(|_| rng.random_range(3..300)).collect();
    let tp = RequestParams {
        max_tokens: 30,
        ignore_eos: true,
        ..Default::default()
    };
    let alone = Engine::new(model.clone(), config(100, 0, false))
        .unwrap()
        .generate_with_logprobs(std::slice::from_ref(&target), std::slice::from_ref(&tp))
        .unwrap()
        .remove(0);
    let mut preemptions = [0; 2];
    for n in [2, 3, 5, 8, 12, 16] {
        let (mut prompts, mut params) = requests(100 + n as u64, n - 1, 0);
        let at = rng.random_range(0..n);
        prompts.insert(at, target.clone());
        params.insert(at, tp.clone());
        // A third of the working set, but room for the largest request alone.
        let tight = (working_set(&prompts, &params) / 3).max((70 + 40) / 4);
        for (c, cpu) in [0, 1000].into_iter().enumerate() {
            let mut e = Engine::new(model.clone(), config(tight, cpu, false)).unwrap();
            let got = e.generate_with_logprobs(&prompts, &params).unwrap();
            preemptions[c] += e.stats().sched.preemptions;
            assert_eq!(got[at].0, alone.0, "{n} requests, cpu {cpu}: tokens differ");
            assert_eq!(
                bits(&got[at].1),
                bits(&alone.1),
                "{n} requests, cpu {cpu}: logprobs differ"
            );
        }
    }
    assert!(
        preemptions.iter().all(|&p| p >= 5),
        "too little preemption pressure: {preemptions:?}"
    );
}

#[test]
fn submitted_requests_stream_their_tokens() {
    let model = tiny_model("serve_engine_stream");
    let (prompts, params) = requests(21, 3, 0);
    let want = Engine::new(model.clone(), config(60, 0, false))
        .unwrap()
        .generate(&prompts, &params)
        .unwrap();
    // Step-driven streaming, requests joining between steps.
    let mut e = Engine::new(model.clone(), config(60, 100, false)).unwrap();
    let (_, rx0) = e.submit(prompts[0].clone(), &params[0]).unwrap();
    e.step().unwrap();
    e.step().unwrap();
    let (_, rx1) = e.submit(prompts[1].clone(), &params[1]).unwrap();
    while e.has_unfinished() {
        e.step().unwrap();
    }
    assert_eq!(rx0.try_iter().collect::<Vec<_>>(), want[0]);
    assert_eq!(rx1.try_iter().collect::<Vec<_>>(), want[1]);
    // On the server's engine thread (the one admission loop), requests joining at once.
    let e = Engine::new(model, config(60, 100, false)).unwrap();
    let metrics = Arc::new(Metrics::new("tiny"));
    let (client, thread) = engine_thread::spawn(e, Arc::clone(&metrics), vec![], None).unwrap();
    let rxs: Vec<_> = (0..3)
        .map(|i| {
            client
                .submit(prompts[i].clone(), params[i].clone())
                .unwrap()
        })
        .collect();
    for (mut rx, w) in rxs.into_iter().zip(&want) {
        let mut got = Vec::new();
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                Event::Token(t, _) => got.push(t),
                Event::Done(_) => break,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(&got, w);
    }
    client.shutdown();
    thread.join().unwrap().unwrap();
    assert!(!client.is_alive());
}

#[test]
fn bad_requests_are_errors() {
    let model = tiny_model("serve_engine_errors");
    let mut e = Engine::new(model, config(8, 0, false)).unwrap();
    let p = RequestParams {
        max_tokens: 4,
        ..Default::default()
    };
    assert!(e.add_request(vec![], &p).is_err());
    assert!(
        e.add_request(vec![5; 40], &p).is_err(),
        "cannot fit 44 tokens in 32"
    );
    assert!(e.add_request(vec![100_000], &p).is_err());
    let mut bad = config(8, 0, false);
    bad.sched.prefill_chunk = 6;
    assert!(Engine::new(tiny_model("serve_engine_errors2"), bad).is_err());
}

/// Two 16-token blocks whose prefix-cache keys were equal under the 64-bit unkeyed
/// `DefaultHasher` strata used before SHA-256, found by scripts/find-hash-collision.rs
/// (Pollard's rho, ~2^32 hashes, 3 CPU-minutes): both hash to 0xd6af4de465a4db70.
const COLLIDING: [[u32; 16]; 2] = [
    [
        1002, 1007, 1008, 1007, 1008, 1006, 1015, 1000, 1007, 1013, 1003, 1004, 1010, 1003, 1004,
        1014,
    ],
    [
        1012, 1001, 1015, 1010, 1013, 1011, 1011, 1006, 1005, 1012, 1006, 1002, 1015, 1010, 1009,
        1007,
    ],
];

#[test]
fn prompts_whose_old_64_bit_keys_collide_never_share_a_cached_block() {
    use std::hash::{Hash, Hasher};
    // The pair is a real collision of the old key (so this test would catch its return).
    let old_key = |tokens: &[u32]| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        None::<u64>.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    };
    assert_ne!(COLLIDING[0], COLLIDING[1]);
    assert_eq!(old_key(&COLLIDING[0]), old_key(&COLLIDING[1]));
    assert_eq!(old_key(&COLLIDING[0]), 0xd6af4de465a4db70);

    let dir = scratch_dir("serve_engine_collision");
    TinySpec {
        vocab: 1100,
        ..TinySpec::llama()
    }
    .write(&dir, 7);
    let model = Model::load(&dir, false).unwrap().0;
    let cfg = EngineConfig {
        sched: SchedulerConfig {
            block_size: 16,
            prefill_chunk: 16,
            ..sched(40, 0)
        },
        ..config(40, 0, false)
    };
    // Each prompt: its block, then a token to compute (a hit always leaves one).
    let prompts: Vec<Vec<u32>> = COLLIDING.iter().map(|b| [&b[..], &[5]].concat()).collect();
    let params = [RequestParams {
        max_tokens: 12,
        ignore_eos: true,
        ..Default::default()
    }];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            Engine::new(model.clone(), cfg.clone())
                .unwrap()
                .generate(std::slice::from_ref(p), &params)
                .unwrap()
                .remove(0)
        })
        .collect();
    assert_ne!(
        alone[0], alone[1],
        "the two prompts must answer differently"
    );
    // One engine, the first prompt's block cached when the second arrives.
    let mut e = Engine::new(model, cfg).unwrap();
    let first = e.generate(&prompts[..1], &params).unwrap().remove(0);
    let hits_before = e.stats().sched.prefix_hit_blocks;
    let second = e.generate(&prompts[1..], &params).unwrap().remove(0);
    assert_eq!(first, alone[0]);
    assert_eq!(
        second, alone[1],
        "the second prompt got the first one's cached block"
    );
    assert_eq!(e.stats().sched.prefix_hit_blocks, hits_before);
    // And the same prompt again does hit.
    e.generate(&prompts[1..], &params).unwrap();
    assert_eq!(e.stats().sched.prefix_hit_blocks, hits_before + 1);
}

/// Each request's tokens and log-prob bits from `engine::generate` alone, over a cache that
/// keeps every position: what serving must equal.
/// A 1000-block disk tier in `dir` for `cfg`.
fn with_disk_tier(cfg: &mut EngineConfig, dir: &std::path::Path) {
    cfg.sched.max_disk_offload_blocks = 1000;
    cfg.disk = Some(strata::serve::disk::DiskTierConfig {
        dir: dir.to_path_buf(),
        io_threads: 2,
    });
}

/// Every request's tokens and log-prob bits equal the reference's (`generated`).
fn assert_requests_equal(got: &[(Vec<u32>, Vec<f32>)], want: &[(Vec<u32>, Vec<u32>)], what: &str) {
    for (i, ((t, lp), (wt, wlp))) in got.iter().zip(want).enumerate() {
        assert_eq!((t, &bits(lp)), (wt, wlp), "{what}: request {i}");
    }
}

fn generated(
    model: &Arc<Model>,
    kv: KvDtype,
    prompts: &[Vec<u32>],
    params: &[RequestParams],
) -> Vec<(Vec<u32>, Vec<u32>)> {
    prompts
        .iter()
        .zip(params)
        .map(|(p, r)| {
            let greedy = common::greedy(r.max_tokens);
            let out = common::generate_plain(model, kv, p, &greedy, p.len() + r.max_tokens);
            (out.token_ids, bits(&out.logprobs))
        })
        .collect()
}

/// A sliding-window model (tiny Gemma 3, window 12: prompts and outputs cross it many
/// times) served under preemption to host memory, to disk, and by recomputation: every
/// request's tokens and log-prob bits equal `engine::generate`'s over a cache that keeps
/// every position, in every KV element. The windowed layers' pages come from their own
/// pool, freed as windows move on; with 2 sequences at a time that pool is a third of the
/// full layers' pages.
#[test]
fn sliding_window_model_under_preemption_matches_generate_bitwise() {
    let model = common::tiny_gemma3(12);
    let (prompts, params) = requests(17, 8, 8);
    let ws = working_set(&prompts, &params);
    for kv in KV_DTYPES {
        let want = generated(&model, kv, &prompts, &params);
        let disk = scratch_dir("serve_window_disk");
        for (cpu, on_disk, seqs) in [
            (0, false, 16),
            (1000, false, 16),
            (4, true, 16),
            (1000, false, 2),
        ] {
            let mut cfg = config_kv(kv, ws / 3, cpu, false);
            cfg.sched.max_num_seqs = seqs;
            let pool = strata::serve::scheduler::window_pool_pages(&cfg.sched, 12);
            if seqs == 2 {
                assert!(pool * 3 <= cfg.sched.num_gpu_blocks, "{pool} of {}", ws / 3);
            }
            if on_disk {
                with_disk_tier(&mut cfg, &disk);
            }
            let mut e = Engine::new(model.clone(), cfg).unwrap();
            let got = e.generate_with_logprobs(&prompts, &params).unwrap();
            let st = e.stats().sched;
            // (Two sequences at a time fit the pages: that case is about the small pool.)
            assert!(
                st.preemptions >= 3 || seqs == 2,
                "{kv} cpu {cpu} disk {on_disk}: {st:?}"
            );
            assert!(st.window_releases > 0, "{st:?}");
            assert_requests_equal(&got, &want, &format!("{kv} cpu {cpu} disk {on_disk}"));
        }
    }
}

/// gpt-oss (transformers' tiny random checkpoint: window 32, sinks, experts) served under
/// preemption to host memory, to disk and by recomputation, with the windowed layers'
/// own page pool: every request's tokens and log-prob bits equal `engine::generate`'s.
#[test]
fn gpt_oss_under_preemption_matches_generate_bitwise() {
    let model = common::tiny_gpt_oss("serve_gpt_oss");
    let (prompts, params) = requests(62, 6, 8);
    let ws = working_set(&prompts, &params);
    let kv = KvDtype::F16;
    let want = generated(&model, kv, &prompts, &params);
    let disk = scratch_dir("serve_gpt_oss_disk");
    for (cpu, on_disk) in [(0, false), (1000, false), (4, true)] {
        let mut cfg = config_kv(kv, ws / 3, cpu, false);
        if on_disk {
            with_disk_tier(&mut cfg, &disk);
        }
        let mut e = Engine::new(model.clone(), cfg).unwrap();
        let got = e.generate_with_logprobs(&prompts, &params).unwrap();
        let st = e.stats().sched;
        assert!(st.preemptions >= 3, "cpu {cpu} disk {on_disk}: {st:?}");
        assert_requests_equal(&got, &want, &format!("cpu {cpu} disk {on_disk}"));
    }
}

/// Qwen3.5 (transformers' tiny random checkpoints, dense and MoE: three Gated DeltaNet
/// state layers to every full one) served under preemption to host memory, to disk and by recomputation:
/// every request's tokens and log-prob bits equal `engine::generate`'s. Each sequence's
/// recurrent state stays with it while its blocks move between tiers; the requests share
/// a 16-token prefix, which a state model never takes from the prefix cache (its state
/// after the prefix is in no block), so there are no hits and nothing is registered.
#[test]
fn qwen35_under_preemption_matches_generate_bitwise() {
    let (prompts, params) = requests(35, 6, 16);
    let ws = working_set(&prompts, &params);
    let kv = KvDtype::F16;
    let disk = scratch_dir("serve_qwen35_disk");
    let dense = common::tiny_qwen35("serve_qwen35");
    let moe = common::tiny_qwen35_moe("serve_qwen35_moe");
    for (model, cpu, on_disk) in [
        (&dense, 0, false),
        (&dense, 1000, false),
        (&dense, 4, true),
        (&moe, 1000, false),
    ] {
        let want = generated(model, kv, &prompts, &params);
        let mut cfg = config_kv(kv, ws / 3, cpu, false);
        // Pages for the 2 full-attention layers only (f16: 2 bytes).
        let page = 2 * cfg.sched.block_size * model.cfg.kv_dim() * 2;
        let device = strata::serve::setup::device_kv_bytes(&model.cfg, &cfg.sched, 2);
        assert_eq!(device, Some(2 * cfg.sched.num_gpu_blocks * page));
        if on_disk {
            with_disk_tier(&mut cfg, &disk);
        }
        let mut e = Engine::new(model.clone(), cfg).unwrap();
        let got = e.generate_with_logprobs(&prompts, &params).unwrap();
        let st = e.stats().sched;
        assert!(st.preemptions >= 3, "cpu {cpu} disk {on_disk}: {st:?}");
        assert_eq!(st.prefix_hit_blocks, 0, "{st:?}");
        if cpu > 0 {
            assert!(st.blocks_stored > 0, "the victims' blocks moved: {st:?}");
        }
        assert_requests_equal(&got, &want, &format!("cpu {cpu} disk {on_disk}"));
    }
}

/// Recurrent states live exactly as long as their requests: while 6 Qwen3.5 requests run
/// under preemption the engine holds one state per live sequence (the reported bytes a
/// whole multiple of one sequence's), a cancelled request's and every finished one's are
/// dropped, and none is left once all are done (`strata:recurrent_state_bytes` reads 0).
#[test]
fn qwen35_states_are_released_when_requests_finish_or_are_cancelled() {
    let (prompts, params) = requests(36, 6, 16);
    let ws = working_set(&prompts, &params);
    let model = common::tiny_qwen35("serve_qwen35_release");
    let per_seq = strata::kv::RecurrentStates::for_model(&model.cfg).seq_bytes();
    assert!(per_seq > 0);
    let mut e = Engine::new(model.clone(), config_kv(KvDtype::F32, ws / 3, 1000, false)).unwrap();
    let ids: Vec<_> = (prompts.iter().zip(&params))
        .map(|(p, r)| e.add_request(p.clone(), r).unwrap())
        .collect();
    let (mut most, mut cancelled) = (0, false);
    while e.has_unfinished() {
        e.step().unwrap();
        let held = e.stats().recurrent_state_bytes;
        assert_eq!(
            held % per_seq,
            0,
            "{held} bytes is not whole sequences' states"
        );
        assert!(held / per_seq <= e.scheduler().num_running() + e.scheduler().num_waiting());
        most = most.max(held / per_seq);
        if !cancelled && held > 0 {
            e.abort(ids[0]).unwrap();
            assert_eq!(
                e.stats().recurrent_state_bytes,
                held - per_seq,
                "the cancelled request's state is dropped"
            );
            cancelled = true;
        }
    }
    assert!(most >= 2, "several sequences held states at once: {most}");
    assert_eq!(
        e.stats().recurrent_state_bytes,
        0,
        "states left after every request ended"
    );
    let metrics = Metrics::new("m");
    let mut last = Default::default();
    metrics.observe_engine(e.scheduler(), &e.stats(), &mut last);
    assert!(
        metrics.render().contains("strata:recurrent_state_bytes 0"),
        "{}",
        metrics.render()
    );
}
