// Decode attention, flash-decoding: one query per sequence, so parallelism comes from
// splitting the key range into `split_len` chunks, one block each (partial m, l, o in
// f32), then a second kernel merges the splits. GQA; an optional sliding window (`window`
// > 0: the query sees its last `window` keys, so splits wholly before them are neither
// run nor merged); K/V read through a block table (a contiguous slot = one block per
// sequence; a ring slot = a table of zeros, key p at row p % block_size); attention
// sinks (gpt-oss) join the merge. bf16 in and out.
#include "common.cuh"

#define WARPS 4

// The first key the query at position ctx − 1 sees (key 0 without a window).
__device__ __forceinline__ int first_key(int ctx, int window) {
    return window > 0 ? max(0, ctx - window) : 0;
}

// Launch: grid (num_heads, max_splits, batch), block 128. Heads vary fastest so the
// `group` heads that read the same KV head run side by side and share it through L2.
template <int HD>
__device__ void attn_decode(
    const bf16* __restrict__ q,            // [batch, q_stride]: num_heads × HD used
    const bf16* __restrict__ k_cache,      // [slots, num_kv_heads × HD]
    const bf16* __restrict__ v_cache,      // [slots, num_kv_heads × HD]
    float* __restrict__ part_o,            // [batch, num_heads, max_splits, HD]
    float* __restrict__ part_ml,           // [batch, num_heads, max_splits, 2]
    const int* __restrict__ context_lens,  // [batch]
    const int* __restrict__ block_tables,  // [batch, max_blocks]
    int max_blocks, int block_size, int num_heads, int num_kv_heads, int q_stride,
    int split_len, int max_splits, int window, float scale) {
    constexpr int DPL = HD / 32;
    __shared__ float qs[HD];
    __shared__ float wm[WARPS], wl[WARPS];
    __shared__ float wo[WARPS][HD];

    const int h = blockIdx.x, s = blockIdx.y, b = blockIdx.z;
    const int ctx = context_lens[b];
    const int split0 = s * split_len;
    const int k_begin = max(split0, first_key(ctx, window));
    const int k_end = min(ctx, split0 + split_len);
    if (k_begin >= k_end) return;  // the reduce kernel reads only the splits that run
    const int kvh = h / (num_heads / num_kv_heads);
    const int kv_dim = num_kv_heads * HD;
    const int* table = block_tables + (long long)b * max_blocks;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    for (int d = threadIdx.x; d < HD; d += blockDim.x)
        qs[d] = bf16_to_f32(q[(long long)b * q_stride + h * HD + d]) * scale;
    __syncthreads();

    float m = -INFINITY, l = 0.0f, o[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) o[i] = 0.0f;
    // Each warp takes 32 keys at a time, one per lane for the scores.
    for (int kb = k_begin + warp * 32; kb < k_end; kb += WARPS * 32) {
        const int key = kb + lane;
        long long off = -1;
        float sc = -INFINITY;
        if (key < k_end) {
            long long slot = (long long)table[key / block_size] * block_size + key % block_size;
            off = slot * kv_dim + kvh * HD;
            const uint4* kr = reinterpret_cast<const uint4*>(k_cache + off);  // 8 bf16 each
            float acc = 0.0f;
#pragma unroll 4
            for (int w = 0; w < HD / 8; ++w) {
                uint4 u = kr[w];
                unsigned int e[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                for (int t = 0; t < 4; ++t)
                    acc += qs[8 * w + 2 * t] * __uint_as_float(e[t] << 16) +
                           qs[8 * w + 2 * t + 1] * __uint_as_float(e[t] & 0xffff0000u);
            }
            sc = acc;
        }
        const float m_new = fmaxf(m, warp_max(sc));  // finite: lane 0's key exists
        const float corr = __expf(m - m_new);
        const float p = __expf(sc - m_new);
        l = l * corr + warp_sum(p);
        m = m_new;
#pragma unroll
        for (int i = 0; i < DPL; ++i) o[i] *= corr;
        const int n = min(32, k_end - kb);
        for (int t = 0; t < n; ++t) {
            const float pt = __shfl_sync(0xffffffffu, p, t);
            const long long ot = __shfl_sync(0xffffffffu, off, t);
#pragma unroll
            for (int i = 0; i < DPL; ++i) o[i] += pt * bf16_to_f32(v_cache[ot + lane + 32 * i]);
        }
    }
    // Merge the warps' partials.
    if (lane == 0) { wm[warp] = m; wl[warp] = l; }
#pragma unroll
    for (int i = 0; i < DPL; ++i) wo[warp][lane + 32 * i] = o[i];
    __syncthreads();
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mb = fmaxf(mb, wm[w]);
    const long long part = ((long long)b * num_heads + h) * max_splits + s;
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
            if (wm[w] != -INFINITY) acc += wo[w][d] * __expf(wm[w] - mb);
        part_o[part * HD + d] = acc;
    }
    if (threadIdx.x == 0) {
        float lb = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
            if (wm[w] != -INFINITY) lb += wl[w] * __expf(wm[w] - mb);
        part_ml[part * 2] = mb;
        part_ml[part * 2 + 1] = lb;
    }
}

#define INSTANTIATE(HD)                                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) attn_decode_hd##HD(           \
        const bf16* q, const bf16* k_cache, const bf16* v_cache, float* part_o,            \
        float* part_ml, const int* context_lens, const int* block_tables, int max_blocks,  \
        int block_size, int num_heads, int num_kv_heads, int q_stride, int split_len,      \
        int max_splits, int window, float scale) {                                         \
        attn_decode<HD>(q, k_cache, v_cache, part_o, part_ml, context_lens, block_tables,  \
                        max_blocks, block_size, num_heads, num_kv_heads, q_stride,         \
                        split_len, max_splits, window, scale);                             \
    }
INSTANTIATE(64)
INSTANTIATE(96)
INSTANTIATE(128)
INSTANTIATE(256)

// Merge the splits: out = Σ o_s e^{m_s − M} / Σ l_s e^{m_s − M}; with attention sinks
// (gpt-oss) the head's sink is one more term of the denominator, e^{sink − M}, M taken
// over it too.
// Launch: grid (num_heads, batch), block 128.
extern "C" __global__ void attn_decode_reduce(
    const float* __restrict__ part_o,      // [batch, num_heads, max_splits, head_dim]
    const float* __restrict__ part_ml,     // [batch, num_heads, max_splits, 2]
    bf16* __restrict__ out,                // [batch, num_heads × head_dim]
    const int* __restrict__ context_lens,  // [batch]
    int num_heads, int head_dim, int split_len, int max_splits, int window,
    const float* __restrict__ sinks) {     // [num_heads] or null
    const int h = blockIdx.x, b = blockIdx.y;
    const int ctx = context_lens[b];
    const int splits = (ctx + split_len - 1) / split_len;
    const int s0 = first_key(ctx, window) / split_len;  // the first split attn_decode ran
    const long long base = ((long long)b * num_heads + h) * max_splits;
    float mx = sinks ? sinks[h] : -INFINITY;
    for (int s = s0; s < splits; ++s) mx = fmaxf(mx, part_ml[(base + s) * 2]);
    float l = sinks ? __expf(sinks[h] - mx) : 0.0f;
    for (int s = s0; s < splits; ++s)
        l += part_ml[(base + s) * 2 + 1] * __expf(part_ml[(base + s) * 2] - mx);
    const float inv = 1.0f / l;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = s0; s < splits; ++s)
            acc += part_o[(base + s) * head_dim + d] * __expf(part_ml[(base + s) * 2] - mx);
        out[((long long)b * num_heads + h) * head_dim + d] = f32_to_bf16(acc * inv);
    }
}
