//! bf16 as raw bits (`u16`), the way the CUDA kernels and the bf16 KV store it.

/// bf16 bits → f32.
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 → bf16 bits, round to nearest even (the kernels' `f32_to_bf16`).
pub fn f32_to_bf16(f: f32) -> u16 {
    half::bf16::from_f32(f).to_bits()
}
