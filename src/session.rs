//! `Session`: a loaded model on one device with its KV cache, running requests one after
//! another (think `LLM.generate`). It owns the runtime policy every front end shares: the
//! KV element type per device, the offload plan (`SessionConfig::plan`, to print before
//! anything is allocated), the capacity of a request, and trace writing on both devices.
//!
//! ```text
//! CLI / needle / benches ─▶ Session::generate ─▶ engine::run_loop (prefill, decode, sample)
//!   ─▶ Model::forward (CPU, KV in `--kv-dtype`) or CudaModel::forward (CUDA, KV in bf16)
//!   ─▶ KvCache seam: ContiguousKv / ResidentKv / OffloadEngine<CPU or CUDA device>
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use half::bf16;

use crate::device::cuda::exec::{CudaExec, Exec};
use crate::device::{DeviceKind, Feature, KvDtype, KvElem};
use crate::engine::{self, GenerateOptions, GenerationOutput};
use crate::kv::cuda::ResidentKv;
use crate::kv::{ContiguousKv, KvCache};
use crate::model::cuda::weights::{CudaWeights, ExpertPlace};
use crate::model::cuda::{CudaModel, ExpertSource};
use crate::model::{Model, ModelConfig};
use crate::offload::experts::{ExpertOffload, ExpertStream};
use crate::offload::{
    CpuOffloadDevice, MemoryPlan, OffloadConfig, OffloadControl, OffloadEngine, OffloadKv,
};

#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub device: DeviceKind,
    /// The KV element (`DeviceKind::kv_dtype`: CUDA stores bf16 only).
    pub kv_dtype: KvDtype,
    /// Tokens one request may hold (prompt + output).
    pub max_len: usize,
    /// Layerwise KV offload with these settings; `None`: every layer's KV resident.
    pub offload: Option<OffloadConfig>,
    /// Write each request's Chrome/Perfetto trace here (offload only).
    pub trace_out: Option<PathBuf>,
    /// CUDA: decode steps bracketed by cuProfilerStart/Stop.
    pub profile: Option<ProfileSteps>,
    /// Verified sparse decode (`engine::verified`): sparse decode drafts this many tokens
    /// per round, full attention checks them (greedy: exactly; sampled: speculative
    /// sampling).
    pub sparse_verify: Option<usize>,
    /// CUDA: the routed experts in host memory, streamed per layer (`--offload-experts`).
    pub offload_experts: Option<ExpertOffload>,
}

impl SessionConfig {
    /// With the device's default KV element.
    pub fn new(device: DeviceKind, max_len: usize) -> Self {
        Self {
            device,
            kv_dtype: device
                .kv_dtype(None)
                .expect("every device has a default KV element"),
            max_len,
            offload: None,
            trace_out: None,
            profile: None,
            sparse_verify: None,
            offload_experts: None,
        }
    }

    /// Checks the settings against the model; the offload memory plan, if offloading.
    /// Allocates nothing, so front ends print it before `Session::new`.
    pub fn plan(&self, model: &ModelConfig) -> Result<Option<MemoryPlan>> {
        if self.max_len == 0 {
            bail!("--max-model-len must be at least 1");
        }
        if self.trace_out.is_some() && self.offload.is_none() {
            bail!("--trace-out traces the offload engine: add --enable-offload");
        }
        if self.profile.is_some() {
            self.device.require(Feature::ProfilerRange)?;
        }
        self.device.kv_dtype(Some(self.kv_dtype))?;
        if self.offload_experts.is_some() {
            if self.device != DeviceKind::Cuda {
                bail!("--offload-experts streams experts to the GPU: add --device cuda (the CPU device reads them where they are)");
            }
            if model.moe.is_none() {
                bail!("--offload-experts: this model has no experts");
            }
        }
        if self.sparse_verify.is_some() {
            if self.offload.as_ref().and_then(|o| o.sparse).is_none() {
                bail!("--sparse-verify checks sparse decode's tokens: add --enable-offload and --sparse-budget");
            }
            if self.profile.is_some() {
                bail!("--profile-steps counts plain decode steps: profile without --sparse-verify");
            }
        }
        self.offload
            .as_ref()
            .map(|o| o.plan_for(model, self.kv_dtype.bytes()))
            .transpose()
    }

    /// Tokens one request may hold: `max_len`, bounded by the offload engine's host KV.
    pub fn capacity(&self, model: &ModelConfig) -> Result<usize> {
        Ok(match (self.plan(model)?, &self.offload) {
            (Some(p), Some(o)) => self
                .max_len
                .min(o.max_model_len)
                .min(p.num_cpu_blocks.saturating_mul(o.block_size)),
            _ => self.max_len,
        })
    }

    /// Errors unless a prompt of `prompt_len` tokens leaves room for one new token.
    pub fn check_prompt(&self, model: &ModelConfig, prompt_len: usize) -> Result<()> {
        let cap = self.capacity(model)?;
        match (&self.offload, self.plan(model)?) {
            (Some(o), Some(p)) if prompt_len >= cap => bail!(
                "host KV too small for the prompt: {prompt_len} tokens, the engine holds {cap} ({} blocks of {}, --max-model-len {}); raise --num-cpu-blocks or --max-model-len",
                p.num_cpu_blocks,
                o.block_size,
                o.max_model_len
            ),
            _ => engine::check_prompt(&vec![0; prompt_len], cap),
        }
    }
}

/// Makes the CUDA model's expert stream (`--offload-experts`): on the GPU, or on the CPU
/// device in bf16 for the kernel emulator.
pub type ExpertStreamFactory<'a> =
    dyn Fn(&Model, ExpertOffload) -> Result<Box<dyn ExpertSource>> + 'a;

/// Makes the CUDA model's offload engine (on the GPU, or on the CPU device in bf16 for the
/// kernel emulator).
pub type EngineFactory<'a> =
    dyn Fn(&ModelConfig, OffloadConfig) -> Result<Box<dyn OffloadKv<bf16>>> + 'a;

/// A device's KV caches: the offload engine when offloading, and an all-resident cache
/// (the session's own without offload, `generate_resident`'s with it), made on first use.
struct Caches<T> {
    offload: Option<Box<dyn OffloadKv<T>>>,
    resident: Option<Box<dyn KvCache<T>>>,
    /// Drafts per verified round on the offload engine (`SessionConfig::sparse_verify`).
    verify: Option<usize>,
}

impl<T: 'static> Caches<T> {
    fn new(offload: Option<Box<dyn OffloadKv<T>>>, verify: Option<usize>) -> Self {
        Self {
            offload,
            resident: None,
            verify,
        }
    }

    /// The offload engine unless `resident` is asked or there is none; else the resident
    /// cache, made by `make` the first time.
    fn pick(
        &mut self,
        resident: bool,
        make: impl FnOnce() -> Result<Box<dyn KvCache<T>>>,
    ) -> Result<&mut dyn KvCache<T>> {
        match (&mut self.offload, resident) {
            (Some(o), false) => Ok(&mut **o),
            _ => {
                if self.resident.is_none() {
                    self.resident = Some(make()?);
                }
                Ok(&mut **self.resident.as_mut().expect("made above"))
            }
        }
    }
}

/// The CPU model's caches, whatever their element (`SessionConfig::kv_dtype`).
trait CpuCaches {
    fn offload(&mut self) -> Option<&mut dyn OffloadControl>;
    /// One request of at most `cap` tokens on the offload engine, or the resident cache.
    fn run(
        &mut self,
        model: &Arc<Model>,
        resident: bool,
        cap: usize,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<GenerationOutput>;
}

impl<T: KvElem> CpuCaches for Caches<T> {
    fn offload(&mut self) -> Option<&mut dyn OffloadControl> {
        self.offload.as_deref_mut().map(|o| o as _)
    }

    fn run(
        &mut self,
        model: &Arc<Model>,
        resident: bool,
        cap: usize,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<GenerationOutput> {
        let c = &model.cfg;
        if let (Some(k), false, Some(kv)) = (self.verify, resident, self.offload.as_deref_mut()) {
            return engine::verified::generate_verified(
                &**model, kv, cap, prompt, opts, k, on_token,
            );
        }
        let kv = self.pick(resident, || {
            let kv = ContiguousKv::<T>::for_model(c, cap);
            Ok(Box::new(kv))
        })?;
        engine::generate_with(model, kv, cap, prompt, opts, on_token)
    }
}

/// The model on its device, with its caches.
enum Backend {
    Cpu(Box<dyn CpuCaches>),
    Cuda(Box<CudaModel>, Caches<bf16>),
}

pub struct Session {
    model: Arc<Model>,
    cfg: SessionConfig,
    capacity: usize,
    backend: Backend,
}

impl Session {
    /// On the CPU, or on GPU 0 with the weights uploaded in bf16.
    pub fn new(model: Arc<Model>, cfg: SessionConfig) -> Result<Self> {
        if cfg.device == DeviceKind::Cpu {
            let capacity = cfg.capacity(&model.cfg)?;
            let backend = crate::with_kv_elem!(cfg.kv_dtype, T => {
                let offload = match &cfg.offload {
                    Some(o) => Some(Box::new(OffloadEngine::<CpuOffloadDevice<T>>::on_cpu(&model.cfg, o.clone())?) as _),
                    None => None,
                };
                Backend::Cpu(Box::new(Caches::<T>::new(offload, cfg.sparse_verify)))
            });
            return Ok(Self {
                model,
                cfg,
                capacity,
                backend,
            });
        }
        crate::device::check_available(DeviceKind::Cuda)?;
        let dev = Arc::new(crate::device::cuda::context::CudaDevice::new(0)?);
        let compute = dev.new_stream()?;
        let exec: Arc<dyn Exec> = Arc::new(CudaExec::new(dev.clone(), compute.clone())?);
        let engine = |m: &ModelConfig, o: OffloadConfig| -> Result<Box<dyn OffloadKv<bf16>>> {
            let (d, st) = (dev.clone(), compute.clone());
            Ok(Box::new(crate::offload::cuda_device::offload_engine(
                d, st, m, o,
            )?))
        };
        let experts = |m: &Model, o: ExpertOffload| -> Result<Box<dyn ExpertSource>> {
            let (d, st) = (dev.clone(), compute.clone());
            let d = crate::offload::cuda_device::CudaOffloadDevice::new(d, st, 1)?;
            Ok(Box::new(ExpertStream::new(d, m, o)?))
        };
        Self::on_exec_streaming(model, cfg, exec, &engine, &experts)
    }

    /// The CUDA model on any executor (the GPU, or the kernel emulator in tests), with
    /// offload engines from `engine`; no expert stream.
    pub fn on_exec(
        model: Arc<Model>,
        cfg: SessionConfig,
        exec: Arc<dyn Exec>,
        engine: &EngineFactory<'_>,
    ) -> Result<Self> {
        let none = |_: &Model, _: ExpertOffload| -> Result<Box<dyn ExpertSource>> {
            bail!("this executor has no expert stream")
        };
        Self::on_exec_streaming(model, cfg, exec, engine, &none)
    }

    /// `on_exec`, with the expert stream (`--offload-experts`) from `experts`.
    pub fn on_exec_streaming(
        model: Arc<Model>,
        cfg: SessionConfig,
        exec: Arc<dyn Exec>,
        engine: &EngineFactory<'_>,
        experts: &ExpertStreamFactory<'_>,
    ) -> Result<Self> {
        let capacity = cfg.capacity(&model.cfg)?;
        let c = &model.cfg;
        let place = match cfg.offload_experts {
            Some(_) => ExpertPlace::Streamed,
            None => ExpertPlace::Resident,
        };
        let w = CudaWeights::from_model_placed(&*exec, &model, place)?;
        let mut gpu = CudaModel::new(exec, c.clone(), w, capacity)?;
        if let Some(o) = cfg.offload_experts {
            gpu.stream_experts(experts(&model, o)?);
        }
        let offload = cfg.offload.clone().map(|o| engine(c, o)).transpose()?;
        let caches = Caches::new(offload, cfg.sparse_verify);
        Ok(Self {
            backend: Backend::Cuda(Box::new(gpu), caches),
            model,
            cfg,
            capacity,
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Tokens one request may hold (prompt + output).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The offload engine, when offloading.
    fn offload(&mut self) -> Option<&mut dyn OffloadControl> {
        match &mut self.backend {
            Backend::Cpu(c) => c.offload(),
            Backend::Cuda(_, c) => c.offload.as_deref_mut().map(|o| o as _),
        }
    }

    /// Sparse decode's prefetch hits and misses over the last request, when sparse.
    pub fn sparse_stats(&mut self) -> Option<crate::sparse::SparseStats> {
        self.offload().and_then(|o| o.sparse_stats())
    }

    /// The offload engine's memory plan, when offloading.
    pub fn plan(&mut self) -> Option<MemoryPlan> {
        self.offload().map(|o| o.plan())
    }

    /// One request to completion, `on_token` called with each new token; with
    /// `trace_out`, the request's trace is written there.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<GenerationOutput> {
        let trace = self.cfg.trace_out.clone();
        if let Some(o) = self.offload() {
            o.set_tracing(trace.is_some())?;
        }
        let out = self.run(false, prompt, opts, on_token)?;
        if let (Some(path), Some(o)) = (trace, self.offload()) {
            let events = o.take_trace()?;
            crate::offload::trace::write_chrome_trace(&path, &events)?;
            eprintln!("trace: {} ops written to {}", events.len(), path.display());
        }
        Ok(out)
    }

    /// The same request with every layer's KV resident, on the same device and model
    /// (`needle --compare-offload`): offload must not change a bit.
    pub fn generate_resident(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<GenerationOutput> {
        self.run(true, prompt, opts, on_token)
    }

    /// One request on the offload engine or the resident cache.
    fn run(
        &mut self,
        resident: bool,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<GenerationOutput> {
        // `SessionConfig::capacity`, the one rule: the offload engine, the resident caches
        // and the CUDA model's positions are all sized by it.
        let (cap, c) = (self.capacity, &self.model.cfg);
        engine::check_prompt(prompt, cap)?;
        match &mut self.backend {
            Backend::Cpu(caches) => caches.run(&self.model, resident, cap, prompt, opts, on_token),
            Backend::Cuda(gpu, caches) => {
                if let (Some(k), false, Some(kv)) =
                    (caches.verify, resident, caches.offload.as_deref_mut())
                {
                    let gpu: &mut CudaModel = gpu;
                    return engine::verified::generate_verified(
                        gpu, kv, cap, prompt, opts, k, on_token,
                    );
                }
                let kv = caches.pick(resident, || {
                    let kv = ResidentKv::for_model(gpu.exec(), c, cap)?;
                    Ok(Box::new(kv))
                })?;
                let profile = if resident { None } else { self.cfg.profile };
                run_cuda(gpu, kv, cap, prompt, opts, profile, on_token)
            }
        }
    }
}

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
fn run_cuda(
    model: &mut CudaModel,
    kv: &mut dyn KvCache<bf16>,
    capacity: usize,
    prompt: &[u32],
    opts: &GenerateOptions,
    profile: Option<ProfileSteps>,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<GenerationOutput> {
    kv.reset()?;
    let mut profiling = false;
    let mut forward = |tokens: &[u32], pos0: usize, step: Option<usize>| -> Result<Vec<f32>> {
        if let (Some(p), Some(step)) = (profile, step) {
            if p.start == step {
                crate::device::cuda::context::profiler_start()?;
                profiling = true;
            }
        }
        let logits = model.forward(tokens, pos0, kv)?;
        if let (Some(p), Some(step), true) = (profile, step, profiling) {
            if p.end == step + 1 {
                crate::device::cuda::context::profiler_stop()?;
                profiling = false;
            }
        }
        Ok(logits)
    };
    let out = crate::engine::run_loop(capacity, prompt, opts, &mut forward, on_token)?;
    if profiling {
        crate::device::cuda::context::profiler_stop()?;
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
