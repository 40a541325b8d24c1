// Token selection on f32 logits, one block per row: argmax, and sampling with
// temperature, top-k and top-p. Sampling never sorts: the top-k and top-p cut-offs are
// found by bisection on the bits of a float (exact, 32 block-wide passes), then one
// uniform number (drawn on the host, so runs are reproducible) picks a token by inverse
// CDF in index order. Ties at a cut-off are all kept.
#include "common.cuh"

// Maps a float to an unsigned int with the same order.
__device__ __forceinline__ unsigned int order_key(float f) {
    unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

extern "C" __global__ void argmax(
    const float* __restrict__ logits,  // [rows, vocab]
    int* __restrict__ out,             // [rows]
    int vocab) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* row = logits + (long long)blockIdx.x * vocab;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = row[i];
        if (v > best) { best = v; bi = i; }  // strided, so the first max of this thread
    }
    // Ties go to the lowest index, like the CPU argmax.
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        best = lane < (int)(blockDim.x >> 5) ? sv[lane] : -INFINITY;
        bi = lane < (int)(blockDim.x >> 5) ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
    }
}

// Exclusive prefix sum over the block (blockDim.x a multiple of 32); returns this
// thread's prefix and writes the block total to *total.
__device__ float block_exclusive_scan(float v, float* total) {
    __shared__ float warp_tot[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        float n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();
    if (lane == 31) warp_tot[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nw ? warp_tot[lane] : 0.0f;
        for (int o = 1; o < 32; o <<= 1) {
            float n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        if (lane < nw) warp_tot[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    *total = warp_tot[nw - 1];
    return (warp > 0 ? warp_tot[warp - 1] : 0.0f) + inc - v;
}

// temperature > 0 (the host calls `argmax` for greedy); top_k <= 0 or >= vocab: no top-k;
// top_p >= 1: no top-p. Kept set = logits >= the k-th largest, then the most probable
// tokens whose mass reaches top_p of the top-k mass.
extern "C" __global__ void sample(
    const float* __restrict__ logits,   // [rows, vocab]
    const float* __restrict__ uniform,  // [rows] in [0, 1)
    int* __restrict__ out,              // [rows]
    int vocab, float temperature, int top_k, float top_p) {
    const float* row = logits + (long long)blockIdx.x * vocab;
    const int tid = threadIdx.x;
    float mx = -INFINITY;
    for (int i = tid; i < vocab; i += blockDim.x) mx = fmaxf(mx, row[i]);
    mx = block_max(mx);

    // 1. Top-k cut-off: the largest key with at least top_k logits at or above it.
    unsigned int kcut = 0;
    if (top_k > 0 && top_k < vocab) {
        for (int bit = 31; bit >= 0; --bit) {
            unsigned int cand = kcut | (1u << bit);
            float c = 0.0f;
            for (int i = tid; i < vocab; i += blockDim.x) c += order_key(row[i]) >= cand ? 1.0f : 0.0f;
            if (block_sum(c) >= (float)top_k) kcut = cand;
        }
    }
    const float inv_t = 1.0f / temperature;
    float z = 0.0f;
    for (int i = tid; i < vocab; i += blockDim.x)
        if (order_key(row[i]) >= kcut) z += __expf((row[i] - mx) * inv_t);
    z = block_sum(z);

    // 2. Top-p cut-off on the unnormalised weights e = exp((l - max) / T) > 0, whose
    // float bits order like their values: the largest e* with mass(e >= e*) >= top_p · z.
    unsigned int pcut = 0;
    if (top_p < 1.0f) {
        for (int bit = 30; bit >= 0; --bit) {
            unsigned int cand = pcut | (1u << bit);
            float m = 0.0f;
            for (int i = tid; i < vocab; i += blockDim.x) {
                if (order_key(row[i]) < kcut) continue;
                float e = __expf((row[i] - mx) * inv_t);
                if (__float_as_uint(e) >= cand) m += e;
            }
            if (block_sum(m) >= top_p * z) pcut = cand;
        }
    }

    // 3. Inverse CDF in index order: each thread owns a contiguous chunk.
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int lo = min(tid * chunk, vocab), hi = min(lo + chunk, vocab);
    float mass = 0.0f;
    int last = -1;
    for (int i = lo; i < hi; ++i) {
        if (order_key(row[i]) < kcut) continue;
        float e = __expf((row[i] - mx) * inv_t);
        if (__float_as_uint(e) < pcut) continue;
        mass += e;
        last = i;
    }
    float total;
    const float prefix = block_exclusive_scan(mass, &total);
    const float target = uniform[blockIdx.x] * total;
    // Fallback when rounding puts the target past the end: the last kept token.
    __shared__ int last_kept;
    if (tid == 0) last_kept = 0;
    __syncthreads();
    if (last >= 0) atomicMax(&last_kept, last);
    __syncthreads();
    if (tid == 0) out[blockIdx.x] = last_kept;
    __syncthreads();
    if (last >= 0 && target >= prefix && target < prefix + mass) {
        float acc = prefix;
        int pick = last;
        for (int i = lo; i < hi; ++i) {
            if (order_key(row[i]) < kcut) continue;
            float e = __expf((row[i] - mx) * inv_t);
            if (__float_as_uint(e) < pcut) continue;
            acc += e;
            if (target < acc) { pick = i; break; }
        }
        out[blockIdx.x] = pick;
    }
}
