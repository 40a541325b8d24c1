//! The serving path: continuous batching over a paged KV cache, where preemption offloads
//! a request's exclusive KV blocks to host memory instead of recomputing them.
//!
//! Scheduler side (metadata only): `residency` (block state machine), `block_manager`
//! (logical blocks, pages, host slots, prefix cache), `scheduler` (policy, job creation).
//! Worker side (KV memory): `device_pages` (both tiers' pages on an `OffloadDevice`, the one
//! page pool of every device, and the host tier's transfers), `runner` (the model's
//! batched forward over them), `setup` (which model and device pair, and the tiers on it).
//! Between them: `transfer` (jobs and the backend trait). `cache_events`: what enters and
//! leaves the prefix cache, per tier (the source of the server's KV-cache events). `disk`:
//! the third tier (slot file, IO threads, staging through the device's host memory,
//! integrity checks, the restart-surviving prefix index). `engine` drives both; `bench` is
//! `strata bench serve`.

pub mod bench;
pub mod block_key;
pub mod block_manager;
pub mod cache_events;
pub mod device_pages;
pub mod disk;
pub mod engine;
pub mod residency;
pub mod runner;
pub mod scheduler;
pub mod setup;
pub mod transfer;

pub use engine::{Engine, EngineConfig, EngineStats, NewLogprobs, RequestParams};
pub use scheduler::SchedulerConfig;
