//! The prefill/decode loop on the CUDA model: `engine::run_loop` (the same sampler, on
//! the host, over downloaded f32 logits) with `--profile-steps`.

use super::model::CudaModel;
use crate::engine::{GenerateOptions, GenerationOutput};
use crate::kv::KvCache;
use anyhow::Result;
use half::bf16;

/// Decode steps `start..end` (0 = the first decode step) run between cuProfilerStart and
/// cuProfilerStop, so `nsys --capture-range=cudaProfilerApi` records only those.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfileSteps {
    pub start: usize,
    pub end: usize,
}

impl std::str::FromStr for ProfileSteps {
    type Err = String;
    /// `A:B`, `A < B`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s
            .split_once(':')
            .ok_or_else(|| format!("expected A:B (decode steps), got '{s}'"))?;
        let p = |x: &str| {
            x.trim()
                .parse::<usize>()
                .map_err(|_| format!("'{x}' is not a step number"))
        };
        let (start, end) = (p(a)?, p(b)?);
        if start >= end {
            return Err(format!("A must be less than B in A:B, got '{s}'"));
        }
        Ok(Self { start, end })
    }
}

/// One request on the CUDA model over `kv` (already checked against `capacity`): the
/// shared prefill/decode loop, with decode steps bracketed for the profiler.
pub fn run_cuda(
    model: &mut CudaModel,
    kv: &mut dyn KvCache<bf16>,
    capacity: usize,
    prompt: &[u32],
    opts: &GenerateOptions,
    profile: Option<ProfileSteps>,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationOutput> {
    let capacity = capacity.min(kv.capacity()).min(model.max_pos());
    kv.reset()?;
    let mut profiling = false;
    let mut forward = |tokens: &[u32], pos0: usize, step: Option<usize>| -> Result<Vec<f32>> {
        if let (Some(p), Some(step)) = (profile, step) {
            if p.start == step {
                super::context::profiler_start()?;
                profiling = true;
            }
        }
        let logits = model.forward(tokens, pos0, kv)?;
        if let (Some(p), Some(step), true) = (profile, step, profiling) {
            if p.end == step + 1 {
                super::context::profiler_stop()?;
                profiling = false;
            }
        }
        Ok(logits)
    };
    let out = crate::engine::run_loop(capacity, prompt, opts, &mut forward, on_token)?;
    if profiling {
        super::context::profiler_stop()?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::ProfileSteps;

    #[test]
    fn profile_steps_parse() {
        assert_eq!(
            "2:5".parse::<ProfileSteps>(),
            Ok(ProfileSteps { start: 2, end: 5 })
        );
        assert!("5:2".parse::<ProfileSteps>().is_err());
        assert!("3".parse::<ProfileSteps>().is_err());
        assert!("a:4".parse::<ProfileSteps>().is_err());
    }
}
