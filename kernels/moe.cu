// A mixture-of-experts block (Qwen3.5 MoE's and gpt-oss's routed experts; `model::moe` is the CPU
// reference each kernel is checked against): each token's experts from its router
// logits, every (token, chosen expert) row through that expert's projections, and the
// weighted sum in ascending expert order. Each output is one warp's fixed-order reduction
// over its own row, so a token's result never depends on the rest of the batch.
#include "common.cuh"

// One thread per token: the top_k largest logits (a NaN ranks below every number; a tie
// goes to the lower expert), weighted by a softmax over the chosen logits, listed in
// ascending expert order (`model::moe::route`). A router bias (gpt-oss) is added to the
// logits in place first, in f32, as the CPU's biased linear does.
extern "C" __global__ void moe_route(
    float* __restrict__ logits,        // [tokens, experts]
    const float* __restrict__ bias,    // [experts] or null
    int* __restrict__ ids,             // [tokens, top_k]
    float* __restrict__ weights,       // [tokens, top_k]
    int tokens, int experts, int top_k) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    float* row = logits + (long long)t * experts;
    if (bias)
        for (int e = 0; e < experts; ++e) row[e] += bias[e];
    int* id = ids + (long long)t * top_k;
    float* w = weights + (long long)t * top_k;
    for (int s = 0; s < top_k; ++s) {
        int best = -1;
        float best_key = 0.0f;
        for (int e = 0; e < experts; ++e) {
            bool taken = false;
            for (int j = 0; j < s; ++j) taken |= id[j] == e;
            if (taken) continue;
            const float key = row[e] != row[e] ? -INFINITY : row[e];
            if (best < 0 || key > best_key) {
                best = e;
                best_key = key;
            }
        }
        id[s] = best;
    }
    const float max = row[id[0]];
    float sum = 0.0f;
    for (int s = 0; s < top_k; ++s) {
        w[s] = expf(row[id[s]] - max);
        sum += w[s];
    }
    for (int s = 0; s < top_k; ++s) w[s] /= sum;
    // Ascending expert order (insertion sort of top_k pairs).
    for (int s = 1; s < top_k; ++s) {
        const int e = id[s];
        const float we = w[s];
        int j = s - 1;
        for (; j >= 0 && id[j] > e; --j) {
            id[j + 1] = id[j];
            w[j + 1] = w[j];
        }
        id[j + 1] = e;
        w[j + 1] = we;
    }
}

// One warp per output element: out[r, j] = sum_i x[r / x_div, i] * w[ids[r], j, i], the
// row's expert's matrix [n, kdim] (a stack [experts, n, kdim]); lanes stride the inputs,
// then a fixed-order warp sum. x_div: top_k when every chosen row of a token reads the
// token's input (gate/up), 1 when each reads its own (down). An expert bias (gpt-oss)
// joins the f32 sum before its one rounding.
extern "C" __global__ void moe_matvec(
    const bf16* __restrict__ x,    // [rows / x_div, kdim]
    const int* __restrict__ ids,   // [rows]
    const bf16* __restrict__ w,    // [experts, n, kdim]
    const bf16* __restrict__ bias, // [experts, n] or null
    bf16* __restrict__ out,        // [rows, n]
    int rows, int n, int kdim, int x_div) {
    const long long o = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (o >= (long long)rows * n) return;  // whole warps: o is uniform across a warp
    const int r = (int)(o / n), j = (int)(o % n);
    const bf16* xr = x + (long long)(r / x_div) * kdim;
    const bf16* wr = w + ((long long)ids[r] * n + j) * kdim;
    float acc = 0.0f;
    for (int i = lane; i < kdim; i += 32) acc += bf16_to_f32(xr[i]) * bf16_to_f32(wr[i]);
    acc = warp_sum(acc);
    if (bias) acc += bf16_to_f32(bias[(long long)ids[r] * n + j]);
    if (lane == 0) out[o] = f32_to_bf16(acc);
}

// One thread per output: out[t, i] = sum_s weights[t, s] * y[t * top_k + s, i], the
// slots in order, plus, with a shared expert, sigmoid(gate[t]) * shared[t, i].
extern "C" __global__ void moe_combine(
    const bf16* __restrict__ y,        // [tokens * top_k, hidden]
    const float* __restrict__ weights, // [tokens, top_k]
    const bf16* __restrict__ shared,   // [tokens, hidden] or null
    const float* __restrict__ gate,    // [tokens] or null
    bf16* __restrict__ out,            // [tokens, hidden]
    int tokens, int top_k, int hidden) {
    const long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= (long long)tokens * hidden) return;
    const int t = (int)(o / hidden), i = (int)(o % hidden);
    float acc = 0.0f;
    for (int s = 0; s < top_k; ++s)
        acc += bf16_to_f32(y[((long long)t * top_k + s) * hidden + i]) * weights[t * top_k + s];
    if (shared) acc += bf16_to_f32(shared[o]) / (1.0f + expf(-gate[t]));
    out[o] = f32_to_bf16(acc);
}
