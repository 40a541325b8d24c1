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

/// What only some devices do: each `--flag` that names one is refused on the others, here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    /// `--sim-link-gbps`: a throttled host↔device link (the CPU device's copy streams).
    SimulatedLink,
    /// `--sanitize`: random copy delays and NaN poison (the CPU device's copy streams).
    Sanitizer,
    /// `--profile-steps`: decode steps bracketed for the CUDA profiler.
    ProfilerRange,
}

impl Feature {
    fn flag(self) -> &'static str {
        match self {
            Feature::SimulatedLink => "--sim-link-gbps",
            Feature::Sanitizer => "--sanitize",
            Feature::ProfilerRange => "--profile-steps",
        }
    }
}

impl DeviceKind {
    /// Bytes of one KV element: f32 on the CPU device (its reference precision), bf16 on
    /// CUDA.
    pub fn kv_elem_bytes(self) -> usize {
        match self {
            DeviceKind::Cpu => 4,
            DeviceKind::Cuda => 2,
        }
    }

    pub fn supports(self, f: Feature) -> bool {
        match f {
            Feature::SimulatedLink | Feature::Sanitizer => self == DeviceKind::Cpu,
            Feature::ProfilerRange => self == DeviceKind::Cuda,
        }
    }

    /// Errors unless this device does `f`, with the one line every front end prints.
    pub fn require(self, f: Feature) -> Result<()> {
        if self.supports(f) {
            return Ok(());
        }
        let only = match f {
            Feature::SimulatedLink => "throttles the CPU device's copies only; the CUDA device uses the real link",
            Feature::Sanitizer => "delays and poisons the CPU device's copies only; on CUDA use STRATA_CHECK_ORDER=1 for the stream-ordering checker",
            Feature::ProfilerRange => "needs --device cuda (it brackets decode steps for the CUDA profiler)",
        };
        anyhow::bail!("{} {only}", f.flag())
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
