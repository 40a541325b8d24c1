// RMSNorm family, one block per row, f32 accumulation: plain, fused residual add (of a
// plain or, Gemma's sandwich norms, a normed delta), and per-head (q/k norm).
#include "common.cuh"

extern "C" __global__ void rms_norm(
    const bf16* __restrict__ x,  // [rows, dim]
    const bf16* __restrict__ w,  // [dim]
    bf16* __restrict__ out,      // [rows, dim]
    int dim, float eps) {
    const bf16* xr = x + (long long)blockIdx.x * dim;
    bf16* orow = out + (long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = bf16_to_f32(xr[i]);
        ss += v * v;
    }
    const float scale = rsqrtf(block_sum(ss) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        orow[i] = f32_to_bf16(bf16_to_f32(xr[i]) * scale * bf16_to_f32(w[i]));
}

// x += delta(i) (the residual stream, stored back in bf16); out = rms_norm(x) * w. The
// norm uses the stored (rounded) x, so it equals an unfused add followed by rms_norm.
template <typename Delta>
__device__ __forceinline__ void add_norm_row(
    bf16* xr, Delta delta, const bf16* __restrict__ w, bf16* orow, int dim, float eps) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        bf16 s = f32_to_bf16(bf16_to_f32(xr[i]) + delta(i));
        xr[i] = s;
        float v = bf16_to_f32(s);
        ss += v * v;
    }
    const float scale = rsqrtf(block_sum(ss) / dim + eps);
    // Each thread reads back only the elements it wrote, so no barrier is needed.
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        orow[i] = f32_to_bf16(bf16_to_f32(xr[i]) * scale * bf16_to_f32(w[i]));
}

// x += delta; out = rms_norm(x) * w.
extern "C" __global__ void add_rms_norm(
    bf16* __restrict__ x,            // [rows, dim], updated in place
    const bf16* __restrict__ delta,  // [rows, dim]
    const bf16* __restrict__ w,      // [dim]
    bf16* __restrict__ out,          // [rows, dim]
    int dim, float eps) {
    const bf16* dr = delta + (long long)blockIdx.x * dim;
    const long long row = (long long)blockIdx.x * dim;
    add_norm_row(x + row, [&](int i) { return bf16_to_f32(dr[i]); }, w, out + row, dim, eps);
}

// Gemma's sandwich: x += rms_norm(delta) * w_delta (the sublayer output normed before the
// residual add, rounded to bf16 as a stored activation would be); out = rms_norm(x) * w.
extern "C" __global__ void norm_add_rms_norm(
    bf16* __restrict__ x,              // [rows, dim], updated in place
    const bf16* __restrict__ delta,    // [rows, dim]
    const bf16* __restrict__ w_delta,  // [dim]
    const bf16* __restrict__ w,        // [dim]
    bf16* __restrict__ out,            // [rows, dim]
    int dim, float eps) {
    const long long row = (long long)blockIdx.x * dim;
    const bf16* dr = delta + row;
    float ssd = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = bf16_to_f32(dr[i]);
        ssd += v * v;
    }
    const float sd = rsqrtf(block_sum(ssd) / dim + eps);
    const auto normed = [&](int i) {
        return bf16_to_f32(f32_to_bf16(bf16_to_f32(dr[i]) * sd * bf16_to_f32(w_delta[i])));
    };
    add_norm_row(x + row, normed, w, out + row, dim, eps);
}

// One warp per (token, head): head_dim is small (64..256), so a warp reduction suffices.
// Rows are strided so q and k can be normed inside the fused QKV buffer.
extern "C" __global__ void head_rms_norm(
    bf16* __restrict__ x,        // [tokens, row_stride]: heads × head_dim used, in place
    const bf16* __restrict__ w,  // [head_dim]
    int tokens, int heads, int head_dim, int row_stride, float eps) {
    const int warps = blockDim.x >> 5;
    const long long item = (long long)blockIdx.x * warps + (threadIdx.x >> 5);
    if (item >= (long long)tokens * heads) return;
    const int lane = threadIdx.x & 31;
    const long long t = item / heads, h = item % heads;
    bf16* v = x + t * row_stride + h * head_dim;
    float ss = 0.0f;
    for (int i = lane; i < head_dim; i += 32) {
        float f = bf16_to_f32(v[i]);
        ss += f * f;
    }
    const float scale = rsqrtf(warp_sum(ss) / head_dim + eps);
    for (int i = lane; i < head_dim; i += 32)
        v[i] = f32_to_bf16(bf16_to_f32(v[i]) * scale * bf16_to_f32(w[i]));
}
