// The emulator's runtime: a grid runs block by block on the calling OS thread; a block's
// threads are fibers (own stack, switched by 15 instructions of x86-64 assembly) that run
// until they reach a barrier (__syncthreads, or a warp shuffle), so every interleaving the
// kernel's barriers allow is one the emulator may produce. Barrier misuse that is
// undefined on a GPU (a barrier not reached by every live thread, a shuffle naming a lane
// that has exited, threads that exit while others wait) is an error of the launch rather
// than silently tolerated. Shared memory is poisoned (0xFF) before every block, and blocks
// alternate between running their threads in forward and reverse order, so a read of
// shared memory that lacks a barrier sees poison or a stale value in one of the two.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <mutex>
#include <string>
#include <vector>

#include "shim.h"

#if !defined(__x86_64__)
#error "the kernel emulator's fiber switch is written for x86-64"
#endif

extern "C" {
uint3 emu_threadIdx, emu_blockIdx, emu_blockDim, emu_gridDim;
// Every kernel's __shared__ variables, gathered by emu/shared.ld.
extern char __emu_shared_begin[], __emu_shared_end[];
}

namespace emu {
namespace {

struct Entry {
    std::string name;
    void* fn;
    Invoker inv;
    std::string sig;
};

std::vector<Entry>& registry() {
    static std::vector<Entry> r;
    return r;
}

// Saves the callee-saved registers on the current stack, stores the stack pointer in
// *save, and resumes the fiber whose stack pointer is `to` (System V ABI).
extern "C" void emu_switch(void** save, void* to);
asm(R"(
    .text
    .p2align 4
    .hidden emu_switch
    .globl emu_switch
    .type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");

enum Wait { NONE, BLOCK_BARRIER, WARP_BARRIER };

struct Fiber {
    void* sp;
    uint3 tid;
    int warp, lane;
    bool done;
    Wait wait;
    uint64_t wait_gen;
};

constexpr size_t STACK = 256 * 1024;
constexpr int MAX_THREADS = 1024;

struct Warp {
    int arrived;    // lanes waiting at the current exchange
    int need;       // lanes the current exchange waits for
    unsigned int mask;
    uint64_t gen;   // bumped when an exchange completes
    uint64_t slot[32];
    uint64_t value[32];  // what each lane reads once the exchange completes
};

struct Block {
    std::vector<Fiber> fibers;
    Warp warps[MAX_THREADS / 32];
    int live, arrived;
    uint64_t gen;
    bool any_exited;
};

// State of the launch in progress (one at a time: launches take a process-wide lock).
char* g_stacks = nullptr;
void* g_sched_sp = nullptr;
Block g_block;
Fiber* g_cur = nullptr;
void* g_fn = nullptr;
Invoker g_inv = nullptr;
void** g_args = nullptr;
std::string g_error;

void yield_to_scheduler() { emu_switch(&g_cur->sp, g_sched_sp); }

[[noreturn]] void fail(const std::string& why) {
    if (g_error.empty()) {
        char where[160];
        snprintf(where, sizeof where, " (block %u,%u,%u thread %u,%u,%u)", emu_blockIdx.x,
                 emu_blockIdx.y, emu_blockIdx.z, g_cur->tid.x, g_cur->tid.y, g_cur->tid.z);
        g_error = why + where;
    }
    g_cur->done = true;  // never resumed; the scheduler stops the launch
    for (;;) yield_to_scheduler();
}

// Releases an exchange once every lane its mask names has arrived.
void try_release_warp(Warp& w) {
    if (w.arrived == 0 || w.arrived < w.need) return;
    for (int l = 0; l < 32; ++l) w.value[l] = w.slot[l];
    w.arrived = 0;
    ++w.gen;
}

void try_release_block(Block& b) {
    if (b.arrived == 0 || b.arrived < b.live) return;
    b.arrived = 0;
    ++b.gen;
}

extern "C" void fiber_main() {
    g_inv(g_fn, g_args);
    Fiber& f = *g_cur;
    f.done = true;
    Block& b = g_block;
    --b.live;
    b.any_exited = true;
    Warp& w = b.warps[f.warp];
    if (b.arrived > 0) {
        // Threads are waiting at __syncthreads that this one never reached.
        fail("a thread exited while others wait at __syncthreads (barrier in divergent code)");
    }
    if (w.arrived > 0 && (w.mask >> f.lane & 1u))
        fail("a lane exited while its warp waits for it at a shuffle");
    for (;;) yield_to_scheduler();
}

bool ready(const Fiber& f) {
    switch (f.wait) {
        case BLOCK_BARRIER: return g_block.gen != f.wait_gen;
        case WARP_BARRIER: return g_block.warps[f.warp].gen != f.wait_gen;
        default: return true;
    }
}

bool g_reverse = false;  // this block runs its threads in reverse order

// Another lane of the calling fiber's warp that can run, in the block's order, or null.
Fiber* next_lane() {
    const Fiber& me = *g_cur;
    const int base = me.warp * 32, n = (int)g_block.fibers.size();
    for (int i = 1; i < 32; ++i) {
        const int lane = g_reverse ? (me.lane + 32 - i) % 32 : (me.lane + i) % 32;
        if (base + lane >= n) continue;
        Fiber& f = g_block.fibers[base + lane];
        if (!f.done && ready(f)) return &f;
    }
    return nullptr;
}

// Waits at the barrier the fiber has just arrived at. A shuffle only needs the other
// lanes of its warp to arrive, so the fiber switches straight to one of them (the
// scheduler's round over the whole block costs several times more); a block barrier,
// or a warp with no lane that can run, goes back to the scheduler.
void wait_until_ready() {
    while (!ready(*g_cur)) {
        Fiber* next = g_cur->wait == WARP_BARRIER ? next_lane() : nullptr;
        if (!next) {
            yield_to_scheduler();
            continue;
        }
        Fiber* me = g_cur;
        g_cur = next;
        emu_threadIdx = next->tid;
        emu_switch(&me->sp, next->sp);  // back when someone switches to `me` again
    }
    g_cur->wait = NONE;
}

// Runs one block to completion; false (and g_error) when it could not finish.
bool run_block(int threads, bool reverse) {
    Block& b = g_block;
    memset(__emu_shared_begin, 0xff, __emu_shared_end - __emu_shared_begin);
    b.fibers.assign(threads, Fiber{});
    b.live = threads;
    b.arrived = 0;
    b.gen = 0;
    b.any_exited = false;
    for (int w = 0; w < (threads + 31) / 32; ++w) {
        Warp& wp = b.warps[w];
        wp.arrived = 0;
        wp.gen = 0;
    }
    for (int i = 0; i < threads; ++i) {
        Fiber& f = b.fibers[i];
        const unsigned bx = emu_blockDim.x, by = emu_blockDim.y;
        f.tid = uint3{i % bx, (i / bx) % by, i / (bx * by)};
        f.warp = i / 32;
        f.lane = i % 32;
        // A fresh stack whose first resume "returns" into fiber_main with the stack
        // aligned as after a call.
        uintptr_t* sp = reinterpret_cast<uintptr_t*>(g_stacks + (size_t)(i + 1) * STACK);
        *--sp = 0;
        *--sp = reinterpret_cast<uintptr_t>(&fiber_main);
        for (int r = 0; r < 6; ++r) *--sp = 0;
        f.sp = sp;
    }
    g_reverse = reverse;
    // Rounds over the block, resuming every fiber that can run. A resumed fiber may hand
    // over to other lanes of its warp before control comes back here, so completion is
    // counted at the end of a round.
    for (;;) {
        bool progressed = false;
        for (int k = 0; k < threads; ++k) {
            Fiber& f = b.fibers[reverse ? threads - 1 - k : k];
            if (f.done || !ready(f)) continue;
            g_cur = &f;
            emu_threadIdx = f.tid;
            emu_switch(&g_sched_sp, f.sp);
            if (!g_error.empty()) return false;
            progressed = true;
        }
        int finished = 0;
        for (const Fiber& f : b.fibers) finished += f.done;
        if (finished == threads) break;
        if (!progressed) {
            g_error = "deadlock: threads wait at barriers that cannot complete "
                      "(__syncthreads or a shuffle not reached by every thread it needs)";
            return false;
        }
    }
    return true;
}

}  // namespace

void register_kernel(const char* name, void* fn, Invoker inv, const char* signature) {
    registry().push_back(Entry{name, fn, inv, signature});
}

}  // namespace emu

using namespace emu;

extern "C" void emu_syncthreads(void) {
    Block& b = g_block;
    Fiber& f = *g_cur;
    if (b.any_exited) fail("__syncthreads after some threads of the block exited");
    f.wait = BLOCK_BARRIER;
    f.wait_gen = b.gen;
    ++b.arrived;
    try_release_block(b);
    wait_until_ready();
}

extern "C" uint64_t emu_shfl(uint64_t bits, int src_lane, unsigned int mask) {
    Fiber& f = *g_cur;
    Warp& w = g_block.warps[f.warp];
    if (!(mask >> f.lane & 1u)) fail("a shuffle's mask does not include the calling lane");
    const int base = f.warp * 32, threads = (int)g_block.fibers.size();
    if (w.arrived == 0) {
        w.mask = mask;
        w.need = 0;
        for (int l = 0; l < 32 && base + l < threads; ++l) {
            if (!(mask >> l & 1u)) continue;
            if (g_block.fibers[base + l].done)
                fail("a shuffle's mask names a lane that has exited");
            ++w.need;
        }
    } else if (w.mask != mask) {
        fail("lanes of one warp shuffle with different masks");
    }
    if (src_lane < 0 || src_lane > 31 || !(mask >> src_lane & 1u) ||
        base + src_lane >= threads || g_block.fibers[base + src_lane].done)
        fail("a shuffle reads a lane that is not taking part (exited or outside the mask)");
    w.slot[f.lane] = bits;
    f.wait = WARP_BARRIER;
    f.wait_gen = w.gen;
    ++w.arrived;
    try_release_warp(w);
    wait_until_ready();
    return w.value[src_lane];
}

// Launches `name` over the grid; `args` as for cuLaunchKernel (one pointer per parameter),
// `signature` one letter per argument (p pointer, i int, u unsigned, l long long, f float).
// Returns 0, or -1 with a one-line reason in `err`.
extern "C" int kemu_launch(const char* name, const char* signature, const unsigned* grid,
                           const unsigned* block, unsigned shared_bytes, void** args,
                           char* err, size_t err_len) {
    static std::mutex lock;
    std::lock_guard<std::mutex> guard(lock);
    auto error = [&](const std::string& why) {
        snprintf(err, err_len, "%s: %s", name, why.c_str());
        return -1;
    };
    const Entry* e = nullptr;
    for (const Entry& x : registry())
        if (x.name == name) e = &x;
    if (!e) return error("no such kernel in the emulator (is it in ops::KERNELS?)");
    if (e->sig != signature)
        return error("the kernel takes (" + e->sig + "), the launch passes (" + signature + ")");
    const unsigned threads = block[0] * block[1] * block[2];
    if (threads == 0 || threads > MAX_THREADS || block[2] > 64)
        return error("invalid block size " + std::to_string(threads));
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[1] > 65535 || grid[2] > 65535)
        return error("invalid grid");
    if (shared_bytes != 0) return error("dynamic shared memory is not emulated");
    if (!g_stacks) {
        void* m = mmap(nullptr, STACK * (MAX_THREADS + 1), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return error("cannot map fiber stacks");
        g_stacks = static_cast<char*>(m);
    }
    g_fn = e->fn;
    g_inv = e->inv;
    g_args = args;
    g_error.clear();
    emu_gridDim = uint3{grid[0], grid[1], grid[2]};
    emu_blockDim = uint3{block[0], block[1], block[2]};
    uint64_t n = 0;
    for (unsigned z = 0; z < grid[2]; ++z)
        for (unsigned y = 0; y < grid[1]; ++y)
            for (unsigned x = 0; x < grid[0]; ++x, ++n) {
                emu_blockIdx = uint3{x, y, z};
                if (!run_block((int)threads, n & 1)) return error(g_error);
            }
    return 0;
}
