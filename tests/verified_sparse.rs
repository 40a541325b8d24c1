//! Verified sparse decode (`--sparse-verify`, `engine::verified`): sparse decode drafts,
//! one full-attention step checks the drafts, the rejected ones are forgotten. Its greedy
//! output is the plain full-attention run's, tokens and log-probs bit for bit, across
//! ring, block, page and draft sizes, while the unverified sparse run differs (so the
//! verification is what keeps it); under the sanitizer too. The pieces it stands on, each
//! tested here: a multi-token step after a stored context (a follow-up turn) is bitwise
//! the resident cache's, and `truncate` refuses what it cannot do.

mod common;

use std::sync::Arc;

use common::{bits, greedy, random_prompt, TinySpec};
use rand::{rngs::StdRng, SeedableRng};
use strata::device::KvDtype;
use strata::engine::verified::generate_verified;
use strata::engine::{self, GenerationOutput};
use strata::kv::{ContiguousKv, KvCache};
use strata::model::Model;
use strata::offload::{CpuOffloadEngine, OffloadConfig};
use strata::sparse::SparseConfig;

/// One request on an f32 offload engine: verified with `draft` drafts, or plain.
fn offloaded(
    model: &Arc<Model>,
    cfg: OffloadConfig,
    prompt: &[u32],
    n: usize,
    draft: Option<usize>,
) -> GenerationOutput {
    let mut kv = CpuOffloadEngine::on_cpu(&model.cfg, cfg).unwrap();
    let cap = kv.capacity();
    let opts = greedy(n);
    let out = match draft {
        Some(k) => generate_verified(&**model, &mut kv, cap, prompt, &opts, k, &mut |_| Ok(())),
        None => engine::generate_with(model, &mut kv, cap, prompt, &opts, &mut |_| Ok(())),
    };
    out.unwrap_or_else(|e| panic!("{e:#}"))
}

/// (ring slots, block, page, budget, drafts, prompt length): blocks as small as 4 so
/// that rounds cross block boundaries and rewinds land in blocks already flushed.
const CASES: [(usize, usize, usize, usize, usize, usize); 5] = [
    (2, 16, 8, 48, 4, 150),
    (3, 8, 4, 24, 5, 90),
    (4, 16, 8, 32, 1, 120),
    (2, 4, 4, 12, 7, 61),
    (3, 8, 8, 24, 3, 100),
];

#[test]
fn verified_sparse_decode_is_bitwise_full_attention() {
    let mut rng = StdRng::seed_from_u64(41);
    let (mut rejected, mut sparse_differs) = (0, 0);
    for (spec, name) in [
        (TinySpec::llama(), "verified_llama"),
        (TinySpec::qwen3(), "verified_qwen3"),
    ] {
        let model = common::load_tiny(spec, name, 43);
        for (nb, bs, page, budget, k, len) in CASES {
            let prompt = random_prompt(&mut rng, len, model.cfg.vocab_size);
            let n = 50;
            let want = common::generate_plain(&model, KvDtype::F32, &prompt, &greedy(n), len + n);
            let cfg = OffloadConfig {
                num_kv_buffers: nb,
                block_size: bs,
                max_model_len: len + n,
                sparse: Some(SparseConfig {
                    budget,
                    page_size: page,
                }),
                ..Default::default()
            };
            let ctx =
                format!("{name}: ring {nb}, block {bs}, page {page}, budget {budget}, {k} drafts");
            let got = offloaded(&model, cfg.clone(), &prompt, n, Some(k));
            assert_eq!(got.token_ids, want.token_ids, "{ctx}");
            assert_eq!(bits(&got.logprobs), bits(&want.logprobs), "{ctx}");
            let v = got.verified.expect("verified stats");
            assert_eq!(
                got.token_ids.len(),
                1 + v.rounds + v.accepted,
                "{ctx}: {v:?}"
            );
            rejected += v.drafted - v.accepted;
            let sparse = offloaded(&model, cfg, &prompt, n, None);
            sparse_differs += usize::from(bits(&sparse.logprobs) != bits(&want.logprobs));
        }
    }
    // The cases mean something only if sparse decode alone strays from full attention and
    // the verify step throws drafts away.
    assert!(
        sparse_differs >= 5,
        "unverified sparse decode equals full attention on all but {sparse_differs} cases"
    );
    assert!(rejected > 0, "no draft was ever rejected");
}

/// The sanitizer delays every copy at random and poisons released slots and the rows a
/// rewind forgets: verified output stays full attention's.
#[test]
fn verified_sparse_decode_is_unchanged_under_the_sanitizer() {
    let model = common::load_tiny(TinySpec::llama(), "verified_sanitized", 47);
    let mut rng = StdRng::seed_from_u64(5);
    let (len, n) = (90, 40);
    let prompt = random_prompt(&mut rng, len, model.cfg.vocab_size);
    let want = common::generate_plain(&model, KvDtype::F32, &prompt, &greedy(n), len + n);
    let cfg = OffloadConfig {
        num_kv_buffers: 2,
        block_size: 8,
        max_model_len: len + n,
        sanitize: true,
        sparse: Some(SparseConfig {
            budget: 16,
            page_size: 4,
        }),
        ..Default::default()
    };
    for k in [2, 6] {
        let got = offloaded(&model, cfg.clone(), &prompt, n, Some(k));
        assert_eq!(got.token_ids, want.token_ids, "{k} drafts");
        assert_eq!(bits(&got.logprobs), bits(&want.logprobs), "{k} drafts");
    }
}

/// A second turn appended to an offloaded context in one step (several blocks long, from
/// the middle of a block), then decoded: every logit is the resident cache's.
#[test]
fn a_follow_up_turn_extends_the_offloaded_context_bitwise() {
    let model = common::load_tiny(TinySpec::qwen3(), "verified_extend", 49);
    let c = &model.cfg;
    let mut rng = StdRng::seed_from_u64(6);
    let (first, second) = (
        random_prompt(&mut rng, 21, c.vocab_size),
        random_prompt(&mut rng, 37, c.vocab_size),
    );
    let cap = 80;
    let sparse = Some(SparseConfig {
        budget: 24,
        page_size: 8,
    });
    for (nb, sparse) in [(2, None), (3, None), (3, sparse)] {
        let cfg = OffloadConfig {
            num_kv_buffers: nb,
            block_size: 8,
            max_model_len: cap,
            check_order: true,
            sparse,
            ..Default::default()
        };
        let mut off = CpuOffloadEngine::on_cpu(c, cfg).unwrap();
        let mut res = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, cap);
        let kvs: [&mut dyn KvCache<f32>; 2] = [&mut off, &mut res];
        let [a, b] = kvs.map(|kv| {
            kv.reset().unwrap();
            let mut logits = vec![model.forward(&first, 0, kv).unwrap()];
            logits.extend(model.forward_rows(&second, first.len(), kv).unwrap());
            // Decode steps after it: the extension's rows were stored where they go.
            let end = first.len() + second.len();
            for pos in end..end + 5 {
                let next = strata::engine::sampler::argmax(logits.last().unwrap());
                logits.push(model.forward(&[next], pos, kv).unwrap());
            }
            logits
        });
        let ctx = format!("ring {nb}, sparse {sparse:?}");
        if sparse.is_none() {
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert_eq!(bits(x), bits(y), "{ctx}: row {i}");
            }
        } else {
            // Sparse decode steps differ from full attention by design; the extension
            // attends everything.
            for (i, (x, y)) in a.iter().zip(&b).take(1 + second.len()).enumerate() {
                assert_eq!(bits(x), bits(y), "{ctx}: row {i}");
            }
        }
    }
}

#[test]
fn truncate_and_steps_off_the_stored_context_are_refused() {
    let model = common::load_tiny(TinySpec::llama(), "verified_refusals", 51);
    let c = &model.cfg;
    let cfg = OffloadConfig {
        num_kv_buffers: 2,
        block_size: 8,
        max_model_len: 64,
        ..Default::default()
    };
    let mut kv = CpuOffloadEngine::on_cpu(c, cfg).unwrap();
    kv.reset().unwrap();
    model.forward(&[5, 6, 7, 8, 9], 0, &mut kv).unwrap();
    let err = kv.truncate(6).unwrap_err().to_string();
    assert!(
        err.contains("cannot truncate to 6 tokens, 5 are stored"),
        "{err}"
    );
    // A step must start where the stored context ends.
    let err = model.forward(&[3], 3, &mut kv).unwrap_err().to_string();
    assert!(err.contains("must continue the stored context"), "{err}");
    // After a rewind it may start there, and it matches a run that never went further.
    kv.truncate(3).unwrap();
    let after = model.forward(&[4], 3, &mut kv).unwrap();
    kv.reset().unwrap();
    model.forward(&[5, 6, 7], 0, &mut kv).unwrap();
    assert_eq!(
        bits(&after),
        bits(&model.forward(&[4], 3, &mut kv).unwrap())
    );
}

/// What `generate --enable-offload --sparse-budget B --sparse-verify K` runs: a session
/// whose decode is verified gives the resident session's tokens and log-probs; the
/// settings it cannot honour are refused before anything is allocated.
#[test]
fn a_verified_session_is_the_resident_sessions_run() {
    use strata::device::DeviceKind;
    use strata::session::{ProfileSteps, Session, SessionConfig};
    let model = common::load_tiny(TinySpec::qwen3(), "verified_session", 53);
    let mut rng = StdRng::seed_from_u64(7);
    let (len, n) = (100, 40);
    let prompt = random_prompt(&mut rng, len, model.cfg.vocab_size);
    let base = SessionConfig {
        kv_dtype: KvDtype::F32,
        ..SessionConfig::new(DeviceKind::Cpu, len + n)
    };
    let offload = OffloadConfig {
        num_kv_buffers: 3,
        block_size: 16,
        max_model_len: len + n,
        sparse: Some(SparseConfig {
            budget: 32,
            page_size: 8,
        }),
        ..Default::default()
    };
    let verified = SessionConfig {
        offload: Some(offload.clone()),
        sparse_verify: Some(3),
        ..base.clone()
    };
    let run = |cfg: SessionConfig| {
        let mut s = Session::new(model.clone(), cfg).unwrap();
        s.generate(&prompt, &greedy(n), &mut |_| Ok(())).unwrap()
    };
    let (want, got) = (run(base.clone()), run(verified.clone()));
    assert_eq!(got.token_ids, want.token_ids);
    assert_eq!(bits(&got.logprobs), bits(&want.logprobs));
    let v = got.verified.expect("the session verified");
    assert!(v.rounds > 0 && v.drafted > 0, "{v:?}");
    // Sampled (speculative sampling, `engine::verified`'s tests check its distribution):
    // a seed repeats its tokens, and the run goes the whole length.
    let mut sampled = greedy(n);
    sampled.sampling = strata::engine::SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.95,
        seed: 3,
    };
    let mut s = Session::new(model.clone(), verified.clone()).unwrap();
    let [a, b] = [(); 2].map(|_| s.generate(&prompt, &sampled, &mut |_| Ok(())).unwrap());
    assert_eq!(a.token_ids, b.token_ids);
    assert_eq!(a.token_ids.len(), n);
    // Without sparse decode there is nothing to verify; the profiler's range counts plain
    // decode steps.
    for (cfg, expect) in [
        (
            SessionConfig {
                offload: Some(OffloadConfig {
                    sparse: None,
                    ..offload
                }),
                ..verified.clone()
            },
            "add --enable-offload and --sparse-budget",
        ),
        (
            SessionConfig {
                device: DeviceKind::Cuda,
                kv_dtype: KvDtype::Bf16,
                profile: Some(ProfileSteps { start: 0, end: 2 }),
                ..verified
            },
            "profile without --sparse-verify",
        ),
    ] {
        let err = cfg.plan(&model.cfg).unwrap_err().to_string();
        assert!(err.contains(expect), "{err}");
    }
}
