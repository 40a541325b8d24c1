//! The CPU device: f32 compute ops (the reference twins of the CUDA kernels).

pub mod dot;
pub mod ops;
pub mod stream;
pub mod twins;
