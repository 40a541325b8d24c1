//! strata: an LLM inference runtime built around layerwise KV-cache offload.
//!
//! Layout (the file map lives in docs/architecture.md): `session` (run a request: the
//! library entry point), `model` (config, weights, tokenizer, the layer loop), `device`
//! (compute ops and devices), `kv` (the KV seam and resident caches), `offload` (the one
//! layerwise offload engine and its CPU device), `engine` (generation loop, sampling),
//! `serve` (continuous batching over a paged KV cache with host offload), `server`
//! (`strata serve`, the OpenAI-compatible HTTP server over it).

pub mod agreement;
pub mod bounded;
pub mod device;
pub mod engine;
pub mod errors;
pub mod flags;
pub mod fuzz;
pub mod gpucheck;
pub mod kv;
pub mod model;
pub mod needle;
pub mod offload;
pub mod output;
pub mod perplexity;
pub mod ruler;
pub mod safe_file;
pub mod serve;
pub mod server;
pub mod session;
pub mod sparse;
pub mod threads;

pub use session::{Session, SessionConfig};
