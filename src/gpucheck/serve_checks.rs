//! Step 6 of `scripts/gpu-check.sh`: the serving path on the CUDA model, on the GPU or on
//! the kernel emulator (tests/cuda_serve.rs).
//!
//! - `batch_invariance_case`: one sequence's logits through `CudaModel::forward_batch`
//!   alone, then inside batches of 2…16 random companions and with its prompt chunked
//!   differently: bitwise equal at every step; and close to the f32 CPU model (step 2's
//!   tolerances).
//! - `serve_case`: the serving engine with GPU blocks at a third of the working set, with
//!   host offload and with recomputation: tokens and log-probs bitwise equal to the
//!   unconstrained run; greedy tokens equal to the CPU engine's.
//! - `disk_case`: the same with a two-block host tier over a disk tier: spills and loads
//!   bitwise; a new engine on the directory reuses the persisted prefix blocks, bitwise;
//!   after every slot's payload is corrupted, none is used and the tokens still match.
//! - `prompt_logprobs_case`: prompt log-probabilities (every prompt row's logits) bitwise
//!   those of one-row twins ending at each probed row, and batched = alone.

use std::sync::Arc;

use anyhow::Result;
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::kernels::CheckRow;
use super::model_checks::logits_error;
use crate::device::cuda::context::CudaDevice;
use crate::device::cuda::exec::{alloc, Buf, CudaExec, Exec};
use crate::device::DevPtr;
use crate::device::KvDtype;
use crate::engine::sampler::argmax;
use crate::kv::state::{ExecMemory, RecurrentStates, StateSlot};
use crate::kv::{ContiguousKv, KvCache, LayerSlot};
use crate::model::cuda::weights::CudaWeights;
use crate::model::cuda::CudaModel;
use crate::model::random::{random_weights, Shape};
use crate::model::{BatchSeq, Model, PagePool, WantLogits};
use crate::serve::{Engine, EngineConfig, RequestParams, SchedulerConfig};

const BLOCK: usize = 4;
const PREFILL_CHUNK: usize = 8;
const RMS_TOL: f32 = 0.03;
const MAX_TOL: f32 = 0.08;

/// Every layer's K and V page pool in `exec`'s memory, `[pages, BLOCK, kv_dim]` bf16 each,
/// and a state-layer model's recurrent states there, by sequence.
struct ExecPool {
    _bufs: Vec<Buf>,
    k: Vec<DevPtr<bf16>>, // [num_layers]
    v: Vec<DevPtr<bf16>>,
    pages: usize,
    states: RecurrentStates,
}

impl ExecPool {
    fn new(exec: &Arc<dyn Exec>, model: &Model, pages: usize) -> Result<Self> {
        let c = &model.cfg;
        let (mut bufs, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..c.num_layers {
            for side in [&mut k, &mut v] {
                let (b, p) = alloc::<bf16>(&**exec, pages * BLOCK * c.kv_dim())?;
                bufs.push(b);
                side.push(p);
            }
        }
        Ok(Self {
            _bufs: bufs,
            k,
            v,
            pages,
            states: RecurrentStates::in_memory(c, Arc::new(ExecMemory(exec.clone()))),
        })
    }
}

// SAFETY: the pools are this check's alone and only the model's stream touches them.
unsafe impl KvCache<bf16> for ExecPool {
    fn reset(&mut self) -> Result<()> {
        Ok(())
    }
    fn capacity(&self) -> usize {
        self.pages * BLOCK
    }
    fn begin_step(&mut self, _pos0: usize, _tokens: usize) -> Result<()> {
        Ok(())
    }
    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot<bf16>> {
        Ok(LayerSlot {
            k: self.k[layer],
            v: self.v[layer],
            rows: self.capacity(),
            ring: false,
        })
    }
    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }
    fn layer_state(&mut self, layer: usize, slot: usize) -> Result<StateSlot> {
        self.states.layer(layer, slot)
    }
    fn begin_state(&mut self, slot: usize, pos0: usize, tokens: usize) -> Result<()> {
        self.states.begin_step(slot, pos0, tokens)
    }
}

impl PagePool<bf16> for ExecPool {
    fn block_size(&self) -> usize {
        BLOCK
    }
    fn num_pages(&self) -> usize {
        self.pages
    }
}

fn random_model(shape: Shape) -> Arc<Model> {
    let cfg = shape.config();
    Arc::new(Model::new(
        cfg.clone(),
        random_weights(&cfg, 11, shape.qk_gain),
    ))
}

/// A sequence being run by hand: its tokens so far, its pages and its state slot.
struct Seq {
    tokens: Vec<u32>,
    done: usize, // tokens whose K/V is stored
    pages: Vec<u32>,
    slot: usize,
}

impl Seq {
    /// Pages `first..first + n` in descending order: scattered, not the identity; state
    /// slot `slot`.
    fn new(tokens: Vec<u32>, first: usize, max_len: usize, slot: usize) -> Self {
        let n = max_len.div_ceil(BLOCK);
        Self {
            tokens,
            done: 0,
            pages: (first as u32..(first + n) as u32).rev().collect(),
            slot,
        }
    }

    /// The next call: up to `chunk` of the tokens not yet computed.
    fn call(&self, chunk: usize) -> BatchSeq<'_> {
        let end = (self.done + chunk).min(self.tokens.len());
        BatchSeq {
            tokens: &self.tokens[self.done..end],
            pos0: self.done,
            pages: &self.pages[..end.div_ceil(BLOCK)],
            window_pages: &[],
            logits: if end == self.tokens.len() {
                WantLogits::Last
            } else {
                WantLogits::No
            },
            state_slot: self.slot,
        }
    }
}

/// Sequence 0 (the subject) run to `steps` new tokens, greedy, its prompt in chunks of
/// `chunk`, with `companions` random others (random lengths, random chunks) in every
/// step; the subject's logits at each step where it sampled.
fn subject_logits(
    gpu: &mut CudaModel,
    model: &Model,
    prompt: &[u32],
    steps: usize,
    (companions, chunk): (usize, usize),
    rng: &mut StdRng,
) -> Result<Vec<Vec<f32>>> {
    let vocab = model.cfg.vocab_size as u32;
    let iters = prompt.len().div_ceil(chunk) + steps;
    let per_seq = (prompt.len().max(40) + iters).div_ceil(BLOCK) + 1;
    let mut pool = ExecPool::new(gpu.exec(), model, per_seq * (companions + 1))?;
    let mut seqs = vec![Seq::new(prompt.to_vec(), 0, prompt.len() + steps, 0)];
    for i in 1..=companions {
        let len = rng.random_range(1..40);
        let toks = (0..len).map(|_| rng.random_range(0..vocab)).collect();
        seqs.push(Seq::new(toks, i * per_seq, len + iters, i));
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
        let logits = gpu.forward_batch(&calls, &mut pool)?;
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
    Ok(out)
}

/// The batched forward's batch invariance and accuracy on one random model (see the
/// module docs).
pub fn batch_invariance_case(exec: Arc<dyn Exec>, name: &str, shape: Shape) -> Result<CheckRow> {
    let model = random_model(shape);
    batch_invariance_case_of(exec, name, &model, Some((RMS_TOL, MAX_TOL)))
}

/// `batch_invariance_case` on a loaded model, close to the CPU model within `tol` (rel
/// rms, rel max; `None`: a checkpoint whose bf16 noise hides faults, whose accuracy is
/// checked block by block instead).
pub fn batch_invariance_case_of(
    exec: Arc<dyn Exec>,
    name: &str,
    model: &Arc<Model>,
    tol: Option<(f32, f32)>,
) -> Result<CheckRow> {
    let c = &model.cfg;
    let w = CudaWeights::from_model(&*exec, model)?;
    let mut gpu = CudaModel::new(exec, c.clone(), w, 1024)?;
    let mut rng = StdRng::seed_from_u64(3);
    let prompt: Vec<u32> = (0..37)
        .map(|_| rng.random_range(0..c.vocab_size as u32))
        .collect();
    let steps = 4;
    let alone = subject_logits(&mut gpu, model, &prompt, steps, (0, 37), &mut rng)?;

    // Close to the f32 CPU model on the same tokens.
    let mut tokens = prompt.clone();
    tokens.extend(alone.iter().take(steps - 1).map(|l| argmax(l)));
    let mut kv = ContiguousKv::<f32>::plain(c, 1024);
    let mut want = vec![model.forward(&prompt, 0, &mut kv)?];
    for p in prompt.len()..tokens.len() {
        want.push(model.forward(&tokens[p..p + 1], p, &mut kv)?);
    }
    let errs: Vec<(f32, f32)> = alone
        .iter()
        .zip(&want)
        .map(|(g, w)| logits_error(g, w))
        .collect();
    let (rms, max) = errs
        .iter()
        .fold((0f32, 0f32), |a, e| (a.0.max(e.0), a.1.max(e.1)));
    let mut note = String::new(); // what failed
    let within = |(r, m): (f32, f32)| errs.iter().all(|e| e.0 <= r && e.1 <= m);
    if tol.is_some_and(|t| !within(t)) {
        note = format!("vs the CPU model: rel rms {rms:.3}, rel max {max:.3}");
    }

    // Bitwise the same inside batches of 2…16 and with the prompt chunked differently.
    for run in [(1, 37), (3, 5), (7, 8), (15, 16), (0, 1)] {
        let got = subject_logits(&mut gpu, model, &prompt, steps, run, &mut rng)?;
        for (step, (g, a)) in got.iter().zip(&alone).enumerate() {
            if !g.iter().zip(a).all(|(x, y)| x.to_bits() == y.to_bits()) {
                note = format!(
                    "{} companions, chunks of {}: step {step} logits differ from alone",
                    run.0, run.1
                );
            }
        }
    }
    let pass = note.is_empty();
    if pass && tol.is_none() {
        note = format!("rel rms vs the CPU model {rms:.3}, not bounded (bf16 noise)");
    }
    Ok(CheckRow {
        name: format!("{name}: batch invariance"),
        shape: format!("37+{steps} tok, batches 1..16"),
        max_abs_err: rms,
        tolerance: match tol {
            Some((rms_tol, _)) => format!("bitwise; rms {rms_tol} vs CPU"),
            None => "bitwise".into(),
        },
        pass,
        note,
    })
}

fn sched(gpu: usize, cpu: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: BLOCK,
        num_gpu_blocks: gpu,
        max_cpu_offload_blocks: cpu,
        max_disk_offload_blocks: 0,
        max_num_seqs: 16,
        max_num_batched_tokens: 16,
        prefill_chunk: PREFILL_CHUNK,
    }
}

/// Eight random requests (prompts 5–69 tokens, 5–39 new tokens, run past EOS).
fn requests(vocab: usize) -> (Vec<Vec<u32>>, Vec<RequestParams>) {
    let mut rng = StdRng::seed_from_u64(21);
    let hi = (vocab as u32).min(300);
    let prompts = (0..8)
        .map(|_| {
            let len = rng.random_range(5..70);
            (0..len).map(|_| rng.random_range(3..hi)).collect()
        })
        .collect();
    let params = (0..8)
        .map(|_| RequestParams {
            max_tokens: rng.random_range(5..40),
            ignore_eos: true,
            ..Default::default()
        })
        .collect();
    (prompts, params)
}

/// The eight requests for `model`, and their working set in blocks.
fn workload(model: &Model) -> (Vec<Vec<u32>>, Vec<RequestParams>, usize) {
    let (prompts, params) = requests(model.cfg.vocab_size);
    let ws = prompts
        .iter()
        .zip(&params)
        .map(|(p, r)| (p.len() + r.max_tokens).div_ceil(BLOCK))
        .sum();
    (prompts, params, ws)
}

/// Makes a serving engine on the device under test.
pub type ServeEngineFactory<'a> = dyn Fn(&Arc<Model>, &EngineConfig) -> Result<Engine> + 'a;

/// The serving engine under preemption (see the module docs); `sanitize`: random delays
/// on the offload run's copies (the CPU device only).
pub fn serve_case(
    make: &ServeEngineFactory<'_>,
    name: &str,
    shape: Shape,
    sanitize: bool,
) -> Result<Vec<CheckRow>> {
    serve_case_of(make, name, &random_model(shape), sanitize, Some(NEAR_TIE))
}

/// `serve_case` on a loaded model; where the greedy tokens part from the CPU engine's,
/// the CPU's top-2 gap must be at most `near_tie` of its largest |logit| (`None`: no
/// comparison with the CPU engine, for a checkpoint whose bf16 noise hides faults).
pub fn serve_case_of(
    make: &ServeEngineFactory<'_>,
    name: &str,
    model: &Arc<Model>,
    sanitize: bool,
    near_tie: Option<f32>,
) -> Result<Vec<CheckRow>> {
    let (prompts, params, ws) = workload(model);
    let cfg = |gpu, cpu, sanitize| EngineConfig {
        sched: sched(gpu, cpu),
        link_gbps: 0.0,
        sanitize,
        check_order: crate::device::order::on_by_default(),
        disk: None,
        kv_dtype: KvDtype::Bf16,
    };
    let mut free = make(model, &cfg(ws, 0, false))?;
    let want = free.generate_with_logprobs(&prompts, &params)?;
    let mut rows = Vec::new();
    let mut row = |what: &str, tolerance: &str, pass: bool, note: String| {
        rows.push(CheckRow {
            name: format!("{name}: {what}"),
            shape: format!("8 requests, GPU blocks {}", ws / 3),
            max_abs_err: 0.0,
            tolerance: tolerance.into(),
            pass,
            note,
        })
    };
    for (what, cpu, sanitize) in [
        ("preempted, host offload", 1000, sanitize),
        ("preempted, recompute", 0, false),
    ] {
        let mut e = make(model, &cfg(ws / 3, cpu, sanitize))?;
        let got = e.generate_with_logprobs(&prompts, &params)?;
        let st = e.stats().sched;
        let moved = cpu == 0 || (st.blocks_stored > 0 && st.blocks_loaded > 0);
        let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        let note = format!(
            "{} preemptions, {} blocks stored, {differ} requests differ",
            st.preemptions, st.blocks_stored
        );
        row(
            what,
            "bitwise",
            st.preemptions >= 3 && moved && differ == 0,
            note,
        );
    }
    let Some(near_tie) = near_tie else {
        return Ok(rows);
    };
    // The CPU reference keeps its f32 KV.
    let f32_kv = EngineConfig {
        kv_dtype: KvDtype::F32,
        ..cfg(ws, 0, false)
    };
    let mut cpu = Engine::new(Arc::clone(model), f32_kv)?;
    let cpu_out = cpu.generate_with_logprobs(&prompts, &params)?;
    let same: usize = want
        .iter()
        .zip(&cpu_out)
        .map(|((g, _), (w, _))| g.iter().zip(w).take_while(|(a, b)| a == b).count())
        .sum();
    let total: usize = cpu_out.iter().map(|(t, _)| t.len()).sum();
    // Where a request's tokens part, the CPU's own choice must have been a near-tie (bf16
    // activations move logits by a few percent: step 2's tolerance).
    let mut ties = Vec::new();
    for (r, ((g, _), (w, _))) in want.iter().zip(&cpu_out).enumerate() {
        if let Some(i) = g.iter().zip(w).position(|(a, b)| a != b) {
            let gap = near_tie_gap(model, &prompts[r], &w[..i], w[i], g[i])?;
            ties.push(gap);
        }
    }
    let pass = ties.iter().all(|&gap| gap <= near_tie);
    row(
        "greedy tokens vs CPU engine",
        "equal, or part at a near-tie",
        pass,
        format!(
            "{same} of {total} tokens equal before the first difference; where they part, \
             the CPU's top-2 gap / max |logit|: {ties:.4?} (near-tie ≤ {near_tie})"
        ),
    );
    Ok(rows)
}

/// A difference between the CUDA and CPU engines' greedy tokens is a near-tie when the
/// f32 CPU model's logits of the two tokens differ by at most this fraction of its
/// largest |logit| (bf16 activations move logits by ~1–3% of their spread).
const NEAR_TIE: f32 = 0.02;

/// The f32 CPU model's logit of `want` minus that of `got` after `prompt` + `before`,
/// over its largest |logit|.
fn near_tie_gap(model: &Model, prompt: &[u32], before: &[u32], want: u32, got: u32) -> Result<f32> {
    let c = &model.cfg;
    let tokens: Vec<u32> = prompt.iter().chain(before).copied().collect();
    let mut kv = ContiguousKv::<f32>::plain(c, tokens.len());
    let l = model.forward(&tokens, 0, &mut kv)?;
    let max = l.iter().fold(0f32, |a, x| a.max(x.abs())).max(1e-30);
    Ok((l[want as usize] - l[got as usize]) / max)
}

/// The disk tier under the engine `make` builds, in `dir` (emptied first): see the module
/// docs.
pub fn disk_case(
    make: &ServeEngineFactory<'_>,
    name: &str,
    shape: Shape,
    dir: &std::path::Path,
) -> Result<Vec<CheckRow>> {
    let model = random_model(shape);
    let (prompts, params, ws) = workload(&model);
    let _ = std::fs::remove_dir_all(dir);
    let cfg = |gpu, cpu, disk: bool| EngineConfig {
        sched: SchedulerConfig {
            max_disk_offload_blocks: if disk { 400 } else { 0 },
            ..sched(gpu, cpu)
        },
        link_gbps: 0.0,
        sanitize: false,
        check_order: crate::device::order::on_by_default(),
        disk: disk.then(|| crate::serve::disk::DiskTierConfig {
            dir: dir.to_path_buf(),
            io_threads: 2,
        }),
        kv_dtype: KvDtype::Bf16,
    };
    let want = make(&model, &cfg(ws, 0, false))?.generate_with_logprobs(&prompts, &params)?;
    let mut rows = Vec::new();
    let mut run = |what: &str, check: &dyn Fn(&crate::serve::EngineStats) -> bool| -> Result<()> {
        // Each engine is dropped before the next opens the directory (one at a time).
        let (got, st) = {
            let mut e = make(&model, &cfg(ws / 3, 2, true))?;
            let got = e.generate_with_logprobs(&prompts, &params)?;
            (got, e.stats())
        };
        let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        let pass = differ == 0 && check(&st);
        rows.push(CheckRow {
            name: format!("{name}: disk tier, {what}"),
            shape: format!("8 requests, GPU blocks {}, 2 host slots", ws / 3),
            max_abs_err: 0.0,
            tolerance: "bitwise".into(),
            pass,
            note: format!(
                "{} blocks to disk, {} from disk, {} prefix blocks restored ({} used), {} checksum failures, {differ} requests differ",
                st.sched.blocks_stored_disk,
                st.sched.blocks_loaded_disk,
                st.restored_prefix_blocks,
                st.sched.prefix_blocks_from_disk,
                st.disk.checksum_failures
            ),
        });
        Ok(())
    };
    run("spill and load back", &|st| {
        st.sched.blocks_stored_disk > 0
            && st.sched.blocks_loaded_disk > 0
            && st.disk.checksum_failures + st.disk.io_errors == 0
            && st.sched.prefix_blocks_persisted > 0
    })?;
    run("restart reuses the prefix blocks", &|st| {
        st.restored_prefix_blocks > 0 && st.sched.prefix_blocks_from_disk > 0
    })?;
    corrupt_every_payload(dir)?;
    run("every slot corrupted: none used", &|st| {
        st.disk.checksum_failures > 0 && st.sched.prefix_blocks_from_disk == 0
    })?;
    Ok(rows)
}

/// Flips one payload byte of every slot of the disk tier in `dir`.
fn corrupt_every_payload(dir: &std::path::Path) -> Result<()> {
    use crate::serve::disk::store::{ALIGN, SLOTS_FILE};
    let path = dir.join(SLOTS_FILE);
    let mut bytes = std::fs::read(&path)?;
    let slot = bytes.len() / 400;
    for s in 0..400 {
        bytes[s * slot + ALIGN + 100] ^= 0xff;
    }
    std::fs::write(&path, &bytes)?;
    Ok(())
}

/// Step 6 on the GPU: a tiny Qwen3, a Qwen3-4B-shaped 3-layer model (vocab 4,096) and a
/// Gemma-3-shaped one (head_dim 256, windows of 24 tokens: shorter than most requests).
pub fn serve_check() -> Result<Vec<CheckRow>> {
    let mut four_b = Shape::qwen3_4b();
    four_b.layers = 3;
    four_b.vocab = 4096;
    let mut rows = Vec::new();
    for (name, shape) in [
        ("tiny qwen3", Shape::tiny()),
        ("qwen3-4b-shaped", four_b),
        ("gemma3-shaped", Shape::gemma3_hd256(24)),
    ] {
        let dev = Arc::new(CudaDevice::new(0)?);
        let exec: Arc<dyn Exec> = Arc::new(CudaExec::new(dev.clone(), dev.new_stream()?)?);
        rows.push(batch_invariance_case(exec, name, shape)?);
        let gpu = |m: &Arc<Model>, c: &EngineConfig| crate::serve::setup::gpu_engine(m, c);
        rows.extend(serve_case(&gpu, name, shape, false)?);
        rows.push(prompt_logprobs_case(&gpu, name, shape)?);
        let dir = std::env::temp_dir().join(format!("strata-gpucheck-disk-{}", std::process::id()));
        rows.extend(disk_case(&gpu, name, shape, &dir)?);
        let _ = std::fs::remove_dir_all(&dir);
    }
    let dev = Arc::new(CudaDevice::new(0)?);
    let exec: Arc<dyn Exec> = Arc::new(CudaExec::new(dev.clone(), dev.new_stream()?)?);
    let gpu = |m: &Arc<Model>, c: &EngineConfig| crate::serve::setup::gpu_engine(m, c);
    rows.extend(checkpoint_serving(exec, &gpu, false)?);
    Ok(rows)
}

/// Step 6's rows on transformers' checkpoints (Qwen3.5 dense and MoE: each sequence's rows
/// through its own recurrent state; gpt-oss: sinks, windows, experts): batch invariance
/// and the serving engine under preemption; accuracy at each one's bf16 bound where it
/// has one (`model_checks::transformers_checkpoints`; the MoE blocks are checked alone,
/// step 2).
fn checkpoint_serving(
    exec: Arc<dyn Exec>,
    make: &ServeEngineFactory<'_>,
    sanitize: bool,
) -> Result<Vec<CheckRow>> {
    use super::model_checks::transformers_checkpoints;
    let mut rows = Vec::new();
    for (name, model, tol) in transformers_checkpoints()? {
        rows.push(batch_invariance_case_of(exec.clone(), name, &model, tol)?);
        rows.extend(serve_case_of(
            make,
            name,
            &model,
            sanitize,
            tol.map(|t| t.0),
        )?);
    }
    Ok(rows)
}

/// Step 6 on the kernel emulator (a tiny Qwen3 and a tiny Gemma 3 with windows of 16
/// tokens; KV pages on the CPU device in bf16).
pub fn serve_check_emulated() -> Result<Vec<CheckRow>> {
    let exec: Arc<dyn Exec> = Arc::new(super::emu::EmuExec::new()?);
    let emu = super::emu::emulator_serve_engine;
    let mut rows = Vec::new();
    for (name, shape) in [
        ("tiny", Shape::tiny()),
        ("tiny gemma3", Shape::tiny_gemma3(16)),
    ] {
        rows.push(batch_invariance_case(exec.clone(), name, shape)?);
        rows.extend(serve_case(&emu, name, shape, true)?);
        rows.push(prompt_logprobs_case(&emu, name, shape)?);
    }
    rows.extend(checkpoint_serving(exec, &emu, true)?);
    Ok(rows)
}

/// Prompt log-probabilities on the serving path (every prompt row's logits,
/// `WantLogits::Every`): at each probed position, the alternatives scored from a prompt
/// row equal, bitwise, those a request whose prompt ends at that row samples from
/// (`WantLogits::Last`): the rows are the right ones, in order, whatever the chunking; and
/// the requests batched give what each gives alone.
pub fn prompt_logprobs_case(
    make: &ServeEngineFactory<'_>,
    name: &str,
    shape: Shape,
) -> Result<CheckRow> {
    let model = random_model(shape);
    let (prompts, _, _) = workload(&model);
    const TOP: usize = 4;
    let ask = |prompt_logprobs| RequestParams {
        max_tokens: 1,
        logprobs: Some(TOP),
        prompt_logprobs,
        ..Default::default()
    };
    let full = &prompts[0];
    // Rows inside the first prefill chunk, at its end and past it, and the last.
    let ends: Vec<usize> = [
        2,
        PREFILL_CHUNK,
        PREFILL_CHUNK + 1,
        full.len() - 1,
        full.len(),
    ]
    .into_iter()
    .filter(|&j| j >= 2 && j <= full.len())
    .collect();
    let mut batch = vec![full.clone()];
    batch.extend(ends.iter().map(|&j| full[..j].to_vec()));
    let params: Vec<RequestParams> = std::iter::once(ask(Some(TOP)))
        .chain(ends.iter().map(|_| ask(None)))
        .collect();
    let blocks = batch.iter().map(|p| (p.len() + 1).div_ceil(BLOCK)).sum();
    let cfg = EngineConfig {
        sched: sched(blocks, 0),
        link_gbps: 0.0,
        sanitize: false,
        check_order: crate::device::order::on_by_default(),
        disk: None,
        kv_dtype: KvDtype::Bf16,
    };
    let alone: Vec<_> = batch
        .iter()
        .zip(&params)
        .map(|(p, r)| {
            let mut e = make(&model, &cfg)?;
            Ok(
                e.generate_recorded(std::slice::from_ref(p), std::slice::from_ref(r))?
                    .remove(0),
            )
        })
        .collect::<Result<_>>()?;
    let together = make(&model, &cfg)?.generate_recorded(&batch, &params)?;
    let prompt = alone[0].1.prompt.clone().unwrap_or_default();
    let mut wrong = Vec::new();
    for (k, &j) in ends.iter().enumerate() {
        // The request ending at row j - 1 samples from it; the full prompt's entry j - 1
        // scores position j from the same row (the last row: the full request's sample).
        let sampled = alone[k + 1].1.sampled.first().map(|t| &t.top);
        let scored = match prompt.get(j - 1) {
            Some(e) => Some(&e.top),
            None => alone[0].1.sampled.first().map(|t| &t.top),
        };
        if sampled.is_none() || sampled != scored {
            wrong.push(j);
        }
    }
    let batched_same = together == alone;
    Ok(CheckRow {
        name: format!("{name}: prompt logprobs, every prompt row"),
        shape: format!("{}-token prompt, rows ending {ends:?}", full.len()),
        max_abs_err: 0.0,
        tolerance: "bitwise".into(),
        pass: prompt.len() + 1 == full.len() && wrong.is_empty() && batched_same,
        note: format!(
            "{} prompt entries; rows differing from their one-row twin: {wrong:?}; batched = alone: {batched_same}",
            prompt.len()
        ),
    })
}
