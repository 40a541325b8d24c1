//! Generation for one request: prefill the prompt, then decode token by token.

pub mod bench;
pub mod logprobs;
pub mod sampler;
pub mod verified;

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};

use crate::device::KvElem;
use crate::kv::{ContiguousKv, KvCache};
use crate::model::Model;
pub use sampler::{Sampler, SamplingParams};

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop at any of these ids (the model's eos ids unless overridden).
    pub stop_ids: Vec<u32>,
}

#[derive(Debug, Clone, Default)]
pub struct GenerationOutput {
    pub token_ids: Vec<u32>,
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// Tokens produced by decode steps (the first token comes from prefill).
    pub decode_steps: usize,
    /// Log-probability of each chosen token under the model (before temperature).
    pub logprobs: Vec<f32>,
    /// Verified sparse decode (`--sparse-verify`): its rounds and drafts.
    pub verified: Option<verified::VerifyStats>,
}

/// `log softmax(logits)[id]`, in f64 so it is exact enough to compare runs.
pub fn logprob(logits: &[f32], id: u32) -> f32 {
    logprobs::token_logprob(logits, id, 0, 1.0).logprob
}

impl GenerationOutput {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        if self.prefill_secs == 0.0 {
            0.0 // nothing was prefilled (`--max-tokens 0`)
        } else {
            self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
        }
    }
    pub fn decode_tokens_per_s(&self) -> f64 {
        if self.decode_steps == 0 {
            0.0
        } else {
            self.decode_steps as f64 / self.decode_secs.max(1e-9)
        }
    }
}

/// Checks a prompt against the model's context before any work is done.
pub fn check_prompt(prompt: &[u32], max_model_len: usize) -> Result<()> {
    if prompt.is_empty() {
        bail!("empty prompt: nothing to generate from");
    }
    if prompt.len() >= max_model_len {
        bail!(
            "prompt is {} tokens, longer than the model's maximum context of {} (leave room for at least one new token)",
            prompt.len(),
            max_model_len
        );
    }
    Ok(())
}

/// Tokens a request of `prompt_len` tokens and up to `max_tokens` new ones can reach
/// within `max_model_len`: what a cache sized for this request alone must hold.
pub fn request_len(prompt_len: usize, max_tokens: usize, max_model_len: usize) -> usize {
    prompt_len.saturating_add(max_tokens).min(max_model_len)
}

/// Runs one request to completion on a fresh contiguous KV cache, calling `on_token`
/// with each new token as it is produced.
pub fn generate(
    model: &Arc<Model>,
    prompt: &[u32],
    opts: &GenerateOptions,
    max_model_len: usize,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationOutput> {
    let cfg = &model.cfg;
    check_prompt(prompt, max_model_len)?;
    let capacity = request_len(prompt.len(), opts.max_tokens, max_model_len);
    let mut kv = ContiguousKv::<f32>::for_model(cfg, capacity);
    generate_with(model, &mut kv, capacity, prompt, opts, on_token)
}

/// The prefill/decode loop over any KV view with room for `capacity` tokens.
pub fn generate_with<T: KvElem>(
    model: &Arc<Model>,
    kv: &mut dyn KvCache<T>,
    capacity: usize,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationOutput> {
    kv.reset()?;
    run_loop(
        capacity,
        prompt,
        opts,
        &mut |tokens, pos0, _| model.forward(tokens, pos0, kv),
        on_token,
    )
}

/// One forward step: `(tokens, pos0, decode_step)` → the last position's logits.
pub type StepFn<'a> = dyn FnMut(&[u32], usize, Option<usize>) -> Result<Vec<f32>> + 'a;

/// Prefill then decode, whatever runs the model: `forward(tokens, pos0, decode_step)`
/// returns the last position's logits (`decode_step` is `None` for the prefill). Stops at
/// `max_tokens`, at a stop id, or when `capacity` tokens are in the context.
pub fn run_loop(
    capacity: usize,
    prompt: &[u32],
    opts: &GenerateOptions,
    forward: &mut StepFn<'_>,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationOutput> {
    opts.sampling.validate()?;
    let mut sampler = Sampler::new(opts.sampling.clone());
    let mut out = GenerationOutput {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    if opts.max_tokens == 0 {
        return Ok(out);
    }
    let t0 = Instant::now();
    let logits = forward(prompt, 0, None)?;
    let mut next = sampler.sample(&logits);
    out.logprobs.push(logprob(&logits, next));
    out.prefill_secs = t0.elapsed().as_secs_f64();
    out.token_ids.push(next);
    on_token(next)?;
    let t1 = Instant::now();
    let mut pos = prompt.len();
    while out.token_ids.len() < opts.max_tokens && !opts.stop_ids.contains(&next) && pos < capacity
    {
        let logits = forward(&[next], pos, Some(out.decode_steps))?;
        pos += 1;
        next = sampler.sample(&logits);
        out.logprobs.push(logprob(&logits, next));
        out.token_ids.push(next);
        out.decode_steps += 1;
        on_token(next)?;
    }
    out.decode_secs = t1.elapsed().as_secs_f64();
    Ok(out)
}

/// Serves every allocation of 128 KiB or more (activations, logits, attention partials
/// of a long prefill) from its own mapping, handed back to the system when freed. glibc
/// otherwise raises that threshold after the first such free (up to 32 MiB) and serves
/// the next ones from its arenas, which fragment and keep the pages: a 4K-context run
/// held ~90 MiB more at its peak (406 vs 318 MiB, `benches/weights.rs`). Call once at
/// start; the cost is a few page faults per large buffer.
pub fn return_large_buffers_to_the_system() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only tunes the allocator; it is safe to call at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// Makes the calling thread one of the compute threads: worker 0 of rayon's global pool
/// (beside `available_parallelism − 1` others), for a command whose model runs on this
/// thread. Every parallel op of a step (a few per layer) is then started and joined here
/// and this thread does its share, instead of handing the op to the pool and sleeping until
/// a worker wakes it: on two shared cores each such hand-off costs tens of microseconds or
/// a scheduler slice. Not for a thread that blocks while others compute (`serve`'s main
/// thread): the pool would be a thread short. Call first, before anything uses rayon;
/// after that it changes nothing.
///
/// `Err` when the pool's threads cannot start (a process or thread limit): every compute
/// op would panic later, so the command stops with one error line instead. Called a second
/// time (the pool exists), it is `Ok`.
pub fn compute_on_this_thread() -> anyhow::Result<()> {
    match rayon::ThreadPoolBuilder::new()
        .num_threads(compute_threads())
        .use_current_thread()
        .build_global()
    {
        Ok(()) => Ok(()),
        // The only other failure is "already initialized": the pool exists.
        Err(e) if e.to_string().contains("already") => Ok(()),
        Err(e) => Err(crate::threads::refused("the compute pool", &e)),
    }
}

/// `compute_on_this_thread` for a thread started after the global pool exists (`serve`'s
/// engine thread, spawned once the model is loaded): a pool of the global pool's size with
/// this thread as its worker 0. Every parallel op this thread starts from then on runs in
/// it. Hold the pool as long as the thread computes. `Err` if its threads cannot start.
pub fn compute_pool_on_this_thread() -> anyhow::Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(compute_threads())
        .thread_name(|i| format!("strata-compute-{i}"))
        .use_current_thread()
        .build()
        .map_err(|e| crate::threads::refused("the compute pool", &e))
}

/// Set when `compute_threads` capped `RAYON_NUM_THREADS`: the warning to print.
static THREADS_NOTE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Compute threads: `RAYON_NUM_THREADS` when set, but never more than the cores. More
/// threads than cores only time-slice the same cores, and every op of a step waits for its
/// slowest thread: 2,000 ran 300× slower on two cores. Past the cores the value is capped,
/// and `print_threads_note` says so.
pub fn compute_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let asked = std::env::var("RAYON_NUM_THREADS").ok();
    match asked.as_deref().map(str::trim).map(str::parse::<usize>) {
        Some(Ok(n)) if n > cores => {
            let _ = THREADS_NOTE.set(format!(
                "warning: RAYON_NUM_THREADS={n} is more than the {cores} cores here; using {cores} compute threads (more only time-slice the same cores)"
            ));
            cores
        }
        Some(Ok(n)) if n > 0 => n,
        _ => cores,
    }
}

/// Prints the warning of a capped `RAYON_NUM_THREADS`, if any: with a command's other
/// informational lines, after its checks (a failing command prints only its error line).
pub fn print_threads_note() {
    if let Some(note) = THREADS_NOTE.get() {
        crate::log!("{note}");
    }
}

/// Peak resident memory of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use rayon::prelude::*;

    #[test]
    fn a_compute_pool_makes_the_calling_thread_its_worker_0() {
        let global = rayon::current_num_threads();
        std::thread::spawn(move || {
            assert_eq!(rayon::current_thread_index(), None, "not a worker yet");
            let _pool = super::compute_pool_on_this_thread().expect("a pool");
            assert_eq!(rayon::current_thread_index(), Some(0));
            assert_eq!(rayon::current_num_threads(), global);
            // Parallel work started here runs in that pool, this thread taking part.
            let workers: Vec<usize> = (0..64)
                .into_par_iter()
                .map(|_| rayon::current_thread_index().expect("on a worker"))
                .collect();
            assert!(workers.iter().all(|&w| w < global));
        })
        .join()
        .unwrap();
    }
}
