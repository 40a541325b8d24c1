//! Tooling that validates the CUDA device, kept out of the runtime (dependencies point one
//! way: `gpucheck` → `device`, never back). Driven by the `strata-gpucheck` binary and
//! `scripts/gpu-check.sh`, and by the tests that run without a GPU.
//!
//! - `kernels`: every kernel against its CPU twin on random inputs (gpu-check step 1);
//! - `model_checks`: CUDA model logits vs the CPU model, and greedy generation with and
//!   without offload (steps 2 and 3);
//! - `serve_checks`: the serving path on the CUDA model: batch invariance of the batched
//!   forward, the engine bitwise under preemption, greedy tokens vs the CPU engine (step 6);
//! - `bench`: pinned-memory bandwidth and the offload benchmark (steps 4 and 5);
//! - `emu`: the kernels' own `.cu` sources run on the CPU (`emu/`), an `Exec` for tests,
//!   paired with the offload engine on the CPU device in bf16 (`emulator_offload_engine`).
//!
//! One reference per kernel: its CPU twin (`device::cpu::ops` / `twins`), checked against
//! the kernel's own source on the emulator. The former host twin of the kernels
//! (`HostExec`, each kernel re-implemented on host memory) was retired once the emulator
//! covered everything it did; its GEMM lives on as `emu::host_gemm`.

pub mod bench;
pub mod emu;
pub mod kernels;
pub mod model_checks;
pub mod serve_checks;
