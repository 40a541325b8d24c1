//! The CUDA device skeleton: one context (event tracking off), streams and events mapped
//! 1:1 to CUDA's, pinned host memory, async copies, kernels compiled and loaded on first
//! use, and cuBLAS GEMMs. Runs only where a GPU is; compiles anywhere.

use super::nvrtc;
use anyhow::{anyhow, bail, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr,
    PinnedHostSlice, ValidAsZeroBits,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One GPU. Kernels are compiled for its own architecture on first use.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    arch: String, // "sm_90"
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
}

fn drv<T>(what: &str, r: Result<T, cudarc::driver::DriverError>) -> Result<T> {
    r.map_err(|e| anyhow!("{what} failed: {e:?}"))
}

impl CudaDevice {
    /// Probes the libraries first: `CudaContext::new` panics without a driver.
    pub fn new(ordinal: usize) -> Result<Self> {
        super::probe()?;
        drv("cuInit", cudarc::driver::result::init())?;
        let n = drv("cuDeviceGetCount", CudaContext::device_count())?;
        if ordinal as i32 >= n {
            bail!("CUDA device {ordinal} not found ({n} present)");
        }
        let ctx = drv("creating the CUDA context", CudaContext::new(ordinal))?;
        // SAFETY: right after creation, before any allocation or launch. cudarc would
        // otherwise record and wait on events around every launch and copy, which costs
        // and hides the stream ordering the runtime sets up itself.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = drv("reading the compute capability", ctx.compute_capability())?;
        Ok(Self {
            ctx,
            arch: format!("sm_{major}{minor}"),
            modules: Mutex::new(HashMap::new()),
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// `sm_<major><minor>`, the architecture kernels are compiled for.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown GPU".into())
    }

    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        drv("cuStreamCreate", self.ctx.new_stream())
    }

    /// An event without timing (cheaper to record and wait on).
    pub fn new_event(&self) -> Result<CudaEvent> {
        drv(
            "cuEventCreate",
            self.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)),
        )
    }

    /// Pinned host memory, *not* write-combined (flags 0): `alloc_pinned`'s
    /// write-combined memory is very slow for the CPU to read, and offload reads it back.
    pub fn alloc_pinned<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<PinnedHostSlice<T>> {
        // SAFETY: the memory is uninitialised; callers write before they read.
        drv("cuMemHostAlloc", unsafe {
            self.ctx.alloc_pinned_with_flags::<T>(len, 0)
        })
    }

    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        drv("cuMemAlloc", stream.alloc_zeros::<T>(len))
    }

    /// `extern "C"` kernel `name` from `kernels/<source>`: compiled (or read from the
    /// CUBIN cache) and loaded on first use, then shared.
    pub fn function(&self, source: &str, name: &str) -> Result<CudaFunction> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let module = match modules.get(source) {
            Some(m) => m.clone(),
            None => {
                let cubin = nvrtc::compile_kernel(source, &self.arch)?;
                let m = drv(
                    &format!("loading {source}"),
                    self.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)),
                )?;
                modules.insert(source.to_string(), m.clone());
                m
            }
        };
        drv(
            &format!("finding {name} in {source}"),
            module.load_function(name),
        )
    }

    /// A cuBLAS handle bound to `stream`.
    pub fn blas(&self, stream: &Arc<CudaStream>) -> Result<CudaBlas> {
        CudaBlas::new(stream.clone()).map_err(|e| anyhow!("cublasCreate failed: {e:?}"))
    }

    pub fn synchronize(&self) -> Result<()> {
        drv("cuCtxSynchronize", self.ctx.synchronize())
    }
}

/// Copies host → device on `stream` (cuMemcpyHtoDAsync; truly async from pinned memory).
pub fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, src: &[T]) -> Result<CudaSlice<T>> {
    drv("cuMemcpyHtoDAsync", stream.clone_htod(src))
}

/// `--profile-steps A:B`: the profiler captures only between these calls.
pub fn profiler_start() -> Result<()> {
    drv("cuProfilerStart", cudarc::driver::profiler_start())
}

pub fn profiler_stop() -> Result<()> {
    drv("cuProfilerStop", cudarc::driver::profiler_stop())
}
