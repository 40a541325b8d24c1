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
    for (name, shape) in [("tiny", Shape::tiny()), ("tiny, 6 layers", deep)] {
        let engine = emulator_offload_engine;
        rows.extend(sparse_case(emu_exec(), &engine, name, shape).unwrap());
    }
    eprint!("{}", format_table(&rows));
    assert_eq!(rows.len(), 4);
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
/// needle on the CPU device too), the needle found.
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
    let mut s = Session::on_exec(model.clone(), cfg, emu_exec(), &engine).unwrap();
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
}
