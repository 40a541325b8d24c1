//! Devices. The CPU device computes in f32 and is the reference for every CUDA kernel;
//! `cuda` runs the model in bf16 on an NVIDIA GPU, and probes for a driver first so
//! `--device cuda` fails with one line where there is none.

pub mod bf16;
pub mod cpu;
pub mod cuda;
pub mod delta;
pub mod handles;
pub mod kv_elem;
pub mod order;
pub mod ptr;

pub use kv_elem::{KvDtype, KvElem};
pub use ptr::DevPtr;

use anyhow::Result;

/// The CPU device's KV element when `--kv-dtype` is not given: f16, half f32's bytes,
/// greedy-equal to HF on the reference prompt and faster at long context (docs/cpu.md has
/// the agreement and speed numbers; f32 stays the reference, `--kv-dtype f32`).
pub const CPU_KV_DTYPE: KvDtype = KvDtype::F16;

/// A gated MLP's activation, `act(gate) * up`; each device has one kernel per kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpAct {
    /// SwiGLU (Llama, Qwen).
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// An expert's gate activation (a mixture of experts' MLPs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertAct {
    /// gpt-oss: `(clamp(up, ±limit) + 1) · g · σ(alpha · g)`, `g = min(gate, limit)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
    /// SwiGLU, `SiLU(gate) · up` (Qwen3.5 MoE).
    Silu,
}

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
    /// The KV element this device stores for `asked` (`--kv-dtype`; `None`: the device's
    /// default): the CPU device holds any of them (f32 is its reference), CUDA's kernels
    /// read bf16 only.
    pub fn kv_dtype(self, asked: Option<KvDtype>) -> Result<KvDtype> {
        match (self, asked) {
            (DeviceKind::Cpu, None) => Ok(CPU_KV_DTYPE),
            (DeviceKind::Cpu, Some(d)) | (DeviceKind::Cuda, Some(d @ KvDtype::Bf16)) => Ok(d),
            (DeviceKind::Cuda, None) => Ok(KvDtype::Bf16),
            (DeviceKind::Cuda, Some(d)) => {
                anyhow::bail!("--kv-dtype {d} is a CPU option: the CUDA device stores KV in bf16")
            }
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
