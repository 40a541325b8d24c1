// Rotary embedding, NeoX/HF convention: element i pairs with i + rotary_dim/2, over each
// head's first rotary_dim elements (head_dim, or a partial RoPE's fraction of it: Qwen3.5
// rotates a quarter); the rest pass through.
#include "common.cuh"

// One thread per (token, head, pair). In the fused QKV buffer q and k heads are adjacent,
// so a single launch with heads = num_heads + num_kv_heads rotates both.
extern "C" __global__ void rope_neox(
    bf16* __restrict__ x,          // [tokens, row_stride]: heads × head_dim used, in place
    const int* __restrict__ pos,   // [tokens] absolute positions
    const float* __restrict__ cos, // [max_pos, rotary_dim / 2]
    const float* __restrict__ sin, // [max_pos, rotary_dim / 2]
    int tokens, int heads, int head_dim, int rotary_dim, int row_stride) {
    const int half = rotary_dim >> 1;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)tokens * heads * half) return;
    const int p = (int)(i % half);
    const long long th = i / half;
    const long long t = th / heads, h = th % heads;
    bf16* v = x + t * row_stride + h * head_dim;
    const long long c = (long long)pos[t] * half + p;
    const float cs = cos[c], sn = sin[c];
    const float x0 = bf16_to_f32(v[p]), x1 = bf16_to_f32(v[p + half]);
    v[p] = f32_to_bf16(x0 * cs - x1 * sn);
    v[p + half] = f32_to_bf16(x0 * sn + x1 * cs);
}
