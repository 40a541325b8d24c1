//! Building a serving engine: the one place that pairs a device with its model and KV
//! element, and puts the tiers on it. Every engine is the same assembly — pages on an
//! `OffloadDevice` (`DevicePages`), the host tier's jobs as copies on its streams, the disk
//! tier staging through its host memory, a model's batched forward over the pages — with
//! one of three pairs:
//!
//! | `--device` | model | KV pages | element |
//! | --- | --- | --- | --- |
//! | `cpu` | the CPU model (`CpuForward<T>`) | `CpuOffloadDevice<T>` | `--kv-dtype`: f32, bf16, f16 |
//! | `cuda` | the CUDA model | `CudaOffloadDevice` on GPU 0 | bf16 |
//! | (tests) | the CUDA model on the kernel emulator | `CpuOffloadDevice<bf16>` | bf16 |

use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};

use super::block_key::KeySeed;
use super::device_pages::{layer_pages, DevicePages, DeviceTransfers, WindowLayers};
use super::disk::backend::{DiskBackend, TieredBackend};
use super::disk::store::{SlotIo, StoreLayout};
use super::disk::DiskTier;
use super::engine::{Engine, EngineConfig, EngineStats};
use super::runner::{BatchForward, CpuForward, DeviceRunner};
use super::scheduler::{window_pool_pages, Scheduler, SchedulerConfig};
use super::transfer::TransferBackend;
use crate::device::cuda::exec::{CudaExec, Exec};
use crate::device::KvElem;
use crate::device::{DeviceKind, Feature, KvDtype};
use crate::model::cuda::weights::CudaWeights;
use crate::model::cuda::CudaModel;
use crate::model::{Model, ModelConfig};
use crate::offload::cuda_device::CudaOffloadDevice;
use crate::offload::device::OffloadDevice;
use crate::offload::CpuOffloadDevice;

type WrapBackend<'a> = Box<dyn FnOnce(Box<dyn TransferBackend>) -> Box<dyn TransferBackend> + 'a>;
type WrapIo<'a> = Box<dyn FnOnce(Box<dyn SlotIo>) -> Box<dyn SlotIo> + 'a>;

/// Test seams: wrap the transfer backend (late and failed completions) or the disk
/// store's IO (disk faults). Production engines use `Hooks::default()`.
#[derive(Default)]
pub struct Hooks<'a> {
    pub wrap_backend: Option<WrapBackend<'a>>,
    pub wrap_io: Option<WrapIo<'a>>,
}

/// The sliding-window layers' own page pool for serving `model` (`None` when every layer
/// attends everything): a block's pages there are freed once no sequence's window reaches
/// it, so those layers hold `window_pool_pages` pages (+ the null page) instead of
/// `num_gpu_blocks`.
pub fn window_pool(model: &ModelConfig, sched: &SchedulerConfig) -> Option<WindowLayers> {
    let window = model.widest_window()?;
    Some(WindowLayers {
        layers: (0..model.num_layers)
            .map(|l| model.window(l).is_some())
            .collect(),
        pages: window_pool_pages(sched, window),
    })
}

/// Bytes of the device tier's KV pages: every full layer's `num_gpu_blocks` pages, every
/// window-pool layer's pool, nothing for a state layer; `None` if it overflows.
pub fn device_kv_bytes(model: &ModelConfig, sched: &SchedulerConfig, elem: usize) -> Option<usize> {
    let page = model.kv_layer_bytes(sched.block_size, elem)?;
    let window = window_pool(model, sched);
    let kv_layers = (0..model.num_layers).filter(|&l| model.keeps_kv(l));
    kv_layers.into_iter().try_fold(0usize, |sum, l| {
        let pages = layer_pages(window.as_ref(), l, sched.num_gpu_blocks);
        sum.checked_add(page.checked_mul(pages)?)
    })
}

/// The device tier's KV in one line: its bytes and, for a model with sliding-window layers,
/// what their window pool holds against a pool that kept every block in every layer.
pub fn kv_plan(model: &ModelConfig, sched: &SchedulerConfig, elem: usize) -> String {
    let mib = |b: Option<usize>| {
        b.map_or("(overflow)".into(), |b| {
            format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
        })
    };
    let bytes = mib(device_kv_bytes(model, sched, elem));
    match (window_pool(model, sched), model.widest_window()) {
        (Some(w), Some(size)) => {
            let every = model
                .kv_bytes(sched.block_size, elem)
                .and_then(|b| b.checked_mul(sched.num_gpu_blocks));
            let n = w.layers.iter().filter(|&&x| x).count();
            format!(
                "device KV {bytes}: {} full-attention layers × {} blocks, {n} sliding-window layers (window {size}) × a pool of {} pages freed as windows move on ({} if every layer kept every block)",
                model.num_layers - n,
                sched.num_gpu_blocks,
                w.pages + 1,
                mib(every)
            )
        }
        _ if model.has_state_layers() => format!(
            "device KV {bytes}: {} full-attention layers × {} blocks; {} state layers keep no KV but a {:.1} MiB recurrent state per running or preempted request, where the model computes (host memory on the CPU device, GPU memory on CUDA)",
            model.kv_layers(),
            sched.num_gpu_blocks,
            model.num_layers - model.kv_layers(),
            crate::kv::RecurrentStates::for_model(model).seq_bytes() as f64 / (1 << 20) as f64
        ),
        _ => format!(
            "device KV {bytes}: {} layers × {} blocks",
            model.num_layers, sched.num_gpu_blocks
        ),
    }
}

/// Bytes of host memory the KV pages of `sched` take on `device` in elements `kv`: both
/// tiers on the CPU device (its "device" memory is host memory), the host tier alone on
/// CUDA (pinned); `None` if it overflows.
pub fn host_kv_bytes(
    model: &ModelConfig,
    sched: &SchedulerConfig,
    device: DeviceKind,
    kv: KvDtype,
) -> Option<usize> {
    let block = model.kv_bytes(sched.block_size, kv.bytes())?;
    let host = block.checked_mul(sched.max_cpu_offload_blocks)?;
    match device {
        DeviceKind::Cpu => host.checked_add(device_kv_bytes(model, sched, kv.bytes())?),
        DeviceKind::Cuda => Some(host),
    }
}

/// The serving engine for `device`: the CPU model on the CPU device, or the CUDA model on
/// GPU 0 (`strata serve`, `strata bench serve`).
pub fn engine_for(device: DeviceKind, model: &Arc<Model>, cfg: &EngineConfig) -> Result<Engine> {
    match device {
        DeviceKind::Cpu => cpu_engine(model, cfg, Hooks::default()),
        DeviceKind::Cuda => gpu_engine(model, cfg),
    }
}

/// The CPU model over pages on the CPU device in `cfg.kv_dtype`, its copy streams on
/// worker threads (link throttle and sanitizer delays as configured).
pub fn cpu_engine(model: &Arc<Model>, cfg: &EngineConfig, hooks: Hooks<'_>) -> Result<Engine> {
    crate::with_kv_elem!(cfg.kv_dtype, T => {
        let d = CpuOffloadDevice::<T>::new(cfg.link_gbps, cfg.sanitize, 1)?;
        on_device(model, cfg, CpuForward::<T>::new(Arc::clone(model)), d, hooks)
    })
}

/// The CUDA model on GPU 0, its pages on the GPU's offload device sharing the model's
/// compute stream.
pub fn gpu_engine(model: &Model, cfg: &EngineConfig) -> Result<Engine> {
    if cfg.link_gbps > 0.0 {
        DeviceKind::Cuda.require(Feature::SimulatedLink)?;
    }
    if cfg.sanitize {
        DeviceKind::Cuda.require(Feature::Sanitizer)?;
    }
    crate::device::check_available(DeviceKind::Cuda)?;
    let dev = Arc::new(crate::device::cuda::context::CudaDevice::new(0)?);
    let compute = dev.new_stream()?;
    let exec: Arc<dyn Exec> = Arc::new(CudaExec::new(dev.clone(), compute.clone())?);
    let d = CudaOffloadDevice::new(dev, compute, 1)?;
    cuda_model_engine(model, cfg, exec, d)
}

/// The CUDA model on `exec`, its pages on `d` (which must share `exec`'s compute stream):
/// the GPU, or the kernel emulator in tests (`crate::gpucheck::emu::emulator_serve_engine`).
pub fn cuda_model_engine<D>(
    model: &Model,
    cfg: &EngineConfig,
    exec: Arc<dyn Exec>,
    d: D,
) -> Result<Engine>
where
    D: OffloadDevice<Elem = half::bf16> + Send + 'static,
{
    let (c, s) = (&model.cfg, &cfg.sched);
    DeviceKind::Cuda.kv_dtype(Some(cfg.kv_dtype))?;
    s.validate()?;
    // No sequence outgrows the device tier, which bounds the RoPE tables and scratch.
    let max_pos = c
        .max_position_embeddings
        .min(s.num_gpu_blocks * s.block_size);
    let w = CudaWeights::from_model(&*exec, model)?;
    let gpu = CudaModel::new(exec, c.clone(), w, max_pos)?;
    on_device(model, cfg, gpu, d, Hooks::default())
}

/// The engine assembly: `model`'s configuration (and weights, for the disk tier's
/// fingerprint), `forward` over pages on `d`.
pub fn on_device<M, D>(
    model: &Model,
    cfg: &EngineConfig,
    forward: M,
    d: D,
    hooks: Hooks<'_>,
) -> Result<Engine>
where
    M: BatchForward + 'static,
    M::Elem: KvElem,
    D: OffloadDevice<Elem = M::Elem> + Send + 'static,
{
    let (c, s) = (&model.cfg, &cfg.sched);
    if let (Some(dc), n) = (&cfg.disk, s.max_disk_offload_blocks) {
        // The slot file's size and the directory's room before any memory is allocated.
        let block = c
            .kv_bytes(s.block_size, std::mem::size_of::<M::Elem>())
            .context("a KV block's size overflows")?;
        if n > 0 {
            dc.check(n, block)?;
        }
    }
    // With a disk tier, blocks outlive the process: its fingerprint (the weights' checksum
    // too) keys them; without one, the configuration, KV element and block size do.
    let fingerprint = cfg
        .disk
        .as_ref()
        .map(|_| super::disk::fingerprint(model, s.block_size, M::Elem::NAME));
    let key_seed = KeySeed::new(&[
        format!("{c:?}").as_bytes(),
        M::Elem::NAME.as_bytes(),
        &(s.block_size as u64).to_le_bytes(),
        &fingerprint.unwrap_or(0).to_le_bytes(),
    ]);
    let mut sched = Scheduler::with_key_seed(cfg.sched.clone(), key_seed)?;
    let window = window_pool(c, s);
    if let (Some(w), Some(size)) = (&window, c.widest_window()) {
        sched.use_window_pool(size, w.pages)?;
    }
    let sizes = (s.block_size, s.num_gpu_blocks, s.max_cpu_offload_blocks);
    let check = cfg.check_order || cfg.sanitize;
    if c.has_state_layers() {
        sched.without_prefix_reuse();
    }
    let keeps_kv: Vec<bool> = (0..c.num_layers).map(|l| c.keeps_kv(l)).collect();
    let pages = DevicePages::new(d, &keeps_kv, c.kv_dim(), sizes, window, check)?.with_states(c)?;
    let block_bytes = pages.block_bytes();
    let pages = Arc::new(Mutex::new(pages));
    let host: Box<dyn TransferBackend> = Box::new(DeviceTransfers {
        pages: Arc::clone(&pages),
    });
    let mut stats = EngineStats::default();
    let (backend, disk) = match (&cfg.disk, s.max_disk_offload_blocks) {
        (None, 0) => (host, None),
        (None, _) => bail!("--max-disk-offload-blocks needs --disk-offload-dir"),
        (Some(_), 0) => bail!("--disk-offload-dir needs --max-disk-offload-blocks > 0"),
        (Some(dc), n) => {
            let layout = StoreLayout {
                payload_bytes: block_bytes,
                num_slots: n,
            };
            let fp = fingerprint.expect("computed above for a disk tier");
            let wrap_io = hooks.wrap_io.unwrap_or_else(|| Box::new(|io| io));
            let mut tier = DiskTier::open(dc, layout, fp, wrap_io)?;
            let entries = tier.restore_entries(s.block_size);
            tier.restore.adopted = sched.bm.adopt_persisted(&entries);
            stats.restored_prefix_blocks = tier.restore.adopted;
            let store = Arc::clone(&tier.store);
            let disk = DiskBackend::new(Arc::clone(&pages), store, dc.io_threads)?;
            tier.staging_blocks = disk.staging_blocks();
            let disk: Box<dyn TransferBackend> = Box::new(disk);
            let tiered: Box<dyn TransferBackend> = Box::new(TieredBackend { host, disk });
            (tiered, Some(tier))
        }
    };
    let backend = match hooks.wrap_backend {
        Some(wrap) => wrap(backend),
        None => backend,
    };
    let runner = Box::new(DeviceRunner {
        model: forward,
        pages,
    });
    Ok(Engine::assemble(
        c.clone(),
        sched,
        (runner, backend),
        disk,
        stats,
    ))
}
