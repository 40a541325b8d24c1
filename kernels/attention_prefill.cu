// Prefill attention, flash-attention style: a block takes BQ queries of one head of one
// sequence, walks the sequence's keys in tiles of BK staged in shared memory, and keeps an
// online softmax (running max m, sum l, output o) in f32 registers, so the score matrix
// never exists. Causal, GQA (head h reads KV head h / group), variable length (cu_seqlens),
// K/V read through a block table; a contiguous ring slot is the case of one block per
// sequence (block_size = the slot's capacity). bf16 in and out.
#include "common.cuh"

#define BQ 16             // queries per block: 4 warps × 4 queries
#define BK 64             // keys per tile: 2 per lane
#define WARPS 4
#define QPW (BQ / WARPS)  // queries per warp

template <int HD>
__device__ void attn_prefill(
    const bf16* __restrict__ q,             // [total_q, q_stride]: num_heads × HD used
    const bf16* __restrict__ k_cache,       // [slots, num_kv_heads × HD]
    const bf16* __restrict__ v_cache,       // [slots, num_kv_heads × HD]
    bf16* __restrict__ out,                 // [total_q, num_heads × HD]
    const int* __restrict__ cu_seqlens_q,   // [batch + 1] query offsets
    const int* __restrict__ context_lens,   // [batch] keys per sequence, new tokens included
    const int* __restrict__ block_tables,   // [batch, max_blocks]
    int max_blocks, int block_size, int num_heads, int num_kv_heads, int q_stride,
    float scale) {
    constexpr int DPL = HD / 32;     // output dims per lane: lane + 32 i
    constexpr int KROW = HD + 2;     // padded K row: an odd word stride, no bank conflicts
    __shared__ float qs[BQ][HD];
    __shared__ __align__(16) bf16 ks[BK][KROW];
    __shared__ __align__(16) bf16 vs[BK][HD];

    const int b = blockIdx.z, h = blockIdx.y;
    const int q0 = cu_seqlens_q[b], q_len = cu_seqlens_q[b + 1] - q0;
    const int tile0 = blockIdx.x * BQ;
    if (tile0 >= q_len) return;  // the grid is sized for the longest sequence
    const int ctx = context_lens[b];
    const int pos0 = ctx - q_len;  // absolute position of the first new token
    const int kvh = h / (num_heads / num_kv_heads);
    const int kv_dim = num_kv_heads * HD;
    const int* table = block_tables + (long long)b * max_blocks;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // Queries, pre-scaled.
    for (int i = threadIdx.x; i < BQ * HD; i += blockDim.x) {
        int r = i / HD, d = i % HD;
        qs[r][d] = tile0 + r < q_len
            ? bf16_to_f32(q[(long long)(q0 + tile0 + r) * q_stride + h * HD + d]) * scale
            : 0.0f;
    }
    float m[QPW], l[QPW], o[QPW][DPL];
#pragma unroll
    for (int j = 0; j < QPW; ++j) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) o[j][i] = 0.0f;
    }
    // The last query of the tile sees keys up to its own position.
    const int key_end = pos0 + min(q_len, tile0 + BQ);
    for (int kb = 0; kb < key_end; kb += BK) {
        __syncthreads();  // the previous tile is no longer read
        // Stage K and V in 32-bit words (2 bf16), one table lookup per word.
        for (int i = threadIdx.x; i < BK * HD / 2; i += blockDim.x) {
            int j = i / (HD / 2), w = i % (HD / 2);
            int key = kb + j;
            unsigned int kw = 0, vw = 0;
            if (key < key_end) {
                long long slot = (long long)table[key / block_size] * block_size + key % block_size;
                long long off = slot * kv_dim + kvh * HD;
                kw = reinterpret_cast<const unsigned int*>(k_cache + off)[w];
                vw = reinterpret_cast<const unsigned int*>(v_cache + off)[w];
            }
            reinterpret_cast<unsigned int*>(&ks[j][0])[w] = kw;
            reinterpret_cast<unsigned int*>(&vs[j][0])[w] = vw;
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < QPW; ++j) {
            const int r = warp * QPW + j;
            if (tile0 + r >= q_len) break;  // warp-uniform
            const int qpos = pos0 + tile0 + r;
            if (kb > qpos) break;  // tile entirely in this query's future
            float s0 = 0.0f, s1 = 0.0f;
            const unsigned int* k0 = reinterpret_cast<const unsigned int*>(&ks[lane][0]);
            const unsigned int* k1 = reinterpret_cast<const unsigned int*>(&ks[lane + 32][0]);
#pragma unroll 8
            for (int w = 0; w < HD / 2; ++w) {
                unsigned int a = k0[w], c = k1[w];
                float qa = qs[r][2 * w], qb = qs[r][2 * w + 1];
                s0 += qa * __uint_as_float(a << 16) + qb * __uint_as_float(a & 0xffff0000u);
                s1 += qa * __uint_as_float(c << 16) + qb * __uint_as_float(c & 0xffff0000u);
            }
            if (kb + lane > qpos) s0 = -INFINITY;  // causal mask
            if (kb + lane + 32 > qpos) s1 = -INFINITY;
            const float m_new = fmaxf(m[j], warp_max(fmaxf(s0, s1)));  // finite: key kb is visible
            const float corr = __expf(m[j] - m_new);
            const float p0 = __expf(s0 - m_new), p1 = __expf(s1 - m_new);
            l[j] = l[j] * corr + warp_sum(p0 + p1);
            m[j] = m_new;
#pragma unroll
            for (int i = 0; i < DPL; ++i) o[j][i] *= corr;
            for (int t = 0; t < 32; ++t) {
                const float pa = __shfl_sync(0xffffffffu, p0, t);
                const float pb = __shfl_sync(0xffffffffu, p1, t);
#pragma unroll
                for (int i = 0; i < DPL; ++i)
                    o[j][i] += pa * bf16_to_f32(vs[t][lane + 32 * i]) +
                               pb * bf16_to_f32(vs[t + 32][lane + 32 * i]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < QPW; ++j) {
        const int r = warp * QPW + j;
        if (tile0 + r >= q_len) break;
        const float inv = 1.0f / l[j];
        bf16* dst = out + (long long)(q0 + tile0 + r) * num_heads * HD + h * HD;
#pragma unroll
        for (int i = 0; i < DPL; ++i) dst[lane + 32 * i] = f32_to_bf16(o[j][i] * inv);
    }
}

// Launch: grid (ceil(max_q_len / 16), num_heads, batch), block 128 threads.
#define INSTANTIATE(HD)                                                                   \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) attn_prefill_hd##HD(         \
        const bf16* q, const bf16* k_cache, const bf16* v_cache, bf16* out,               \
        const int* cu_seqlens_q, const int* context_lens, const int* block_tables,        \
        int max_blocks, int block_size, int num_heads, int num_kv_heads, int q_stride,    \
        float scale) {                                                                    \
        attn_prefill<HD>(q, k_cache, v_cache, out, cu_seqlens_q, context_lens,            \
                         block_tables, max_blocks, block_size, num_heads, num_kv_heads,   \
                         q_stride, scale);                                                \
    }
INSTANTIATE(64)
INSTANTIATE(96)
INSTANTIATE(128)
