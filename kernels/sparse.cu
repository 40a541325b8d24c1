// Sparse decode (docs/offload.md, "Sparse decode"): the page metadata and Quest's bound of
// each page's attention score. The host (crate::sparse) holds the reference of both, and
// combines the per-head bounds into page scores and chooses the pages.
#include "common.cuh"

// Channel-wise min and max of K over each page of `page_size` rows: one thread per
// (page, channel), reading the page's rows in order. Min and max of bf16 values are bf16
// values, so the bounds stay bf16 and exact. A value replaces the running min (max) only
// when strictly below (above) it, the first row's value starting it, exactly as
// crate::sparse::page_bounds does (so ±0 and NaN resolve the same way on both).
extern "C" __global__ void page_bounds(
    const bf16* __restrict__ keys,  // [pages * page_size, row]
    bf16* __restrict__ bounds,      // [pages, 2, row]: min row, then max row
    int pages, int page_size, int row) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)pages * row) return;
    const long long p = i / row, c = i % row;
    const bf16* k = keys + p * page_size * row + c;
    bf16 lo = k[0], hi = k[0];
    float flo = bf16_to_f32(lo), fhi = flo;
    for (int t = 1; t < page_size; ++t) {
        const bf16 x = k[(long long)t * row];
        const float f = bf16_to_f32(x);
        if (f < flo) { lo = x; flo = f; }
        if (f > fhi) { hi = x; fhi = f; }
    }
    bounds[p * 2 * row + c] = lo;
    bounds[p * 2 * row + row + c] = hi;
}

// Quest's bound of every page for every query head: out[p, h] = Σ_c max(q_c · min_c,
// q_c · max_c) over head h's channels of its KV head (GQA: query head h reads KV head
// h / (num_heads / num_kv_heads)). One thread per (page, head), channels summed in order
// with rounded multiplies and adds (no FMA contraction), the reference's arithmetic, so
// both choose the same pages.
extern "C" __global__ void head_bounds(
    const bf16* __restrict__ q,       // [num_heads, head_dim] (one token, post-RoPE)
    const bf16* __restrict__ bounds,  // [pages, 2, num_kv_heads * head_dim]
    float* __restrict__ out,          // [pages, num_heads]
    int pages, int num_heads, int num_kv_heads, int head_dim) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)pages * num_heads) return;
    const int p = (int)(i / num_heads), h = (int)(i % num_heads);
    const int row = num_kv_heads * head_dim;
    const int g = h / (num_heads / num_kv_heads);
    const bf16* lo = bounds + (long long)p * 2 * row + g * head_dim;
    const bf16* hi = lo + row;
    const bf16* qh = q + (long long)h * head_dim;
    float s = 0.0f;
    for (int c = 0; c < head_dim; ++c) {
        const float qc = bf16_to_f32(qh[c]);
        const float a = __fmul_rn(qc, bf16_to_f32(lo[c]));
        const float b = __fmul_rn(qc, bf16_to_f32(hi[c]));
        s = __fadd_rn(s, a > b ? a : b);
    }
    out[i] = s;
}
