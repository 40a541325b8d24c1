//! The serving path on the CUDA model, run by the kernel emulator: the batched forward over
//! a page pool is batch-invariant (a sequence's logits are bitwise the same alone, inside
//! batches of 2…16 with random companions, and however its prompt was chunked) and close
//! to the f32 CPU model; the serving engine on it keeps tokens and log-probs bitwise under
//! preemption with host offload and with recomputation, and its greedy tokens equal the
//! CPU engine's.

mod common;

use std::sync::Arc;

use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::device::cuda::exec::Exec;
use strata::device::cuda::model::CudaModel;
use strata::device::cuda::weights::CudaWeights;
use strata::gpucheck::emu::{emulator_serve_engine, EmuExec};
use strata::gpucheck::model_checks::logits_error;
use strata::kv::ContiguousKv;
use strata::model::random::{random_weights, Shape};
use strata::model::{BatchSeq, Model, WantLogits};
use strata::offload::CpuOffloadDevice;
use strata::serve::device_pages::DevicePages;
use strata::serve::{Engine, EngineConfig, RequestParams, SchedulerConfig};

const BLOCK: usize = 4;

fn tiny() -> Arc<Model> {
    let cfg = Shape::tiny().config();
    Arc::new(Model::new(cfg.clone(), random_weights(&cfg, 11, 1.0)))
}

fn cuda_model(model: &Model, max_pos: usize) -> CudaModel {
    let exec: Arc<dyn Exec> = Arc::new(EmuExec::new().unwrap());
    let w = CudaWeights::from_model(&*exec, model).unwrap();
    CudaModel::new(exec, model.cfg.clone(), w, max_pos).unwrap()
}

type Pool = DevicePages<CpuOffloadDevice<bf16>>;

fn pool(model: &Model, pages: usize) -> Pool {
    let c = &model.cfg;
    let d = CpuOffloadDevice::<bf16>::new(0.0, false, 1);
    DevicePages::new(d, c.num_layers, c.kv_dim(), BLOCK, pages, 0).unwrap()
}

/// A sequence being run: its tokens so far and its pages.
struct Seq {
    tokens: Vec<u32>,
    done: usize, // tokens whose K/V is stored
    pages: Vec<u32>,
}

impl Seq {
    fn new(tokens: Vec<u32>, first_page: u32, max_len: usize) -> Self {
        let n = max_len.div_ceil(BLOCK) as u32;
        Self {
            tokens,
            done: 0,
            pages: (first_page..first_page + n).rev().collect(), // scattered: descending
        }
    }

    /// The next call: up to `chunk` of the tokens not yet computed.
    fn call(&self, chunk: usize) -> BatchSeq<'_> {
        let end = (self.done + chunk).min(self.tokens.len());
        BatchSeq {
            tokens: &self.tokens[self.done..end],
            pos0: self.done,
            pages: &self.pages[..end.div_ceil(BLOCK)],
            logits: if end == self.tokens.len() {
                WantLogits::Yes
            } else {
                WantLogits::No
            },
        }
    }
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

/// Runs sequence 0 (the subject) to `steps` new tokens, greedy, with `companions` random
/// others in every step (random chunks, random lengths), the subject's prompt in chunks of
/// `chunk`; returns the subject's logits at each step where it sampled.
fn subject_logits(
    gpu: &mut CudaModel,
    prompt: &[u32],
    steps: usize,
    companions: usize,
    chunk: usize,
    rng: &mut StdRng,
) -> Vec<Vec<f32>> {
    let iters = prompt.len().div_ceil(chunk) + steps;
    let per_seq = (prompt.len().max(40) + iters).div_ceil(BLOCK) + 1;
    let mut pool = pool(&tiny(), per_seq * (companions + 1));
    let mut seqs = vec![Seq::new(prompt.to_vec(), 0, prompt.len() + steps)];
    for i in 0..companions {
        let len = rng.random_range(1..40);
        let toks = (0..len).map(|_| rng.random_range(0..512)).collect();
        let first = ((i + 1) * per_seq) as u32;
        seqs.push(Seq::new(toks, first, len + iters));
    }
    let mut out = Vec::new();
    while out.len() < steps {
        let calls: Vec<BatchSeq<'_>> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.call(if i == 0 {
                    chunk
                } else {
                    rng.random_range(1..9)
                })
            })
            .collect();
        let lens: Vec<usize> = calls.iter().map(|c| c.tokens.len()).collect();
        let logits = gpu.forward_batch(&calls, &mut pool).unwrap();
        for (i, (n, l)) in lens.into_iter().zip(logits).enumerate() {
            seqs[i].done += n;
            if let Some(l) = l {
                seqs[i].tokens.push(argmax(&l));
                if i == 0 {
                    out.push(l);
                }
            }
        }
    }
    out
}

#[test]
fn batched_forward_is_batch_invariant_and_matches_the_cpu_model() {
    let model = tiny();
    let mut gpu = cuda_model(&model, 4096);
    let mut rng = StdRng::seed_from_u64(3);
    let prompt: Vec<u32> = (0..37).map(|_| rng.random_range(0..512)).collect();
    let steps = 4;
    let alone = subject_logits(&mut gpu, &prompt, steps, 0, prompt.len(), &mut rng);

    // Close to the f32 CPU model on the same tokens (bf16 weights and activations).
    let mut tokens = prompt.clone();
    tokens.extend(alone.iter().take(steps - 1).map(|l| argmax(l)));
    let c = &model.cfg;
    let mut kv = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, 4096);
    let mut want = vec![model.forward(&prompt, 0, &mut kv).unwrap()];
    for p in prompt.len()..tokens.len() {
        want.push(model.forward(&tokens[p..p + 1], p, &mut kv).unwrap());
    }
    for (step, (g, w)) in alone.iter().zip(&want).enumerate() {
        let (rms, max) = logits_error(g, w);
        assert!(
            rms < 0.03 && max < 0.05,
            "step {step}: rel rms {rms}, rel max {max}"
        );
    }

    // Bitwise the same inside batches of 2…16 and with the prompt chunked differently.
    for (companions, chunk) in [(1, 37), (3, 5), (7, 8), (15, 16), (0, 1)] {
        let got = subject_logits(&mut gpu, &prompt, steps, companions, chunk, &mut rng);
        for (step, (g, a)) in got.iter().zip(&alone).enumerate() {
            let same = g.iter().zip(a).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{companions} companions, chunks of {chunk}: step {step} logits differ from alone"
            );
        }
    }
}

fn config(gpu: usize, cpu: usize, sanitize: bool) -> EngineConfig {
    EngineConfig {
        sched: SchedulerConfig {
            block_size: BLOCK,
            num_gpu_blocks: gpu,
            max_cpu_offload_blocks: cpu,
            max_disk_offload_blocks: 0,
            max_num_seqs: 16,
            max_num_batched_tokens: 16,
            prefill_chunk: 8,
        },
        link_gbps: 0.0,
        sanitize,
        disk: None,
    }
}

type Outputs = Vec<(Vec<u32>, Vec<f32>)>;

fn run(e: &mut Engine, prompts: &[Vec<u32>], params: &[RequestParams]) -> Outputs {
    e.generate_with_logprobs(prompts, params).unwrap()
}

#[test]
fn serving_engine_on_the_emulator_is_bitwise_under_preemption_and_matches_the_cpu_engine() {
    let model = tiny();
    let (prompts, params) = common::serve_requests(21, 8, 0);
    let ws: usize = prompts
        .iter()
        .zip(&params)
        .map(|(p, r)| (p.len() + r.max_tokens).div_ceil(BLOCK))
        .sum();
    let mut free = emulator_serve_engine(&model, &config(ws, 0, false)).unwrap();
    let want = run(&mut free, &prompts, &params);
    assert_eq!(free.stats().sched.preemptions, 0);

    // A third of the working set: preemption with host offload (sanitized copies) and with
    // recomputation; tokens and log-probs bit for bit.
    for (cpu, sanitize) in [(1000, true), (0, false)] {
        let mut e = emulator_serve_engine(&model, &config(ws / 3, cpu, sanitize)).unwrap();
        let got = run(&mut e, &prompts, &params);
        let st = e.stats().sched;
        assert!(st.preemptions >= 3, "cpu {cpu}: {st:?}");
        if cpu > 0 {
            assert!(st.blocks_stored > 0 && st.blocks_loaded > 0, "{st:?}");
        }
        assert_eq!(
            got, want,
            "cpu blocks {cpu}: outputs differ from the unconstrained run"
        );
    }

    // The same greedy tokens as the CPU engine (f32 weights and KV; this model's top-2
    // margins are wide enough for bf16 not to reorder them).
    let mut cpu = Engine::new(model.clone(), config(ws, 0, false)).unwrap();
    let cpu_out = run(&mut cpu, &prompts, &params);
    let mut compared = 0;
    for (i, ((g, _), (w, _))) in want.iter().zip(&cpu_out).enumerate() {
        let same = g.iter().zip(w).take_while(|(a, b)| a == b).count();
        compared += same;
        eprintln!("request {i}: {same} of {} tokens equal", w.len());
    }
    let total: usize = cpu_out.iter().map(|(t, _)| t.len()).sum();
    assert!(
        compared == total,
        "{compared} of {total} greedy tokens equal the CPU engine's"
    );
}
