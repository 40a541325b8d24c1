// Gated DeltaNet, the token mixer of Qwen3.5's state layers (`model::delta_net` is the CPU
// reference each kernel is checked against): the causal conv over one sequence's rows,
// the gated delta rule over them, and the gated RMSNorm of its output. The recurrence is
// sequential in the tokens, so each kernel walks a sequence's rows in order; the state
// (conv tail, matrix) is f32 in device memory, continued from step to step.
#include "common.cuh"

__device__ __forceinline__ float dn_silu(float x) { return x / (1.0f + expf(-x)); }

// torch's softplus (beta 1, threshold 20: linear above it).
__device__ __forceinline__ float dn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// One thread per channel: for each of `tokens` rows in order, the depthwise causal conv
// of the row's q/k/v projections with the `kernel - 1` previous inputs (`tail`, oldest
// first, shifted to end with the row), then SiLU.
extern "C" __global__ void delta_conv(
    const bf16* __restrict__ x,   // [tokens, x_stride]: the conv's channels first
    float* __restrict__ tail,     // [kernel - 1, channels], updated
    const float* __restrict__ w,  // [channels, kernel]: tap kernel - 1 on the newest
    float* __restrict__ out,      // [tokens, channels]
    int tokens, int x_stride, int channels, int kernel) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= channels) return;
    const float* taps = w + (long long)ch * kernel;
    for (int r = 0; r < tokens; ++r) {
        const float xr = bf16_to_f32(x[(long long)r * x_stride + ch]);
        float acc = 0.0f;
        for (int j = 0; j < kernel - 1; ++j) acc += taps[j] * tail[j * channels + ch];
        acc += taps[kernel - 1] * xr;
        out[(long long)r * channels + ch] = dn_silu(acc);
        for (int j = 0; j + 1 < kernel - 1; ++j) tail[j * channels + ch] = tail[(j + 1) * channels + ch];
        tail[(kernel - 2) * channels + ch] = xr;
    }
}

// One block per value head h, one thread per value column j (blockDim.x = dv rounded up
// to a warp): for each row in order, q and k of the head's key head (grouped: h / (v/k);
// tiled: h % k) L2-normalised (q also by dk^-1/2), the gates g = A·softplus(a + dt_bias)
// and beta = sigmoid(b) from the row's projections, then the delta rule on column j of
// S [dk, dv]: S·e^g, delta = beta (v - S^T k), S += k delta^T, o = S^T q.
extern "C" __global__ void delta_rule(
    const float* __restrict__ conv,        // [tokens, channels]: q [k·dk] | k [k·dk] | v [v·dv]
    const bf16* __restrict__ ba,           // [tokens, ba_stride]: b [v_heads] | a [v_heads]
    float* __restrict__ state,             // [v_heads, dk, dv], updated
    const float* __restrict__ decay_rate,  // [v_heads]: A = -exp(A_log)
    const float* __restrict__ dt_bias,     // [v_heads]
    float* __restrict__ out,               // [tokens, v_heads · dv]
    int tokens, int ba_stride, int k_heads, int v_heads, int dk, int dv, int tiled) {
    const int h = blockIdx.x, j = threadIdx.x;
    const bool col = j < dv;
    const int kh = tiled ? h % k_heads : h / (v_heads / k_heads);
    const int channels = 2 * k_heads * dk + v_heads * dv;
    const float scale = rsqrtf((float)dk);
    float* st = state + (long long)h * dk * dv;
    for (int r = 0; r < tokens; ++r) {
        const float* row = conv + (long long)r * channels;
        const float* q = row + kh * dk;
        const float* k = row + k_heads * dk + kh * dk;
        float sq = 0.0f, sk = 0.0f;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            sq += q[i] * q[i];
            sk += k[i] * k[i];
        }
        const float inv_q = rsqrtf(block_sum(sq) + 1e-6f) * scale;
        const float inv_k = rsqrtf(block_sum(sk) + 1e-6f);
        const bf16* g_in = ba + (long long)r * ba_stride;
        const float g = decay_rate[h] * dn_softplus(bf16_to_f32(g_in[v_heads + h]) + dt_bias[h]);
        const float beta = 1.0f / (1.0f + expf(-bf16_to_f32(g_in[h])));
        if (!col) continue;
        const float decay = expf(g);
        float mem = 0.0f;
        for (int i = 0; i < dk; ++i) {
            st[i * dv + j] *= decay;
            mem += st[i * dv + j] * (k[i] * inv_k);
        }
        const float delta = (row[2 * k_heads * dk + h * dv + j] - mem) * beta;
        float o = 0.0f;
        for (int i = 0; i < dk; ++i) {
            st[i * dv + j] += (k[i] * inv_k) * delta;
            o += st[i * dv + j] * (q[i] * inv_q);
        }
        out[(long long)r * v_heads * dv + h * dv + j] = o;
    }
}

// One block per (token, value head): RMSNorm of the head's dv outputs times w, times
// SiLU(z), stored bf16 for the output projection.
extern "C" __global__ void delta_gated_norm(
    const float* __restrict__ o,  // [tokens, v_heads · dv]
    const bf16* __restrict__ z,   // [tokens, z_stride]: z [v_heads · dv] at the row's head
    const float* __restrict__ w,  // [dv]
    bf16* __restrict__ out,       // [tokens, v_heads · dv]
    int v_heads, int dv, int z_stride, float eps) {
    const int r = blockIdx.x / v_heads, h = blockIdx.x % v_heads;
    const long long at = (long long)r * v_heads * dv + h * dv;
    const bf16* zr = z + (long long)r * z_stride + h * dv;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dv; i += blockDim.x) ss += o[at + i] * o[at + i];
    const float inv = rsqrtf(block_sum(ss) / dv + eps);
    for (int i = threadIdx.x; i < dv; i += blockDim.x)
        out[at + i] = f32_to_bf16(w[i] * (o[at + i] * inv) * dn_silu(bf16_to_f32(zr[i])));
}
