// Bias add on GEMM output rows (Qwen2-style q/k/v projection bias): x[t, j] += b[j], in
// place, bf16 in and out (one rounding of the f32 sum).
#include "common.cuh"

extern "C" __global__ void add_bias(
    bf16* __restrict__ x,        // [rows, n]
    const bf16* __restrict__ b,  // [n]
    int rows, int n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * n) return;
    x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(b[i % n]));
}
