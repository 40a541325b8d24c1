// Batch-invariant GEMM: out[m, n] = x[m, k] · w[n, k]ᵀ, bf16 in, f32 accumulate, out f32
// or bf16. cuBLAS picks its algorithm (tile, split-K) by shape, so a row's reduction order
// there depends on how many rows are in the batch; here every output is one thread's
// sequential fmaf over k = 0, 1, … in order, whatever m is and whichever tile height the
// launch picked, so a sequence's logits are bitwise the same alone or inside any batch
// (docs/serving.md). The tile height (4, 16 or 64 rows) only decides which thread computes
// an output, never its arithmetic.
#include "common.cuh"

#define BN 64        // output columns per block (one per thread of a row group)
#define KT 32        // k per shared-memory tile
#define THREADS 256  // 4 row groups of 64 threads

template <int BM>
__device__ void gemm_fixed(
    const bf16* __restrict__ x,  // [m, k]
    const bf16* __restrict__ w,  // [n, k]
    void* __restrict__ out,      // [m, n]: f32 if out_f32, else bf16
    int m, int k, int n, int out_f32) {
    constexpr int GROUPS = THREADS / BN;  // row groups
    constexpr int RPT = BM / GROUPS;      // rows per thread
    __shared__ float xs[BM][KT + 1];      // +1: no bank conflicts down a column
    __shared__ float ws[BN][KT + 1];

    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    const int col = threadIdx.x % BN, group = threadIdx.x / BN;
    float acc[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) acc[i] = 0.0f;

    for (int k0 = 0; k0 < k; k0 += KT) {
        // Consecutive threads load consecutive k of one row: coalesced. Out-of-range
        // elements load as 0, and fmaf(0, 0, acc) == acc, so padding changes nothing.
        for (int e = threadIdx.x; e < BM * KT; e += THREADS) {
            const int r = e / KT, kk = e % KT;
            const int gr = m0 + r, gk = k0 + kk;
            xs[r][kk] = (gr < m && gk < k) ? bf16_to_f32(x[(long long)gr * k + gk]) : 0.0f;
        }
        for (int e = threadIdx.x; e < BN * KT; e += THREADS) {
            const int c = e / KT, kk = e % KT;
            const int gc = n0 + c, gk = k0 + kk;
            ws[c][kk] = (gc < n && gk < k) ? bf16_to_f32(w[(long long)gc * k + gk]) : 0.0f;
        }
        __syncthreads();
        for (int kk = 0; kk < KT; ++kk) {
            const float wv = ws[col][kk];
#pragma unroll
            for (int i = 0; i < RPT; ++i) acc[i] = fmaf(xs[group + GROUPS * i][kk], wv, acc[i]);
        }
        __syncthreads();  // the next tile overwrites xs and ws
    }
    const int gc = n0 + col;
    if (gc >= n) return;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int gr = m0 + group + GROUPS * i;
        if (gr >= m) break;
        const long long at = (long long)gr * n + gc;
        if (out_f32)
            reinterpret_cast<float*>(out)[at] = acc[i];
        else
            reinterpret_cast<bf16*>(out)[at] = f32_to_bf16(acc[i]);
    }
}

// Launch: grid (ceil(n / 64), ceil(m / BM)), block 256.
extern "C" __global__ void __launch_bounds__(THREADS) gemm_fixed_bm4(
    const bf16* x, const bf16* w, void* out, int m, int k, int n, int out_f32) {
    gemm_fixed<4>(x, w, out, m, k, n, out_f32);
}

extern "C" __global__ void __launch_bounds__(THREADS) gemm_fixed_bm16(
    const bf16* x, const bf16* w, void* out, int m, int k, int n, int out_f32) {
    gemm_fixed<16>(x, w, out, m, k, n, out_f32);
}

extern "C" __global__ void __launch_bounds__(THREADS) gemm_fixed_bm64(
    const bf16* x, const bf16* w, void* out, int m, int k, int n, int out_f32) {
    gemm_fixed<64>(x, w, out, m, k, n, out_f32);
}
