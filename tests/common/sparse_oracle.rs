//! The oracle of a small-budget sparse decode step, on any KV element (f32 for the CPU
//! model, bf16 for the CUDA model on the kernel emulator, whose device memory is host
//! memory): `strata::sparse::replay::Replay`, every layer resident, the chosen pages and
//! the window copied into a scratch slot in position order by the host references (no
//! prefetch, no prediction, no misses, no kernels). The offload engine must give the same
//! bits. (The same cache drives `bench sparse-eval`, so the evaluation measures what the
//! engine would choose.)

#[allow(unused_imports)] // used by the sparse suites, not by every test that shares common/
pub use strata::sparse::replay::Replay as Oracle;
