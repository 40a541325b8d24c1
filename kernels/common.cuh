// Shared helpers for every kernel. bf16 travels as `unsigned short` (its bit pattern) so
// NVRTC needs no CUDA headers: widening is a shift, narrowing rounds to nearest even.
#pragma once

typedef unsigned short bf16;

#ifndef INFINITY  // from math.h, which NVRTC has no copy of
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float bf16_to_f32(bf16 h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `part` may still be read by a previous call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? part[lane] : -INFINITY;
    return warp_max(v);
}
