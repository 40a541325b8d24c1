//! The serving path: continuous batching over a paged KV cache, where preemption offloads
//! a request's exclusive KV blocks to host memory instead of recomputing them.
//!
//! Scheduler side (metadata only): `residency` (block state machine), `block_manager`
//! (logical blocks, pages, host slots, prefix cache), `scheduler` (policy, job creation).
//! Worker side (KV memory): `runner` (the `BatchRunner` seam; the CPU device's paged KV,
//! forward calls and transfer backend), `device_pages` (the same on an `OffloadDevice` with
//! the CUDA model: the GPU, or the kernel emulator in tests).
//! Between them: `transfer` (jobs and the backend trait). `disk`: the third tier (slot
//! file, IO threads, integrity checks, the restart-surviving prefix index). `engine` drives both; `bench`
//! is `strata bench serve`.

pub mod bench;
pub mod block_manager;
pub mod device_pages;
pub mod disk;
pub mod engine;
pub mod residency;
pub mod runner;
pub mod scheduler;
pub mod transfer;

pub use engine::{Engine, EngineConfig, EngineHandle, EngineStats, RequestParams};
pub use scheduler::SchedulerConfig;
