//! Batch invariance of the batched forward: a sequence's logits are bitwise those of the
//! plain contiguous-cache run (`strata generate`'s forward, whole prompt at once), whatever
//! it is batched with, however its prompt is chunked and wherever its pages are; in every
//! KV element (a 16-bit cache against the contiguous run of the same element).

mod common;

use std::sync::Arc;

use common::{scratch_dir, TinySpec};
use rand::seq::SliceRandom;
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::device::kv_elem::{bf16, f16};
use strata::device::{DevPtr, KvElem};
use strata::kv::{ContiguousKv, KvCache, LayerSlot, RecurrentStates};
use strata::model::{BatchSeq, Model, PagePool, WantLogits};

const BLOCK: usize = 4;

/// A host page pool for the test: `[layers] × [pages, BLOCK, kv_dim]` for K and V, in
/// elements `T`, NaN where nothing was stored.
struct Pool<T> {
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
    pages: usize,
    /// A state-layer model's recurrent states, one slot per sequence of the run.
    states: RecurrentStates,
}

impl<T: KvElem> Pool<T> {
    fn new(model: &Model, pages: usize) -> Self {
        let n = pages * BLOCK * model.cfg.kv_dim();
        let nan = T::from_f32(f32::NAN);
        Self {
            k: vec![vec![nan; n]; model.cfg.num_layers],
            v: vec![vec![nan; n]; model.cfg.num_layers],
            pages,
            states: RecurrentStates::for_model(&model.cfg),
        }
    }
}

// SAFETY: the pool's memory is its own and this test's thread the only one touching it.
unsafe impl<T: KvElem> KvCache<T> for Pool<T> {
    fn reset(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
    fn capacity(&self) -> usize {
        self.pages * BLOCK
    }
    fn begin_step(&mut self, _pos0: usize, _tokens: usize) -> anyhow::Result<()> {
        Ok(())
    }
    fn begin_layer(&mut self, layer: usize) -> anyhow::Result<LayerSlot<T>> {
        let ptr = |b: &mut Vec<T>| DevPtr::from_addr(b.as_mut_ptr() as u64);
        Ok(LayerSlot {
            k: ptr(&mut self.k[layer]),
            v: ptr(&mut self.v[layer]),
            rows: self.pages * BLOCK,
            ring: false,
        })
    }
    fn end_layer(&mut self, _layer: usize) -> anyhow::Result<()> {
        Ok(())
    }
    fn layer_state(&mut self, layer: usize, slot: usize) -> anyhow::Result<strata::kv::StateSlot> {
        self.states.layer(layer, slot)
    }
    fn begin_state(&mut self, slot: usize, pos0: usize, tokens: usize) -> anyhow::Result<()> {
        self.states.begin_step(slot, pos0, tokens)
    }
}

impl<T: KvElem> PagePool<T> for Pool<T> {
    fn block_size(&self) -> usize {
        BLOCK
    }
    fn num_pages(&self) -> usize {
        self.pages
    }
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// The reference: the whole prompt in one contiguous-cache forward, then one decode
/// forward per token (greedy). Returns the tokens fed after the prompt and the logits of
/// the prompt's last token and of every decoded token.
fn reference<T: KvElem>(
    model: &Arc<Model>,
    prompt: &[u32],
    steps: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let c = &model.cfg;
    let mut kv = ContiguousKv::<T>::plain(c, 4096);
    let mut logits = vec![model.forward(prompt, 0, &mut kv).unwrap()];
    let mut fed = Vec::new();
    for _ in 0..steps {
        let t = argmax(logits.last().unwrap());
        fed.push(t);
        let pos = prompt.len() + fed.len() - 1;
        logits.push(model.forward(&[t], pos, &mut kv).unwrap());
    }
    (fed, logits)
}

/// One sequence of the simulated serving run: its tokens (prompt, then what it decodes),
/// where its prompt is cut into chunks, its pages, and what it has computed.
struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    cuts: Vec<usize>, // chunk ends, increasing, the last = prompt_len
    pages: Vec<u32>,
    done: usize,           // positions computed
    steps: usize,          // decode steps to run
    start: usize,          // engine step at which it joins
    logits: Vec<Vec<f32>>, // of the prompt's last token and of every decoded token
}

impl Seq {
    fn new(rng: &mut StdRng, prompt: Vec<u32>, steps: usize, start: usize) -> Self {
        let mut cuts: Vec<usize> = (1..prompt.len())
            .filter(|_| rng.random_bool(0.15))
            .collect();
        cuts.push(prompt.len());
        Self {
            prompt_len: prompt.len(),
            tokens: prompt,
            cuts,
            pages: Vec::new(),
            done: 0,
            steps,
            start,
            logits: Vec::new(),
        }
    }

    fn finished(&self) -> bool {
        self.done == self.prompt_len + self.steps
    }

    /// The positions it computes this step: the next prompt chunk or one decode token.
    fn next(&self) -> std::ops::Range<usize> {
        if self.done < self.prompt_len {
            let end = *self.cuts.iter().find(|&&c| c > self.done).unwrap();
            self.done..end
        } else {
            self.done..self.done + 1
        }
    }
}

/// Runs `seqs` as a continuous-batching engine would: each step, one batched forward over
/// every joined unfinished sequence; pages are drawn at random from a shuffled free list.
fn serve<T: KvElem>(model: &Model, seqs: &mut [Seq], rng: &mut StdRng) {
    let mut pool = Pool::<T>::new(model, 1024);
    let mut free: Vec<u32> = (0..1024).collect();
    free.shuffle(rng);
    let mut step = 0;
    while seqs.iter().any(|s| !s.finished()) {
        let active: Vec<usize> = (0..seqs.len())
            .filter(|&i| seqs[i].start <= step && !seqs[i].finished())
            .collect();
        step += 1;
        if active.is_empty() {
            continue;
        }
        let ranges: Vec<_> = active.iter().map(|&i| seqs[i].next()).collect();
        for (&i, r) in active.iter().zip(&ranges) {
            let s = &mut seqs[i];
            while s.pages.len() * BLOCK < r.end {
                s.pages.push(free.pop().expect("pool too small"));
            }
        }
        let batch: Vec<BatchSeq> = active
            .iter()
            .zip(&ranges)
            .map(|(&i, r)| BatchSeq {
                tokens: &seqs[i].tokens[r.clone()],
                pos0: r.start,
                pages: &seqs[i].pages,
                window_pages: &[],
                logits: if r.end >= seqs[i].prompt_len {
                    WantLogits::Last
                } else {
                    WantLogits::No
                },
                state_slot: i,
            })
            .collect();
        let out = model.forward_batch(&batch, &mut pool).unwrap();
        for ((&i, r), logits) in active.iter().zip(ranges).zip(out) {
            let s = &mut seqs[i];
            s.done = r.end;
            if let Some(l) = logits {
                let t = argmax(&l);
                s.logits.push(l);
                if s.tokens.len() < s.prompt_len + s.steps {
                    s.tokens.push(t);
                }
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn check_family(spec: TinySpec, name: &str) {
    let dir = scratch_dir(name);
    spec.write(&dir, 13);
    check_model::<f32>(&Model::load(&dir, false).unwrap().0, name);
}

/// Batches of 1 to 16 against the contiguous run, the KV in elements `T`.
fn check_model<T: KvElem>(model: &Arc<Model>, name: &str) {
    let vocab = model.cfg.vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(42);
    // Long enough to cross the attention's fixed 512-key partitions.
    let prompt: Vec<u32> = (0..530).map(|_| rng.random_range(3..vocab)).collect();
    let steps = 12;
    let (want_fed, want) = reference::<T>(model, &prompt, steps);
    for n in 1..=16 {
        let start = rng.random_range(0..3);
        let mut seqs = vec![Seq::new(&mut rng, prompt.clone(), steps, start)];
        for _ in 1..n {
            let len = rng.random_range(1..90);
            let p: Vec<u32> = (0..len).map(|_| rng.random_range(3..vocab)).collect();
            let (steps, start) = (rng.random_range(0..20), rng.random_range(0..8));
            seqs.push(Seq::new(&mut rng, p, steps, start));
        }
        seqs.shuffle(&mut rng);
        serve::<T>(model, &mut seqs, &mut rng);
        let target = seqs
            .iter()
            .find(|s| s.prompt_len == prompt.len() && s.tokens[..prompt.len()] == prompt[..])
            .unwrap();
        assert_eq!(target.tokens[prompt.len()..], want_fed[..], "batch of {n}");
        assert_eq!(target.logits.len(), want.len());
        for (i, (g, w)) in target.logits.iter().zip(&want).enumerate() {
            assert!(
                bits(g) == bits(w),
                "{name}: batch of {n}, step {i}: logits differ from the contiguous run"
            );
        }
        // Every companion is exact too.
        for s in &seqs {
            let (fed, logits) = reference::<T>(model, &s.tokens[..s.prompt_len], s.steps);
            assert_eq!(s.tokens[s.prompt_len..], fed[..s.steps]);
            for (g, w) in s.logits.iter().zip(&logits) {
                assert!(
                    bits(g) == bits(w),
                    "{name}: batch of {n}: a companion differs"
                );
            }
        }
    }
}

#[test]
fn a_sequences_logits_are_bitwise_equal_alone_and_in_batches_of_1_to_16_llama() {
    check_family(TinySpec::llama(), "batch_invariance_llama");
}

#[test]
fn a_sequences_logits_are_bitwise_equal_alone_and_in_batches_of_1_to_16_qwen3() {
    check_family(TinySpec::qwen3(), "batch_invariance_qwen3");
}

/// The same in the stored-precision mode (the default) on a GGUF whose matrices are Q4_1
/// and Q8_0 blocks: dequantization happens per weight tile, never per batch.
#[test]
fn a_sequences_logits_are_bitwise_equal_alone_and_in_batches_of_1_to_16_q4_1_gguf() {
    let model = q4_1_gguf(TinySpec::llama(), "batch_invariance_q4_1");
    assert!(model.weights.describe().contains("Q4_1"));
    check_model::<f32>(&model, "batch_invariance_q4_1");
}

/// `spec` written as a GGUF of Q4_1 matrices (Q8_0 for k_proj and down), loaded as stored.
fn q4_1_gguf(spec: TinySpec, name: &str) -> Arc<Model> {
    use candle_core::quantized::GgmlDType;
    let dir = scratch_dir(name);
    let w = spec.write(&dir, 13);
    let path = dir.join("model.gguf");
    let dtype_of = |n: &str| match () {
        _ if n.ends_with("norm.weight") => GgmlDType::F32,
        _ if n.contains("k_proj") || n.contains("down") => GgmlDType::Q8_0,
        _ => GgmlDType::Q4_1,
    };
    common::gguf::write_gguf_as(&spec, &w, &path, "llama-bpe", &dtype_of);
    Model::load(&path, false).unwrap().0
}

/// The same in the q8 mode (8-bit activations, integer dots; not bitwise the stored
/// mode, but batch-invariant): Q4_0, Q4_1 and Q8_0 matrices, each row quantised alone.
#[test]
fn a_sequences_logits_are_bitwise_equal_alone_and_in_batches_of_1_to_16_q8_mode() {
    use candle_core::quantized::GgmlDType;
    use strata::model::weights::WeightDtype;
    let spec = TinySpec::llama();
    let dir = scratch_dir("batch_invariance_q8");
    let w = spec.write(&dir, 13);
    let path = dir.join("model.gguf");
    let dtype_of = |n: &str| match () {
        _ if n.ends_with("norm.weight") => GgmlDType::F32,
        _ if n.contains("k_proj") || n.contains("down") => GgmlDType::Q8_0,
        _ if n.contains("q_proj") || n.contains("up") => GgmlDType::Q4_0,
        _ => GgmlDType::Q4_1,
    };
    common::gguf::write_gguf_as(&spec, &w, &path, "llama-bpe", &dtype_of);
    let model = Model::load_as(&path, false, WeightDtype::Q8).unwrap().0;
    assert!(model.weights.describe().contains("Q4_0"));
    check_model::<f32>(&model, "batch_invariance_q8");
}

/// The same with a bf16 and an f16 KV cache (the 16-bit kernels widen in registers, with
/// the f32 cache's reduction order), on the Q4_1/Q8_0 GGUF of the default mode, its head
/// dim a real model's (64: the kernels' full-register paths).
#[test]
fn a_sequences_logits_are_bitwise_equal_alone_and_in_batches_of_1_to_16_16_bit_kv() {
    let model = q4_1_gguf(TinySpec::llama_wide(), "batch_invariance_kv16");
    check_model::<bf16>(&model, "batch_invariance_bf16_kv");
    check_model::<f16>(&model, "batch_invariance_f16_kv");
}

#[test]
fn a_batch_with_a_bad_page_table_is_an_error_not_a_panic() {
    let dir = scratch_dir("batch_invariance_errors");
    TinySpec::llama().write(&dir, 1);
    let model = Model::load(&dir, false).unwrap().0;
    let mut pool = Pool::<f32>::new(&model, 4);
    let seq = |tokens: &'static [u32], pos0, pages: &'static [u32]| BatchSeq {
        tokens,
        pos0,
        pages,
        window_pages: &[],
        logits: WantLogits::Last,
        state_slot: 0,
    };
    // Too few pages for the positions, a page outside the pool, no tokens, a bad token.
    for bad in [
        seq(&[1, 2, 3, 4, 5], 0, &[0]),
        seq(&[1], 0, &[9]),
        seq(&[], 0, &[0]),
        seq(&[100_000], 0, &[0]),
    ] {
        assert!(model.forward_batch(&[bad], &mut pool).is_err());
    }
    assert!(model.forward_batch(&[], &mut pool).is_err());
}

/// The same for gpt-oss (transformers' tiny random checkpoint): attention sinks, windowed
/// layers, and experts — each expert runs over whichever rows chose it, so the batch
/// changes which rows share an expert's call, never a row's bits.
#[test]
fn a_sequences_logits_are_bitwise_equal_alone_and_in_batches_of_1_to_16_gpt_oss() {
    let model = common::tiny_gpt_oss("batch_invariance_gpt_oss");
    check_model::<f32>(&model, "batch_invariance_gpt_oss");
}

/// The same for Qwen3.5, dense and MoE (transformers' tiny random checkpoints): each
/// sequence's state layers run its rows in order over its own recurrent-state slot, and
/// the MoE's experts and shared expert run per row, so what else is in the batch, and
/// where its prompt is cut, never changes its bits.
#[test]
fn a_sequences_logits_are_bitwise_equal_alone_and_in_batches_of_1_to_16_qwen35() {
    let model = common::tiny_qwen35("batch_invariance_qwen35");
    check_model::<f32>(&model, "batch_invariance_qwen35");
    let moe = common::tiny_qwen35_moe("batch_invariance_qwen35_moe");
    check_model::<f32>(&moe, "batch_invariance_qwen35_moe");
}
