//! The CPU device: f32 compute ops (the reference twins of the CUDA kernels) and the
//! stored weight formats they read (and, in the `q8` mode, integer dots over them).

pub mod dot;
pub mod fused;
pub mod ops;
pub mod packed;
pub mod q8;
pub mod quant;
pub mod rows;
pub mod stream;
pub mod twins;
