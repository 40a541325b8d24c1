//! The prefill/decode loop on the CUDA model: `engine::generate_with`'s twin, with the
//! same sampler (on the host, over downloaded f32 logits) and `--profile-steps`.

use super::kv::CudaKv;
use super::model::CudaModel;
use crate::engine::{GenerateOptions, GenerationOutput};
use anyhow::Result;

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

pub fn generate(
    model: &mut CudaModel,
    kv: &mut dyn CudaKv,
    prompt: &[u32],
    opts: &GenerateOptions,
    profile: Option<ProfileSteps>,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationOutput> {
    let capacity = kv.capacity().min(model.max_pos());
    crate::engine::check_prompt(prompt, capacity)?;
    kv.reset()?;
    // Bracket decode steps start..end with the profiler, for nsys's capture range.
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

/// One `strata generate --device cuda` request.
pub struct CudaRequest {
    /// Layerwise offload with this (already planned and checked) configuration.
    pub offload: Option<crate::offload::OffloadConfig>,
    /// Tokens the request may hold (prompt + output).
    pub max_len: usize,
    pub profile: Option<ProfileSteps>,
    pub trace_out: Option<std::path::PathBuf>,
}

/// Uploads `model` in bf16 and runs the request on GPU 0.
pub fn run_request(
    model: &crate::model::Model,
    prompt: &[u32],
    opts: &GenerateOptions,
    req: &CudaRequest,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationOutput> {
    use super::context::CudaDevice;
    use std::sync::Arc;
    let dev = Arc::new(CudaDevice::new(0)?);
    let compute = dev.new_stream()?;
    let cfg = model.cfg.clone();
    let x: Arc<dyn super::exec::Exec> =
        Arc::new(super::exec::CudaExec::new(dev.clone(), compute.clone())?);
    let w = super::weights::CudaWeights::from_model(&*x, model)?;
    let mut gpu = CudaModel::new(x.clone(), cfg.clone(), w, req.max_len)?;
    match &req.offload {
        Some(ocfg) => {
            let mut kv = super::offload::CudaOffloadEngine::new(dev, compute, &cfg, ocfg.clone())?;
            kv.set_tracing(req.trace_out.is_some())?;
            let out = generate(&mut gpu, &mut kv, prompt, opts, req.profile, on_token)?;
            if let Some(path) = &req.trace_out {
                let events = kv.take_trace()?;
                crate::offload::trace::write_chrome_trace(path, &events)?;
                eprintln!("trace: {} ops written to {}", events.len(), path.display());
            }
            Ok(out)
        }
        None => {
            let mut kv =
                super::kv::ResidentKv::new(&*x, cfg.num_layers, cfg.kv_dim(), req.max_len)?;
            generate(&mut gpu, &mut kv, prompt, opts, req.profile, on_token)
        }
    }
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
