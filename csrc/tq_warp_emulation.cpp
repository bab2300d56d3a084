// The CUDA tq kernels' source (ggml/cuda/deltaspec_tq_warp.cuh) compiled and run on the host, for
// tests: the bytes that source writes against the CPU codec's (tests/test_turboquant.py, CPU-only),
// and against what the device wrote (bench/tq_cuda_diag.py on the GPU machine).
//
// How a warp runs here: its 32 lanes are ucontext coroutines on one thread, resumed round-robin, so
// every lane reaches a warp-wide point (a shuffle, __syncwarp) before any lane passes it, which is
// the lockstep the kernels rely on. The intrinsics are the IEEE operations they name, one rounding
// each (the fused multiply-add is std::fmaf; this file is compiled with -ffp-contract=off), with the
// device's flush-to-zero of denormal operands and results (-use_fast_math's .ftz forms).
//
// Planted bug for the tests (DELTASPEC_TEST_TQ_BUG=cuda_shuffle_partner, read once per process): the
// emulated shuffle pairs lane l with l ^ 8 where the source asks l ^ 16, as a wrong shuffle mask
// would; the rotation and the quantizer's sums then differ from the CPU's.
#include "tq_warp_emulation.h"

#include <ucontext.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ggml.h"

namespace deltaspec {
namespace {

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};

// One warp being run: its lanes' contexts and the slots its shuffles exchange through.
struct WarpRun {
    ucontext_t scheduler;
    ucontext_t lanes[32];
    bool done[32] = {};
    float slot[32] = {};
    int current = 0;
    Dim3 block, thread_base;
    void (*body)(void *) = nullptr;
    void * arg = nullptr;
};

WarpRun * g_warp = nullptr;  // the warp being run (one at a time, on the calling thread)
EmulationStats g_stats;

bool planted_shuffle_partner() {
    static const bool on = [] {
        const char * bug = std::getenv("DELTASPEC_TEST_TQ_BUG");
        return bug != nullptr && std::strcmp(bug, "cuda_shuffle_partner") == 0;
    }();
    return on;
}

// back to the scheduler until every lane of the warp has reached this point too
void warp_point() { swapcontext(&g_warp->lanes[g_warp->current], &g_warp->scheduler); }

Dim3 current_thread_idx() {
    Dim3 t = g_warp->thread_base;
    t.x += (unsigned)g_warp->current;
    return t;
}

float ftz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }

}  // namespace
}  // namespace deltaspec

// --- host stand-ins of what deltaspec_tq_warp.cuh uses ---------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __constant__ static const
#define __shared__ static
#define threadIdx (deltaspec::current_thread_idx())
#define blockIdx (deltaspec::g_warp->block)

namespace {

struct half {
    ggml_fp16_t bits;
};

inline float __fadd_rn(float a, float b) { return deltaspec::ftz(deltaspec::ftz(a) + deltaspec::ftz(b)); }
inline float __fsub_rn(float a, float b) { return deltaspec::ftz(deltaspec::ftz(a) - deltaspec::ftz(b)); }
inline float __fmul_rn(float a, float b) { return deltaspec::ftz(deltaspec::ftz(a) * deltaspec::ftz(b)); }
inline float __fdiv_rn(float a, float b) { return deltaspec::ftz(deltaspec::ftz(a) / deltaspec::ftz(b)); }
inline float __fsqrt_rn(float a) { return deltaspec::ftz(std::sqrt(deltaspec::ftz(a))); }
inline float __fmaf_rn(float a, float b, float c) {
    return deltaspec::ftz(std::fmaf(deltaspec::ftz(a), deltaspec::ftz(b), deltaspec::ftz(c)));
}
inline half __float2half_rn(float f) { return {ggml_fp32_to_fp16(f)}; }
inline unsigned short __half_as_ushort(half h) { return h.bits; }

float __shfl_xor_sync(unsigned /*mask*/, float v, int m) {
    deltaspec::WarpRun & w = *deltaspec::g_warp;
    const int lane = w.current;
    if (m == 16 && deltaspec::planted_shuffle_partner()) m = 8;
    w.slot[lane] = v;
    deltaspec::warp_point();  // every lane has written its slot
    const float other = w.slot[lane ^ m];
    deltaspec::warp_point();  // every lane has read before any writes again
    ++deltaspec::g_stats.shuffles;
    return other;
}

void __syncwarp() { deltaspec::warp_point(); }

}  // namespace

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunknown-pragmas"  // the source's #pragma unroll
#include "deltaspec_tq_warp.cuh"
#pragma GCC diagnostic pop

namespace deltaspec {
namespace {

void lane_entry() {
    WarpRun & w = *g_warp;
    w.body(w.arg);
    w.done[w.current] = true;  // returning resumes the scheduler (uc_link)
}

// Runs body(arg) as the 32 lanes of warp `warp` of block `block` (blockDim.x = 32 * kWarpsPerBlock).
void run_warp(unsigned block, unsigned warp, void (*body)(void *), void * arg) {
    constexpr size_t kStack = 64 * 1024;
    static std::vector<char> stacks(32 * kStack);  // reused by every warp (one warp runs at a time)
    WarpRun w;
    w.block.x = block;
    w.thread_base.x = warp * 32;
    w.body = body;
    w.arg = arg;
    for (int l = 0; l < 32; ++l) {
        getcontext(&w.lanes[l]);
        w.lanes[l].uc_stack.ss_sp = stacks.data() + l * kStack;
        w.lanes[l].uc_stack.ss_size = kStack;
        w.lanes[l].uc_link = &w.scheduler;
        makecontext(&w.lanes[l], lane_entry, 0);
    }
    WarpRun * outer = g_warp;
    g_warp = &w;
    for (bool all_done = false; !all_done;) {
        all_done = true;
        for (int l = 0; l < 32; ++l) {
            if (w.done[l]) continue;
            w.current = l;
            swapcontext(&w.scheduler, &w.lanes[l]);
            all_done = all_done && w.done[l];
        }
        // lanes leave together or not at all: a warp whose lanes disagree would deadlock on the device
        bool any = false, every = true;
        for (int l = 0; l < 32; ++l) {
            any = any || w.done[l];
            every = every && w.done[l];
        }
        if (any && !every) {
            g_warp = outer;
            throw std::logic_error("tq warp emulation: the lanes of a warp diverged at a warp-wide point");
        }
    }
    g_warp = outer;
    ++g_stats.warps;
}

template <class Launch> void run_grid(int64_t n_warps, Launch & launch) {
    using deltaspec_tq_warp::kWarpsPerBlock;
    const int64_t n_blocks = (n_warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
    for (int64_t b = 0; b < n_blocks; ++b) {
        for (int w = 0; w < kWarpsPerBlock; ++w) {
            run_warp((unsigned)b, (unsigned)w, [](void * p) { (*(Launch *)p)(); }, &launch);
        }
    }
}

template <int BITS, int D> void quantize_d(const float * x, int64_t n, uint8_t * out) {
    std::vector<int64_t> idx(n);
    for (int64_t i = 0; i < n; ++i) idx[i] = i;
    const size_t hb = 2 + D * BITS / 8;
    auto launch = [&] {
        deltaspec_tq_warp::tq_quantize<BITS, D>((const char *)x, D * sizeof(float), idx.data(), (char *)out, hb, n, 1);
    };
    run_grid(n, launch);
}

template <int D> void rotate_d(const float * x, int64_t n, float * out, bool inverse) {
    auto launch = [&] {
        deltaspec_tq_warp::tq_rotate<D>((const char *)x, D * sizeof(float), 0, 0, n, 1, n, out, inverse);
    };
    run_grid(n, launch);
}

}  // namespace

void tq_cuda_source_quantize(int bits, int64_t head_dim, int64_t n, const float * x, uint8_t * out) {
    switch (head_dim * 10 + bits) {
        case 323: quantize_d<3, 32>(x, n, out); break;
        case 324: quantize_d<4, 32>(x, n, out); break;
        case 643: quantize_d<3, 64>(x, n, out); break;
        case 644: quantize_d<4, 64>(x, n, out); break;
        case 1283: quantize_d<3, 128>(x, n, out); break;
        case 1284: quantize_d<4, 128>(x, n, out); break;
        case 2563: quantize_d<3, 256>(x, n, out); break;
        case 2564: quantize_d<4, 256>(x, n, out); break;
        default:
            throw std::invalid_argument("tq_cuda_source_quantize: bits 3 or 4 and head dim 32, 64, 128 or 256, got " +
                                        std::to_string(bits) + ", " + std::to_string(head_dim));
    }
}

void tq_cuda_source_rotate(int64_t head_dim, int64_t n, const float * x, float * out, bool inverse) {
    switch (head_dim) {
        case 32: rotate_d<32>(x, n, out, inverse); break;
        case 64: rotate_d<64>(x, n, out, inverse); break;
        case 128: rotate_d<128>(x, n, out, inverse); break;
        case 256: rotate_d<256>(x, n, out, inverse); break;
        default:
            throw std::invalid_argument("tq_cuda_source_rotate: head dim 32, 64, 128 or 256, got " +
                                        std::to_string(head_dim));
    }
}

EmulationStats tq_cuda_source_stats() { return g_stats; }

}  // namespace deltaspec
