//! CUDA availability probe. cudarc loads its libraries dynamically and *panics* when
//! one is missing, so we look for them first and report which one is absent.

use anyhow::{bail, Result};

/// Returns an error naming the first missing CUDA library (driver, NVRTC, cuBLAS).
pub fn probe() -> Result<()> {
    // SAFETY: these only try to dlopen the libraries; no CUDA call is made.
    let driver = std::panic::catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() })
        .unwrap_or(false);
    if !driver {
        bail!("no CUDA driver found (libcuda.so could not be loaded); use --device cpu");
    }
    let nvrtc = std::panic::catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
        .unwrap_or(false);
    if !nvrtc {
        bail!("CUDA driver found but NVRTC (libnvrtc.so) could not be loaded; install the CUDA toolkit or the nvidia-cuda-nvrtc wheel");
    }
    let cublas = std::panic::catch_unwind(|| unsafe { cudarc::cublas::sys::is_culib_present() })
        .unwrap_or(false);
    if !cublas {
        bail!("CUDA driver found but cuBLAS (libcublas.so) could not be loaded; install the CUDA toolkit or the nvidia-cublas wheel");
    }
    Ok(())
}
