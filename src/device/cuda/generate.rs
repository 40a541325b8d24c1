//! The prefill/decode loop on the CUDA model: `engine::generate_with`'s twin, with the
//! same sampler (on the host, over downloaded f32 logits) and `--profile-steps`.

use super::context::CudaDevice;
use super::exec::{CudaExec, Exec};
use super::kv::{CudaKv, ResidentKv};
use super::model::CudaModel;
use super::offload::CudaOffloadEngine;
use super::weights::CudaWeights;
use crate::engine::{GenerateOptions, GenerationOutput};
use crate::model::{Model, ModelConfig};
use crate::offload::OffloadConfig;
use anyhow::{bail, Result};
use std::sync::Arc;

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

/// Makes an offload engine on the same device as the model.
pub type EngineFactory<'a> = dyn Fn(&ModelConfig, OffloadConfig) -> Result<CudaOffloadEngine> + 'a;

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

/// The bf16 model on one device with its KV cache(s), kept across requests (weights
/// uploaded once): resident KV, the offload engine, or both (for `needle
/// --compare-offload`).
pub struct CudaSession {
    gpu: CudaModel,
    resident: Option<ResidentKv>,
    offload: Option<CudaOffloadEngine>,
}

impl CudaSession {
    /// On GPU 0, for requests of up to `max_len` tokens.
    pub fn on_gpu(
        model: &Model,
        max_len: usize,
        resident: bool,
        offload: Option<OffloadConfig>,
    ) -> Result<Self> {
        let dev = Arc::new(CudaDevice::new(0)?);
        let compute = dev.new_stream()?;
        let x: Arc<dyn Exec> = Arc::new(CudaExec::new(dev.clone(), compute.clone())?);
        let engine = |cfg: &ModelConfig, o: OffloadConfig| {
            CudaOffloadEngine::new(dev.clone(), compute.clone(), cfg, o)
        };
        Self::new(x, &engine, model, max_len, resident, offload)
    }

    /// On any `Exec` (the kernel emulator in tests); `engine` makes the offload engine
    /// on the same device.
    pub fn new(
        x: Arc<dyn Exec>,
        engine: &EngineFactory<'_>,
        model: &Model,
        max_len: usize,
        resident: bool,
        offload: Option<OffloadConfig>,
    ) -> Result<Self> {
        let cfg = &model.cfg;
        let w = CudaWeights::from_model(&*x, model)?;
        let gpu = CudaModel::new(x.clone(), cfg.clone(), w, max_len)?;
        let resident = if resident {
            Some(ResidentKv::new(&*x, cfg.num_layers, cfg.kv_dim(), max_len)?)
        } else {
            None
        };
        let offload = offload.map(|o| engine(cfg, o)).transpose()?;
        Ok(Self {
            gpu,
            resident,
            offload,
        })
    }

    /// The offload engine, when the session has one (tracing).
    pub fn offload_engine(&mut self) -> Option<&mut CudaOffloadEngine> {
        self.offload.as_mut()
    }

    /// One request, on the offload engine (`offloaded`) or the resident KV.
    pub fn generate(
        &mut self,
        offloaded: bool,
        prompt: &[u32],
        opts: &GenerateOptions,
        profile: Option<ProfileSteps>,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<GenerationOutput> {
        let kv: &mut dyn CudaKv = match (offloaded, &mut self.offload, &mut self.resident) {
            (true, Some(o), _) => o,
            (false, _, Some(r)) => r,
            _ => bail!(
                "this CUDA session has no {} KV cache",
                if offloaded { "offloaded" } else { "resident" }
            ),
        };
        generate(&mut self.gpu, kv, prompt, opts, profile, on_token)
    }
}

/// Uploads `model` in bf16 and runs the request on GPU 0.
pub fn run_request(
    model: &Model,
    prompt: &[u32],
    opts: &GenerateOptions,
    req: &CudaRequest,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationOutput> {
    let offloaded = req.offload.is_some();
    let mut s = CudaSession::on_gpu(model, req.max_len, !offloaded, req.offload.clone())?;
    if let Some(kv) = s.offload_engine() {
        kv.set_tracing(req.trace_out.is_some())?;
    }
    let out = s.generate(offloaded, prompt, opts, req.profile, on_token)?;
    if let (Some(path), Some(kv)) = (&req.trace_out, s.offload_engine()) {
        let events = kv.take_trace()?;
        crate::offload::trace::write_chrome_trace(path, &events)?;
        eprintln!("trace: {} ops written to {}", events.len(), path.display());
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
