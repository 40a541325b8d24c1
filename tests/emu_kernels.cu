// Kernels that exercise the emulator itself (tests/kernel_emulator.rs): what it must
// compute, and the misuse it must report. Launch each with blocks of 128 threads.
#include "common.cuh"

// Correct: every thread stores, a barrier, then each reads its neighbour's value.
extern "C" __global__ void neighbour_synced(int* out) {
    __shared__ int s[128];
    s[threadIdx.x] = blockIdx.x * 1000 + threadIdx.x;
    __syncthreads();
    out[blockIdx.x * 128 + threadIdx.x] = s[(threadIdx.x + 1) % 128];
}

// Wrong: the barrier is missing, so a thread may read its neighbour's slot before it is
// written (on a GPU: sometimes; in the emulator: always, in one of the two orders).
extern "C" __global__ void neighbour_racy(int* out) {
    __shared__ int s[128];
    s[threadIdx.x] = blockIdx.x * 1000 + threadIdx.x;
    out[blockIdx.x * 128 + threadIdx.x] = s[(threadIdx.x + 1) % 128];
}

// Wrong: only half of the block reaches the barrier.
extern "C" __global__ void divergent_barrier(int* out) {
    if (threadIdx.x < 64) __syncthreads();
    out[threadIdx.x] = 1;
}

// Warp intrinsics: out[8 * t + k] for the k-th result of thread t.
extern "C" __global__ void warp_ops(const float* in, float* out) {
    const int t = threadIdx.x;
    const float v = in[t];
    float* o = out + 8 * t;
    o[0] = __shfl_xor_sync(0xffffffffu, v, 5);
    o[1] = __shfl_up_sync(0xffffffffu, v, 3);
    o[2] = __shfl_down_sync(0xffffffffu, v, 7);
    o[3] = __shfl_sync(0xffffffffu, v, 9);
    o[4] = warp_sum(v);
    o[5] = warp_max(v);
    o[6] = block_sum(v);
    o[7] = block_max(v);
}

// Wrong: lanes 16..31 leave before the warp-wide shuffle.
extern "C" __global__ void shuffle_after_exit(float* out) {
    if ((threadIdx.x & 31) >= 16) return;
    out[threadIdx.x] = warp_sum(1.0f);
}

// Argument types, one of each: the launch must pass (p, i, f).
extern "C" __global__ void typed_args(float* out, int n, float x) {
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = n * x;
}
