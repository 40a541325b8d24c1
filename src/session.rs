//! `Session`: a loaded model on one device with its KV cache, running requests one after
//! another (think `LLM.generate`). It owns the runtime policy every front end shares: the
//! KV element type per device, the offload plan (`SessionConfig::plan`, to print before
//! anything is allocated), the capacity of a request, and trace writing on both devices.
//!
//! ```text
//! CLI / needle / benches ─▶ Session::generate ─▶ engine::run_loop (prefill, decode, sample)
//!   ─▶ Model::forward (CPU, f32) or CudaModel::forward (CUDA, bf16)
//!   ─▶ KvCache seam: ContiguousKv / ResidentKv / OffloadEngine<CPU or CUDA device>
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use half::bf16;

use crate::device::cuda::exec::{CudaExec, Exec};
use crate::device::cuda::generate::{run_cuda, ProfileSteps};
use crate::device::cuda::kv::ResidentKv;
use crate::device::cuda::model::CudaModel;
use crate::device::cuda::weights::CudaWeights;
use crate::device::DeviceKind;
use crate::engine::{self, GenerateOptions, GenerationOutput};
use crate::kv::{ContiguousKv, KvCache};
use crate::model::{Model, ModelConfig};
use crate::offload::{CpuOffloadEngine, MemoryPlan, OffloadConfig, OffloadControl, OffloadKv};

#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub device: DeviceKind,
    /// Tokens one request may hold (prompt + output).
    pub max_len: usize,
    /// Layerwise KV offload with these settings; `None`: every layer's KV resident.
    pub offload: Option<OffloadConfig>,
    /// Write each request's Chrome/Perfetto trace here (offload only).
    pub trace_out: Option<PathBuf>,
    /// CUDA: decode steps bracketed by cuProfilerStart/Stop.
    pub profile: Option<ProfileSteps>,
}

impl SessionConfig {
    pub fn new(device: DeviceKind, max_len: usize) -> Self {
        Self {
            device,
            max_len,
            offload: None,
            trace_out: None,
            profile: None,
        }
    }

    /// Bytes of one KV element: f32 on the CPU device, bf16 on CUDA.
    pub fn kv_elem_bytes(&self) -> usize {
        match self.device {
            DeviceKind::Cpu => 4,
            DeviceKind::Cuda => 2,
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
        if self.profile.is_some() && self.device != DeviceKind::Cuda {
            bail!("--profile-steps needs --device cuda");
        }
        self.offload
            .as_ref()
            .map(|o| o.plan_for(model, self.kv_elem_bytes()))
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

/// Makes the CUDA model's offload engine (on the GPU, or on the CPU device in bf16 for the
/// kernel emulator).
pub type EngineFactory<'a> =
    dyn Fn(&ModelConfig, OffloadConfig) -> Result<Box<dyn OffloadKv<bf16>>> + 'a;

/// A device's KV: resident, or offloaded through the engine.
enum Kv<T> {
    Resident(Box<dyn KvCache<T>>),
    Offload(Box<dyn OffloadKv<T>>),
}

impl<T: 'static> Kv<T> {
    fn cache(&mut self) -> &mut dyn KvCache<T> {
        match self {
            Kv::Resident(kv) => &mut **kv,
            Kv::Offload(kv) => &mut **kv,
        }
    }

    fn offload(&mut self) -> Option<&mut dyn OffloadControl> {
        match self {
            Kv::Resident(_) => None,
            Kv::Offload(kv) => Some(&mut **kv),
        }
    }
}

/// The model on its device with the session's KV and, made on first use, an all-resident
/// KV for `generate_resident`.
enum Backend {
    Cpu {
        kv: Kv<f32>,
        resident: Option<ContiguousKv>,
    },
    Cuda {
        model: Box<CudaModel>,
        kv: Kv<bf16>,
        resident: Option<ResidentKv>,
    },
}

/// Which of a backend's caches a request runs on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Which {
    Session,
    Resident,
}

impl Backend {
    fn offload(&mut self) -> Option<&mut dyn OffloadControl> {
        match self {
            Backend::Cpu { kv, .. } => kv.offload(),
            Backend::Cuda { kv, .. } => kv.offload(),
        }
    }

    /// One request: check, reset the cache, prefill and decode.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        model: &Arc<Model>,
        which: Which,
        capacity: usize,
        profile: Option<ProfileSteps>,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<GenerationOutput> {
        engine::check_prompt(prompt, capacity)?;
        let c = &model.cfg;
        match self {
            Backend::Cpu { kv, resident } => {
                let kv: &mut dyn KvCache<f32> = match which {
                    Which::Session => kv.cache(),
                    Which::Resident => resident.get_or_insert_with(|| resident_cpu(c, capacity)),
                };
                engine::generate_with(model, kv, capacity, prompt, opts, on_token)
            }
            Backend::Cuda {
                model: gpu,
                kv,
                resident,
            } => {
                let kv: &mut dyn KvCache<bf16> = match (which, resident) {
                    (Which::Session, _) => kv.cache(),
                    (Which::Resident, Some(r)) => r,
                    (Which::Resident, r) => r.insert(ResidentKv::new(
                        gpu.exec(),
                        c.num_layers,
                        c.kv_dim(),
                        capacity,
                    )?),
                };
                run_cuda(gpu, kv, capacity, prompt, opts, profile, on_token)
            }
        }
    }
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
        match cfg.device {
            DeviceKind::Cpu => {
                let capacity = cfg.capacity(&model.cfg)?;
                let kv = match &cfg.offload {
                    Some(o) => {
                        Kv::Offload(Box::new(CpuOffloadEngine::on_cpu(&model.cfg, o.clone())?))
                    }
                    None => Kv::Resident(Box::new(resident_cpu(&model.cfg, capacity))),
                };
                let backend = Backend::Cpu { kv, resident: None };
                Ok(Self {
                    model,
                    cfg,
                    capacity,
                    backend,
                })
            }
            DeviceKind::Cuda => {
                crate::device::check_available(DeviceKind::Cuda)?;
                let dev = Arc::new(crate::device::cuda::context::CudaDevice::new(0)?);
                let compute = dev.new_stream()?;
                let exec: Arc<dyn Exec> = Arc::new(CudaExec::new(dev.clone(), compute.clone())?);
                let engine =
                    |m: &ModelConfig, o: OffloadConfig| -> Result<Box<dyn OffloadKv<bf16>>> {
                        let (d, st) = (dev.clone(), compute.clone());
                        Ok(Box::new(crate::device::cuda::offload_dev::offload_engine(
                            d, st, m, o,
                        )?))
                    };
                Self::on_exec(model, cfg, exec, &engine)
            }
        }
    }

    /// The CUDA model on any executor (the GPU, or the kernel emulator in tests), with
    /// offload engines from `engine`.
    pub fn on_exec(
        model: Arc<Model>,
        cfg: SessionConfig,
        exec: Arc<dyn Exec>,
        engine: &EngineFactory<'_>,
    ) -> Result<Self> {
        let capacity = cfg.capacity(&model.cfg)?;
        let c = &model.cfg;
        let w = CudaWeights::from_model(&*exec, &model)?;
        let gpu = CudaModel::new(exec.clone(), c.clone(), w, capacity)?;
        let kv = match &cfg.offload {
            Some(o) => Kv::Offload(engine(c, o.clone())?),
            None => Kv::Resident(Box::new(ResidentKv::new(
                &*exec,
                c.num_layers,
                c.kv_dim(),
                capacity,
            )?)),
        };
        let backend = Backend::Cuda {
            model: Box::new(gpu),
            kv,
            resident: None,
        };
        Ok(Self {
            model,
            cfg,
            capacity,
            backend,
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Tokens one request may hold (prompt + output).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The offload engine's memory plan, when offloading.
    pub fn plan(&mut self) -> Option<MemoryPlan> {
        self.backend.offload().map(|o| o.plan())
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
        if let Some(o) = self.backend.offload() {
            o.set_tracing(trace.is_some())?;
        }
        let (cap, profile) = (self.capacity, self.cfg.profile);
        let out = self.backend.run(
            &self.model,
            Which::Session,
            cap,
            profile,
            prompt,
            opts,
            on_token,
        )?;
        if let (Some(path), Some(o)) = (trace, self.backend.offload()) {
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
        let cap = self.capacity;
        self.backend.run(
            &self.model,
            Which::Resident,
            cap,
            None,
            prompt,
            opts,
            on_token,
        )
    }
}

fn resident_cpu(c: &ModelConfig, capacity: usize) -> ContiguousKv {
    ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, capacity)
}
