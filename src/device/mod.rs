//! Devices. The CPU device computes in f32 and is the reference for every CUDA kernel;
//! `cuda` runs the model in bf16 on an NVIDIA GPU, and probes for a driver first so
//! `--device cuda` fails with one line where there is none.

pub mod bf16;
pub mod cpu;
pub mod cuda;
pub mod handles;
pub mod order;
pub mod ptr;

pub use ptr::DevPtr;

use anyhow::Result;

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// Checks that the chosen device can run here, with a one-line reason when it cannot.
pub fn check_available(kind: DeviceKind) -> Result<()> {
    match kind {
        DeviceKind::Cpu => Ok(()),
        DeviceKind::Cuda => {
            // One line naming the missing library; the GPU itself is opened later.
            cuda::probe()
        }
    }
}
