// The CUDA device language, as much of it as kernels/*.cu use, for an ordinary C++17
// compiler: the kernels' own source then runs on the CPU (emu/core.cpp runs each CUDA
// thread as a fiber), so CI without a GPU tests the real kernel code, its launch
// configuration and its argument list against the CPU twins.
//
// Mapping: __shared__ is a function-local static (blocks run one at a time); the kernel
// units are compiled with -fdata-sections and emu/shared.ld gathers their function-local
// statics into one section, which the runtime fills with 0xFF (NaN, -1) before every
// block, so a read of shared memory nobody wrote in this block shows up; threadIdx &
// co. are globals the scheduler sets before it resumes a fiber; __syncthreads and the
// warp shuffles are barriers that yield to the scheduler. Not supported (compile error or
// launch error): dynamic shared memory (extern __shared__), cooperative groups, textures.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cstddef>
#include <utility>

struct uint3 { unsigned int x, y, z; };
typedef uint3 dim3;
struct __attribute__((aligned(16))) uint4 { unsigned int x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned int x, y; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };

extern "C" {
extern uint3 emu_threadIdx, emu_blockIdx, emu_blockDim, emu_gridDim;
void emu_syncthreads(void);
uint64_t emu_shfl(uint64_t bits, int src_lane, unsigned int mask);
}

#define threadIdx emu_threadIdx
#define blockIdx emu_blockIdx
#define blockDim emu_blockDim
#define gridDim emu_gridDim
#define warpSize 32

// Device functions get internal linkage (no COMDAT copies of their statics).
#define __global__
#define __device__ static
#define __host__
#define __constant__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

// The scheduler switches fibers inside these calls: the compiler must not keep shared
// memory (statics) in registers across them.
#define EMU_FENCE() asm volatile("" ::: "memory")
inline void __syncthreads() {
    EMU_FENCE();
    emu_syncthreads();
    EMU_FENCE();
}
inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    EMU_FENCE();
    emu_shfl(0, 0, mask);
    EMU_FENCE();
}
inline void __threadfence() { EMU_FENCE(); }
inline void __threadfence_block() { EMU_FENCE(); }

inline int emu_lane() { return (int)(emu_threadIdx.x & 31); }

template <class T>
inline T emu_shuffle(T v, int src, unsigned int mask) {
    static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    EMU_FENCE();
    bits = emu_shfl(bits, src, mask);
    EMU_FENCE();
    T out;
    memcpy(&out, &bits, sizeof(T));
    return out;
}
template <class T>
inline T __shfl_sync(unsigned int mask, T v, int src, int width = 32) {
    const int lane = emu_lane();
    return emu_shuffle(v, (lane & ~(width - 1)) + (src & (width - 1)), mask);
}
template <class T>
inline T __shfl_xor_sync(unsigned int mask, T v, int lane_mask, int width = 32) {
    const int lane = emu_lane();
    int src = lane ^ lane_mask;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return emu_shuffle(v, src, mask);
}
template <class T>
inline T __shfl_up_sync(unsigned int mask, T v, unsigned int d, int width = 32) {
    const int lane = emu_lane();
    const int src = (lane & (width - 1)) >= (int)d ? lane - (int)d : lane;
    return emu_shuffle(v, src, mask);
}
template <class T>
inline T __shfl_down_sync(unsigned int mask, T v, unsigned int d, int width = 32) {
    const int lane = emu_lane();
    const int src = (lane & (width - 1)) + (int)d < width ? lane + (int)d : lane;
    return emu_shuffle(v, src, mask);
}

// Bit casts and fast-math intrinsics (the CPU versions are exact; the GPU's are within a
// few ulp, which the checks' tolerances cover).
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
// Rounded multiply, add and subtract that the GPU compiler never contracts into an FMA (nor does
// this build: -ffp-contract=off).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
template <class T> inline T __ldg(const T* p) { return *p; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// Atomics: one OS thread runs a block's fibers and a fiber never yields inside these, so
// plain read-modify-writes are atomic here.
template <class T> inline T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }
template <class T> inline T atomicSub(T* p, T v) { T o = *p; *p = o - v; return o; }
template <class T> inline T atomicMax(T* p, T v) { T o = *p; *p = o > v ? o : v; return o; }
template <class T> inline T atomicMin(T* p, T v) { T o = *p; *p = o < v ? o : v; return o; }
template <class T> inline T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { T o = *p; if (o == cmp) *p = v; return o; }

// Kernel registration: the Rust side generates, per kernels/*.cu file, a translation unit
// that includes this header, the .cu file, then EMU_REGISTER(name) for each kernel.
namespace emu {
typedef void (*Invoker)(void* fn, void** args);
void register_kernel(const char* name, void* fn, Invoker inv, const char* signature);

// One letter per parameter type, checked against the launch's argument list.
template <class T> struct Code;
template <class T> struct Code<T*> { static constexpr char c = 'p'; };
template <> struct Code<int> { static constexpr char c = 'i'; };
template <> struct Code<unsigned int> { static constexpr char c = 'u'; };
template <> struct Code<long long> { static constexpr char c = 'l'; };
template <> struct Code<float> { static constexpr char c = 'f'; };

template <class... A, size_t... I>
void invoke_with(void* fn, void** args, std::index_sequence<I...>) {
    reinterpret_cast<void (*)(A...)>(fn)(*static_cast<A*>(args[I])...);
}
template <class... A>
void invoke(void* fn, void** args) {
    invoke_with<A...>(fn, args, std::index_sequence_for<A...>{});
}
template <class... A>
bool reg(const char* name, void (*f)(A...)) {
    static const char sig[] = {Code<A>::c..., '\0'};
    register_kernel(name, reinterpret_cast<void*>(f), &invoke<A...>, sig);
    return true;
}
}  // namespace emu

#define EMU_REGISTER(name) static bool emu_registered_##name = emu::reg(#name, &name);
