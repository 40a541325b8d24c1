// Sparse decode (docs/offload.md, "Sparse decode"): the page metadata and the box bound of
// each page's attention score. The host (crate::sparse) holds the reference of both, and
// combines the per-head bounds into page scores and chooses the pages.
#include "common.cuh"

#define MASK_TOKENS 16  // tokens per mask row: the bits of a bf16 element

// Mask rows per plane (one plane per key bit): ceil(page_size / 16).
__device__ __forceinline__ int plane_rows(int page_size) {
    return (page_size + MASK_TOKENS - 1) / MASK_TOKENS;
}

// Rows of metadata per page: min, max, then key_bits mask planes (crate::sparse::meta_rows).
__device__ __forceinline__ int meta_rows(int page_size, int key_bits) {
    return 2 + key_bits * plane_rows(page_size);
}

// The split between a box's lower and upper half (crate::sparse::mid).
__device__ __forceinline__ float half_split(float lo, float hi) {
    const float m = __fadd_rn(lo, __fmul_rn(__fsub_rn(hi, lo), 0.5f));
    return m > hi ? hi : m;
}

// One channel's term of a box bound (crate::sparse::box_term).
__device__ __forceinline__ float box_term(float q, float lo, float hi) {
    const float a = __fmul_rn(q, lo), b = __fmul_rn(q, hi);
    return a > b ? a : b;
}

// Page metadata: channel-wise min and max of K over each page of `page_size` rows, then
// `key_bits` mask planes: each row's key halved into its box key_bits times from [min,
// max] (crate::sparse::key_box: the upper half when the key is at or above the split),
// bit t % 16 of plane b's row t / 16 set when halving b took the upper half. One thread
// per (page, channel), reading the page's rows in order. Min and max of bf16 values are
// bf16 values, so the bounds stay bf16 and exact. A value replaces the running min (max)
// only when strictly below (above) it, the first row's value starting it, exactly as
// crate::sparse::page_bounds does (so ±0 and NaN resolve the same way on both).
extern "C" __global__ void page_bounds(
    const bf16* __restrict__ keys,  // [pages * page_size, row]
    bf16* __restrict__ bounds,      // [pages, meta_rows(page_size, key_bits), row]
    int pages, int page_size, int row, int key_bits) {
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
    bf16* b = bounds + p * meta_rows(page_size, key_bits) * row + c;
    b[0] = lo;
    b[row] = hi;
    const int plane = plane_rows(page_size);
    for (int r = 0; r < plane; ++r) {
        for (int bit = 0; bit < key_bits; ++bit) {
            unsigned short bits = 0;
            for (int t = r * MASK_TOKENS; t < page_size && t < (r + 1) * MASK_TOKENS; ++t) {
                const float x = bf16_to_f32(k[(long long)t * row]);
                float l = flo, u = fhi;
                bool upper = false;
                for (int d = 0; d <= bit; ++d) {  // halvings 0..=bit: bit's choice last
                    const float m = half_split(l, u);
                    upper = x >= m;
                    if (upper) l = m;
                    else u = m;
                }
                if (upper) bits |= 1u << (t % MASK_TOKENS);
            }
            b[(long long)(2 + bit * plane + r) * row] = bits;  // bf16 is its bits
        }
    }
}

// The box bound of every page for every query head: out[p, h] = the largest over the
// page's keys of Σ_c max(q_c · lo_c, q_c · hi_c), [lo_c, hi_c] the box of the page's
// [min_c, max_c] the key's mask bits name (halving b takes the upper half where plane b's
// bit is set), over head h's channels of its KV head (GQA: query head h reads KV head h /
// (num_heads / num_kv_heads)). One thread per (page, head), each key's channels summed
// in order with rounded multiplies and adds (no FMA contraction), keys compared with >
// from the first: the reference's arithmetic, so both choose the same pages.
extern "C" __global__ void head_bounds(
    const bf16* __restrict__ q,       // [num_heads, head_dim] (one token, post-RoPE)
    const bf16* __restrict__ bounds,  // [pages, meta_rows(page_size, key_bits), num_kv_heads * head_dim]
    float* __restrict__ out,          // [pages, num_heads]
    int pages, int page_size, int num_heads, int num_kv_heads, int head_dim, int key_bits) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)pages * num_heads) return;
    const int p = (int)(i / num_heads), h = (int)(i % num_heads);
    const int row = num_kv_heads * head_dim;
    const int g = h / (num_heads / num_kv_heads);
    const int plane = plane_rows(page_size);
    const bf16* lo = bounds + (long long)p * meta_rows(page_size, key_bits) * row + g * head_dim;
    const bf16* hi = lo + row;
    const bf16* mask = hi + row;
    const bf16* qh = q + (long long)h * head_dim;
    float best = 0.0f;
    for (int t = 0; t < page_size; ++t) {
        const bf16* mrow = mask + (long long)(t / MASK_TOKENS) * row;
        float s = 0.0f;
        for (int c = 0; c < head_dim; ++c) {
            const float qc = bf16_to_f32(qh[c]);
            float l = bf16_to_f32(lo[c]), u = bf16_to_f32(hi[c]);
            for (int bit = 0; bit < key_bits; ++bit) {
                const float m = half_split(l, u);
                if ((mrow[(long long)bit * plane * row + c] >> (t % MASK_TOKENS)) & 1u) l = m;
                else u = m;
            }
            s = __fadd_rn(s, box_term(qc, l, u));
        }
        if (t == 0 || s > best) best = s;
    }
    out[i] = best;
}
