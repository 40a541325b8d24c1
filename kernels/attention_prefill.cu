// Prefill attention, flash-attention style: a block takes BQ queries of one head of one
// sequence, walks the sequence's keys in tiles of BK staged in shared memory, and keeps an
// online softmax (running max m, sum l, output o) in f32 registers, so the score matrix
// never exists. Causal, GQA (head h reads KV head h / group), variable length (cu_seqlens),
// an optional sliding window (`window` > 0: the query at p sees keys p − window + 1 ..= p),
// K/V read through a block table; a contiguous slot is the case of one block per sequence
// (block_size = the slot's capacity), a ring slot that of a table of zeros (key p at row
// p % block_size); optional attention sinks (gpt-oss: `sinks[h]`, a learned logit that
// joins every softmax's denominator and attends nothing). bf16 in and out.
#include "common.cuh"

#define BK 64             // keys per tile: 2 per lane
#define WARPS 4

// Stages keys kb .. kb + BK − 1 of `cache` as bf16 rows of `stride` elements, in 32-bit
// words (2 bf16), one table lookup per word; keys outside [lo, hi) are zeros (a ring's
// rows before the window hold other positions; a slot's rows there may never have been
// written, and a masked key's V still meets a zero weight).
template <int HD>
__device__ __forceinline__ void stage_tile(
    bf16* dst, int stride, const bf16* __restrict__ cache, const int* table, int block_size,
    int kv_dim, int kvh, int kb, int lo, int hi) {
    for (int i = threadIdx.x; i < BK * HD / 2; i += blockDim.x) {
        const int j = i / (HD / 2), w = i % (HD / 2);
        const int key = kb + j;
        unsigned int word = 0;
        if (key >= lo && key < hi) {
            long long slot = (long long)table[key / block_size] * block_size + key % block_size;
            word = reinterpret_cast<const unsigned int*>(cache + slot * kv_dim + kvh * HD)[w];
        }
        reinterpret_cast<unsigned int*>(dst + j * stride)[w] = word;
    }
}

// BQ queries per block (4 warps × BQ / 4). KV_SHARED: K and V take turns in one staging
// tile (head_dim 256, where separate tiles and 16 queries would pass the 48 KiB of static
// shared memory); the arithmetic is the same either way.
template <int HD, int BQ, bool KV_SHARED>
__device__ void attn_prefill(
    const bf16* __restrict__ q,             // [total_q, q_stride]: num_heads × HD used
    const bf16* __restrict__ k_cache,       // [slots, num_kv_heads × HD]
    const bf16* __restrict__ v_cache,       // [slots, num_kv_heads × HD]
    bf16* __restrict__ out,                 // [total_q, num_heads × HD]
    const int* __restrict__ cu_seqlens_q,   // [batch + 1] query offsets
    const int* __restrict__ context_lens,   // [batch] keys per sequence, new tokens included
    const int* __restrict__ block_tables,   // [batch, max_blocks]
    int max_blocks, int block_size, int num_heads, int num_kv_heads, int q_stride,
    int window, float scale,
    const float* __restrict__ sinks) {      // [num_heads] or null
    constexpr int QPW = BQ / WARPS;  // queries per warp
    constexpr int DPL = HD / 32;     // output dims per lane: lane + 32 i
    constexpr int KROW = HD + 2;     // padded K row: an odd word stride, no bank conflicts
    constexpr int VROW = KV_SHARED ? KROW : HD;
    __shared__ float qs[BQ][HD];
    __shared__ __align__(16) bf16 ks[BK * KROW];
    __shared__ __align__(16) bf16 vs_own[KV_SHARED ? 2 : BK * HD];
    bf16* vs = KV_SHARED ? ks : vs_own;

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
    // The last query of the tile sees keys up to its own position, the first none before
    // its window: tiles wholly before that are never staged.
    const int key_end = pos0 + min(q_len, tile0 + BQ);
    const int key_lo = window > 0 ? max(0, pos0 + tile0 - window + 1) : 0;
    for (int kb = key_lo / BK * BK; kb < key_end; kb += BK) {
        __syncthreads();  // the previous tile is no longer read
        stage_tile<HD>(ks, KROW, k_cache, table, block_size, kv_dim, kvh, kb, key_lo, key_end);
        if (!KV_SHARED)
            stage_tile<HD>(vs, VROW, v_cache, table, block_size, kv_dim, kvh, kb, key_lo, key_end);
        __syncthreads();
        // Scores and softmax statistics of each of the warp's queries over this tile.
        bool live[QPW];
        float p0[QPW], p1[QPW], corr[QPW];
#pragma unroll
        for (int j = 0; j < QPW; ++j) live[j] = false;
#pragma unroll
        for (int j = 0; j < QPW; ++j) {
            const int r = warp * QPW + j;
            if (tile0 + r >= q_len) break;  // warp-uniform
            const int qpos = pos0 + tile0 + r;
            const int first = window > 0 ? qpos - window + 1 : 0;  // may be negative
            // The tile wholly in this query's future, or wholly before its window (a later
            // query of the warp may still see it: `continue`, not `break`).
            if (kb > qpos || kb + BK <= first) continue;
            live[j] = true;
            float s0 = 0.0f, s1 = 0.0f;
            const unsigned int* k0 = reinterpret_cast<const unsigned int*>(ks + lane * KROW);
            const unsigned int* k1 = reinterpret_cast<const unsigned int*>(ks + (lane + 32) * KROW);
#pragma unroll 8
            for (int w = 0; w < HD / 2; ++w) {
                unsigned int a = k0[w], c = k1[w];
                float qa = qs[r][2 * w], qb = qs[r][2 * w + 1];
                s0 += qa * __uint_as_float(a << 16) + qb * __uint_as_float(a & 0xffff0000u);
                s1 += qa * __uint_as_float(c << 16) + qb * __uint_as_float(c & 0xffff0000u);
            }
            const int k_a = kb + lane, k_b = kb + lane + 32;
            if (k_a > qpos || k_a < first) s0 = -INFINITY;  // causal mask, window
            if (k_b > qpos || k_b < first) s1 = -INFINITY;
            // Finite: the tile holds a key this query sees.
            const float m_new = fmaxf(m[j], warp_max(fmaxf(s0, s1)));
            corr[j] = __expf(m[j] - m_new);
            p0[j] = __expf(s0 - m_new);
            p1[j] = __expf(s1 - m_new);
            l[j] = l[j] * corr[j] + warp_sum(p0[j] + p1[j]);
            m[j] = m_new;
        }
        if (KV_SHARED) {
            __syncthreads();  // every warp is done with K
            stage_tile<HD>(vs, VROW, v_cache, table, block_size, kv_dim, kvh, kb, key_lo, key_end);
            __syncthreads();
        }
        // o ← o · corr + P · V.
#pragma unroll
        for (int j = 0; j < QPW; ++j) {
            if (!live[j]) continue;  // warp-uniform
#pragma unroll
            for (int i = 0; i < DPL; ++i) o[j][i] *= corr[j];
            for (int t = 0; t < 32; ++t) {
                const float pa = __shfl_sync(0xffffffffu, p0[j], t);
                const float pb = __shfl_sync(0xffffffffu, p1[j], t);
#pragma unroll
                for (int i = 0; i < DPL; ++i)
                    o[j][i] += pa * bf16_to_f32(vs[t * VROW + lane + 32 * i]) +
                               pb * bf16_to_f32(vs[(t + 32) * VROW + lane + 32 * i]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < QPW; ++j) {
        const int r = warp * QPW + j;
        if (tile0 + r >= q_len) break;
        // A sink: one more denominator term exp(sink − m'), m' = max(m, sink), the keys'
        // terms rescaled to m' (`ops::attention_batch`'s merge).
        float keep = 1.0f, lj = l[j];
        if (sinks) {
            const float s = sinks[h], mx = fmaxf(m[j], s);
            keep = __expf(m[j] - mx);
            lj = lj * keep + __expf(s - mx);
        }
        const float inv = keep / lj;
        bf16* dst = out + (long long)(q0 + tile0 + r) * num_heads * HD + h * HD;
#pragma unroll
        for (int i = 0; i < DPL; ++i) dst[lane + 32 * i] = f32_to_bf16(o[j][i] * inv);
    }
}

// Launch: grid (ceil(max_q_len / BQ), num_heads, batch), block 128 threads; BQ is 16, or
// 8 at head_dim 256 (`ops::prefill_queries_per_block`).
#define INSTANTIATE(HD, BQ, KV_SHARED)                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) attn_prefill_hd##HD(         \
        const bf16* q, const bf16* k_cache, const bf16* v_cache, bf16* out,               \
        const int* cu_seqlens_q, const int* context_lens, const int* block_tables,        \
        int max_blocks, int block_size, int num_heads, int num_kv_heads, int q_stride,    \
        int window, float scale, const float* sinks) {                                    \
        attn_prefill<HD, BQ, KV_SHARED>(q, k_cache, v_cache, out, cu_seqlens_q,           \
                                        context_lens, block_tables, max_blocks,           \
                                        block_size, num_heads, num_kv_heads, q_stride,    \
                                        window, scale, sinks);                            \
    }
INSTANTIATE(64, 16, false)
INSTANTIATE(96, 16, false)
INSTANTIATE(128, 16, false)
INSTANTIATE(256, 8, true)
