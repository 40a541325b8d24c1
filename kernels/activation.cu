// Gated MLP activations, gate and up side by side in one GEMM output.
#include "common.cuh"

// out[t, j] = act(gate[t, j]) * up[t, j], one thread per output.
template <typename Act>
__device__ __forceinline__ void gated(
    const bf16* __restrict__ gu, bf16* __restrict__ out, int tokens, int inter, Act act) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)tokens * inter) return;
    const long long t = i / inter, j = i % inter;
    const float g = bf16_to_f32(gu[t * 2 * inter + j]);
    const float u = bf16_to_f32(gu[t * 2 * inter + inter + j]);
    out[i] = f32_to_bf16(act(g) * u);
}

// SwiGLU: out = silu(gate) * up.
extern "C" __global__ void silu_mul(
    const bf16* __restrict__ gu,  // [tokens, 2 * inter]: gate then up
    bf16* __restrict__ out,       // [tokens, inter]
    int tokens, int inter) {
    gated(gu, out, tokens, inter, [](float g) { return g / (1.0f + __expf(-g)); });
}

// GeGLU (Gemma): out = gelu_tanh(gate) * up, GELU's tanh approximation as in
// `ops::gelu_tanh`.
extern "C" __global__ void gelu_tanh_mul(
    const bf16* __restrict__ gu,  // [tokens, 2 * inter]: gate then up
    bf16* __restrict__ out,       // [tokens, inter]
    int tokens, int inter) {
    gated(gu, out, tokens, inter, [](float g) {
        const float c = 0.7978846f * (g + 0.044715f * g * g * g);  // √(2/π) (x + 0.044715 x³)
        return 0.5f * g * (1.0f + tanhf(c));
    });
}

// Gated attention (Qwen3.5): x[t, j] *= sigmoid(gate[t, j]), the gates strided (they ride
// in the fused projection's rows), as `ops::sigmoid` on the CPU.
extern "C" __global__ void sigmoid_gate(
    bf16* __restrict__ x,           // [tokens, width], in place
    const bf16* __restrict__ gate,  // [tokens, gate_stride]: width gates used
    int tokens, int width, int gate_stride) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)tokens * width) return;
    const long long t = i / width, j = i % width;
    const float g = bf16_to_f32(gate[t * gate_stride + j]);
    x[i] = f32_to_bf16(bf16_to_f32(x[i]) * (1.0f / (1.0f + expf(-g))));
}

// gpt-oss's experts: out = (clamp(up, ±limit) + 1) · g · σ(alpha · g), g = min(gate, limit)
// (transformers' `GptOssExperts._apply_gate`; `ops::clamped_swiglu_mul`).
extern "C" __global__ void clamped_swiglu_mul(
    const bf16* __restrict__ gu,  // [tokens, 2 * inter]: gate then up
    bf16* __restrict__ out,       // [tokens, inter]
    int tokens, int inter, float alpha, float limit) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)tokens * inter) return;
    const long long t = i / inter, j = i % inter;
    const float g = fminf(bf16_to_f32(gu[t * 2 * inter + j]), limit);
    const float u = fminf(fmaxf(bf16_to_f32(gu[t * 2 * inter + inter + j]), -limit), limit);
    out[i] = f32_to_bf16((u + 1.0f) * (g / (1.0f + expf(-g * alpha))));
}
