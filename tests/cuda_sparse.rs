//! Sparse decode on the CUDA model, run by the kernel emulator with the offload engine on
//! the CPU device in bf16 (its copy streams on threads): gpu-check step 3's sparse rows
//! (budget ≥ context = full offload bit for bit; a small budget unchanged under the
//! sanitizer), and a small budget's logits at every step bit for bit against a resident
//! oracle that attends exactly the pages the host references choose. The kernels
//! themselves (`kernels/sparse.cu`) are checked against those references in
//! tests/kernel_emulator.rs.

mod common;

use std::sync::Arc;

use common::sparse_oracle::Oracle;
use half::bf16;
use strata::device::cuda::exec::Exec;
use strata::gpucheck::emu::{emulator_offload_engine, EmuExec};
use strata::gpucheck::kernels::format_table;
use strata::gpucheck::model_checks::sparse_case;
use strata::kv::KvCache;
use strata::model::cuda::weights::CudaWeights;
use strata::model::cuda::CudaModel;
use strata::model::random::{random_weights, Shape};
use strata::model::Model;
use strata::offload::OffloadConfig;
use strata::sparse::SparseConfig;

fn emu_exec() -> Arc<dyn Exec> {
    Arc::new(EmuExec::new().unwrap())
}

#[test]
fn sparse_rows_of_gpu_check_step_3_pass_on_the_emulator() {
    let mut deep = Shape::tiny();
    deep.layers = 6;
    let mut rows = Vec::new();
    // Gemma 3: the full layer selects pages, the windowed ones attend their 24 tokens.
    for (name, shape) in [
        ("tiny", Shape::tiny()),
        ("tiny, 6 layers", deep),
        ("tiny gemma3, window 24", Shape::tiny_gemma3(24)),
    ] {
        let engine = emulator_offload_engine;
        rows.extend(sparse_case(emu_exec(), &engine, name, shape).unwrap());
    }
    eprint!("{}", format_table(&rows));
    assert_eq!(rows.len(), 9);
    let failed: Vec<_> = rows.iter().filter(|r| !r.pass).collect();
    assert!(failed.is_empty(), "failed: {failed:#?}");
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decode of `prompt` for `n` tokens through `kv`: every step's logits.
fn logits_per_step(
    gpu: &mut CudaModel,
    kv: &mut dyn KvCache<bf16>,
    prompt: &[u32],
    n: usize,
) -> Vec<Vec<f32>> {
    kv.reset().unwrap();
    let mut out = vec![gpu.forward(prompt, 0, kv).unwrap()];
    for i in 0..n {
        let next = argmax(out.last().unwrap());
        out.push(gpu.forward(&[next], prompt.len() + i, kv).unwrap());
    }
    out
}

#[test]
fn small_budget_on_the_cuda_model_attends_exactly_the_oracles_rows() {
    let shape = Shape {
        layers: 3,
        ..Shape::tiny()
    };
    let c = shape.config();
    let model = Model::new(c.clone(), random_weights(&c, 5, 2.0));
    let exec = emu_exec();
    let w = CudaWeights::from_model(&*exec, &model).unwrap();
    let (prompt_len, n, cap) = (90, 30, 128);
    let mut gpu = CudaModel::new(exec, c.clone(), w, cap).unwrap();
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|i| (i * 37 % c.vocab_size) as u32)
        .collect();
    for (nb, bs, page, budget) in [(2, 16, 8, 48), (3, 32, 4, 56)] {
        let sc = SparseConfig {
            budget,
            page_size: page,
        };
        let cfg = OffloadConfig {
            num_kv_buffers: nb,
            block_size: bs,
            max_model_len: cap,
            sparse: Some(sc),
            ..Default::default()
        };
        let mut engine = emulator_offload_engine(&c, cfg).unwrap();
        let got = logits_per_step(&mut gpu, &mut *engine, &prompt, n);
        let st = engine.sparse_stats().unwrap();
        assert!(st.selections > 0 && st.miss_pages > 0, "{st:?}");
        let mut oracle = Oracle::<bf16>::new(&c, sc, bs, cap);
        let want = logits_per_step(&mut gpu, &mut oracle, &prompt, n);
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "ring {nb} block {bs} page {page}: step {step} differs"
            );
        }
    }
}

/// `needle --device cuda --enable-offload --sparse-budget`'s path on the emulator with
/// SmolLM2: a 384-token haystack (short: the emulator is slow), a 192-token budget (sink
/// page, window, best pages: half the context; at 96 tokens this 135M model loses the
/// needle on the CPU device too), the needle found; verified, the resident run's bits.
#[test]
fn needle_with_a_sparse_budget_on_the_emulated_cuda_model() {
    use strata::device::DeviceKind;
    use strata::engine::{GenerateOptions, SamplingParams};
    use strata::needle::{answer_found, Case, NeedleKind};
    use strata::{Session, SessionConfig};

    let path = common::require_default_model();
    let (model, tok) = strata::model::Model::load(&path, false).unwrap();
    let case = Case {
        input_len: 384,
        depth: 0.5,
        kind: NeedleKind::MagicNumber,
        seed: 0,
    };
    let prompt = case.build(&tok).unwrap();
    let max_len = 384 + 32;
    let cfg = SessionConfig {
        offload: Some(OffloadConfig {
            num_kv_buffers: 4,
            block_size: 32,
            max_model_len: max_len,
            sparse: Some(SparseConfig {
                budget: 192,
                page_size: 16,
            }),
            ..Default::default()
        }),
        ..SessionConfig::new(DeviceKind::Cuda, max_len)
    };
    let engine = emulator_offload_engine;
    let mut s = Session::on_exec(model.clone(), cfg.clone(), emu_exec(), &engine).unwrap();
    let opts = GenerateOptions {
        max_tokens: 16,
        sampling: SamplingParams::default(),
        stop_ids: model.cfg.eos_token_ids.clone(),
    };
    let out = s.generate(&prompt.ids, &opts, &mut |_| Ok(())).unwrap();
    let st = s.sparse_stats().unwrap();
    assert!(st.selections > 0, "{st:?}");
    let text = tok.decode(&out.token_ids, true).unwrap();
    eprintln!("answer: {text:?} (value {}), {st:?}", prompt.value);
    assert!(
        answer_found(&text, &prompt.value),
        "{text:?} lacks {}",
        prompt.value
    );
    // Verified (`--sparse-verify 4`) on the real weights: the resident run's tokens and
    // log-probs, bit for bit, with most drafts kept (as on the CPU device).
    let verified = SessionConfig {
        sparse_verify: Some(4),
        ..cfg
    };
    let mut s = Session::on_exec(model.clone(), verified, emu_exec(), &engine).unwrap();
    let got = s.generate(&prompt.ids, &opts, &mut |_| Ok(())).unwrap();
    let want = s
        .generate_resident(&prompt.ids, &opts, &mut |_| Ok(()))
        .unwrap();
    assert_eq!(got.token_ids, want.token_ids);
    assert_eq!(common::bits(&got.logprobs), common::bits(&want.logprobs));
    let v = got.verified.expect("verified stats");
    eprintln!("verified: {v:?}");
    assert!(v.acceptance() > 0.5, "{v:?}");
}

/// `--device cuda --sparse-verify` on the emulator: the verified session's greedy output
/// is the plain (resident, one token a step) CUDA run's, tokens and log-probs bit for bit,
/// across ring, block, page and draft sizes, while unverified sparse decode differs on
/// some case and drafts are rejected (so the verify step is what keeps it). The emulated
/// GEMM rounds a row inside a taller GEMM otherwise than alone, as cuBLAS may: the verify
/// step must run each row as a one-token step (`CudaModel::forward_rows`).
#[test]
fn verified_sparse_decode_on_the_emulated_cuda_model_is_bitwise_the_plain_run() {
    use rand::{rngs::StdRng, SeedableRng};
    use strata::device::DeviceKind;
    use strata::{Session, SessionConfig};

    let shape = Shape {
        layers: 3,
        ..Shape::tiny()
    };
    let c = shape.config();
    let model = Arc::new(Model::new(c.clone(), random_weights(&c, 7, 2.0)));
    let mut rng = StdRng::seed_from_u64(17);
    let (n, cap) = (24, 128);
    let (mut rejected, mut sparse_differs) = (0, 0);
    // (ring slots, block, page, budget, drafts, prompt length)
    for (nb, bs, page, budget, k, len) in [
        (2, 16, 8, 32, 4, 90),
        (3, 8, 4, 24, 3, 70),
        (4, 4, 4, 16, 6, 41),
    ] {
        let prompt = common::random_prompt(&mut rng, len, c.vocab_size);
        let session = |verify: Option<usize>| {
            let offload = OffloadConfig {
                num_kv_buffers: nb,
                block_size: bs,
                max_model_len: cap,
                sparse: Some(SparseConfig {
                    budget,
                    page_size: page,
                }),
                ..Default::default()
            };
            let cfg = SessionConfig {
                offload: Some(offload),
                sparse_verify: verify,
                ..SessionConfig::new(DeviceKind::Cuda, cap)
            };
            let engine = emulator_offload_engine;
            Session::on_exec(model.clone(), cfg, emu_exec(), &engine).unwrap()
        };
        let ctx = format!("ring {nb}, block {bs}, page {page}, budget {budget}, {k} drafts");
        let opts = common::greedy(n);
        let mut s = session(Some(k));
        let got = s.generate(&prompt, &opts, &mut |_| Ok(())).unwrap();
        let want = s
            .generate_resident(&prompt, &opts, &mut |_| Ok(()))
            .unwrap();
        assert_eq!(got.token_ids, want.token_ids, "{ctx}");
        assert_eq!(
            common::bits(&got.logprobs),
            common::bits(&want.logprobs),
            "{ctx}"
        );
        let v = got.verified.expect("verified stats");
        assert!(v.rounds > 0 && v.drafted >= v.rounds, "{ctx}: {v:?}");
        rejected += v.drafted - v.accepted;
        let sparse = session(None)
            .generate(&prompt, &opts, &mut |_| Ok(()))
            .unwrap();
        sparse_differs += usize::from(sparse.token_ids != want.token_ids);
        eprintln!(
            "{ctx}: {v:?}, sparse alone differs: {}",
            sparse.token_ids != want.token_ids
        );
    }
    assert!(
        rejected > 0,
        "no draft was rejected: the cases test nothing"
    );
    assert!(sparse_differs > 0, "sparse decode alone matched every case");
}
