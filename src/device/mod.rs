//! Devices. The CPU device computes in f32 and is the reference for every CUDA kernel;
//! `cuda` probes for a driver so `--device cuda` fails cleanly where there is none.

pub mod cpu;
pub mod cuda;

use anyhow::{bail, Result};

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

/// Checks that the chosen device can run here, with a one-line reason when it cannot.
pub fn check_available(kind: DeviceKind) -> Result<()> {
    match kind {
        DeviceKind::Cpu => Ok(()),
        DeviceKind::Cuda => {
            cuda::probe()?;
            bail!("the CUDA device is not implemented yet in this build; use --device cpu")
        }
    }
}
