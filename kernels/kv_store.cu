// Write the new tokens' K and V into the cache at the slots the block manager chose.
#include "common.cuh"

// One thread per (token, element of kv_dim). slot = block * block_size + offset; a
// negative slot (a padding token) is skipped, as in vLLM's reshape_and_cache. A ring
// (`ring_rows` > 0: a sliding-window layer's slot) stores position p at row p % ring_rows.
extern "C" __global__ void kv_store(
    const bf16* __restrict__ k,    // [tokens, src_stride]: kv_dim used (K inside fused QKV)
    const bf16* __restrict__ v,    // [tokens, src_stride]
    bf16* __restrict__ k_cache,    // [slots, kv_dim] (kv_dim = num_kv_heads × head_dim)
    bf16* __restrict__ v_cache,    // [slots, kv_dim]
    const int* __restrict__ slots, // [tokens]
    int tokens, int kv_dim, int src_stride, int ring_rows) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)tokens * kv_dim) return;
    const long long t = i / kv_dim, d = i % kv_dim;
    int s = slots[t];
    if (s < 0) return;
    if (ring_rows > 0) s %= ring_rows;
    k_cache[(long long)s * kv_dim + d] = k[t * src_stride + d];
    v_cache[(long long)s * kv_dim + d] = v[t * src_stride + d];
}
