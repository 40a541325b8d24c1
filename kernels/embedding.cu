// Embedding gather: one block per token copies its table row, times `scale` (Gemma's
// √hidden; 1 elsewhere, which leaves every value as stored).
#include "common.cuh"

extern "C" __global__ void embedding_gather(
    const bf16* __restrict__ table,  // [vocab, dim]
    const int* __restrict__ ids,     // [tokens]
    bf16* __restrict__ out,          // [tokens, dim]
    int vocab, int dim, float scale) {
    const int t = blockIdx.x;
    const int id = ids[t];
    bf16* dst = out + (long long)t * dim;
    // An out-of-range id yields a zero row (the CPU twin does the same) rather than a fault.
    if (id < 0 || id >= vocab) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = 0;
        return;
    }
    const bf16* src = table + (long long)id * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        dst[i] = f32_to_bf16(bf16_to_f32(src[i]) * scale);
}
