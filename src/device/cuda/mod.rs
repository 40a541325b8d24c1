//! The CUDA device on cudarc (dynamic loading: builds with no toolkit). cudarc *panics*
//! when a library is missing, so every entry point first finds and loads the libraries
//! itself (`libs`) and fails with one line naming what is absent.
//!
//! Its files are listed in `docs/architecture.md` (the one file map). The tools that
//! validate this device (kernel checks, gpu-check steps, benches, the kernel emulator)
//! live in `crate::gpucheck`; nothing here depends on them.

pub mod context;
pub mod exec;
pub mod libs;
pub mod nvrtc;
pub mod ops;
pub mod sparse;
pub mod trace;

use anyhow::{bail, Result};
use libs::Lib;

/// Returns an error naming the first missing CUDA library (driver, NVRTC, cuBLAS).
pub fn probe() -> Result<()> {
    for lib in [Lib::Driver, Lib::Nvrtc, Lib::Cublas] {
        libs::load(lib)?;
    }
    // cudarc opens the libraries by name; after the preload that resolves to the copies
    // found above. catch_unwind: a library that loads but is unusable must not abort us.
    // SAFETY: these only try to dlopen the libraries; no CUDA call is made.
    let present =
        |f: unsafe fn() -> bool| std::panic::catch_unwind(|| unsafe { f() }).unwrap_or(false);
    if !present(cudarc::driver::sys::is_culib_present) {
        bail!("no CUDA driver found (libcuda.so could not be loaded); use --device cpu");
    }
    if !present(cudarc::nvrtc::sys::is_culib_present) {
        bail!("CUDA driver found but NVRTC (libnvrtc.so) could not be loaded; install the CUDA toolkit or the nvidia-cuda-nvrtc wheel");
    }
    if !present(cudarc::cublas::sys::is_culib_present) {
        bail!("CUDA driver found but cuBLAS (libcublas.so) could not be loaded; install the CUDA toolkit or the nvidia-cublas wheel");
    }
    Ok(())
}
