// The CUDA tile kernel's source (ggml/cuda/deltaspec_tq_attn_tile.cuh, tq_decode_attn_tile) run on the
// host against a float64 reference of the same attention, for tests/test_tq_attn_tile_host.py (CPU-only:
// the GPU tests are tests/test_gpu_turboquant.py). A block's 128 threads are std::threads; __syncthreads
// is a barrier of all 128, a shuffle writes a slot per thread and reads its partner's between two
// barriers of the warp's 32. The cache rows are random bytes (any bytes are a tq row) with random
// scales, and the rows a stream does not see get NaN scales: the kernel must never read them.
//
// Usage: tq_attn_tile_host [skip_last_row]   (the kernel's planted bug on)
// Prints one line per case: "case <shape> rel <max |diff| / max |value|> blocks <n>".
#include <barrier>
#include <thread>
#include <vector>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <algorithm>
typedef uint16_t f16_bits;
static float f16_to_f32(uint16_t h) {
    const uint32_t s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023; float v;
    if (e == 0) v = std::ldexp((float)m, -24); else if (e == 31) v = m ? NAN : INFINITY; else v = std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
static uint16_t f32_to_f16(float f) {  // round to nearest for the normal range used here, inf/zero
    if (std::isinf(f)) return f < 0 ? 0xfc00 : 0x7c00;
    if (f == 0) return 0;
    const uint16_t s = f < 0 ? 0x8000 : 0; f = std::fabs(f); int e; float m = std::frexp(f, &e);  // f = m 2^e, m in [0.5,1)
    int mant = (int)std::lrint(m * 2048) ; // 11 bits incl. implicit
    if (mant == 2048) { mant = 1024; ++e; }
    return s | (uint16_t)((e + 14) << 10) | (uint16_t)(mant & 1023);
}
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local Dim3 t_tid;
static Dim3 g_bid, g_gdim;
static std::barrier<> * g_block_bar;
static std::barrier<> * g_warp_bar[4];
static float g_slot[128];
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __constant__ static const
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(x) __attribute__((aligned(x)))
#define threadIdx (t_tid)
#define blockIdx (g_bid)
#define gridDim (g_gdim)
struct half { f16_bits bits; };
struct float4 { float x, y, z, w; };
inline float __half2float(half h) { return f16_to_f32(h.bits); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline half __float2half_rn(float f) { return {f32_to_f16(f)}; }
inline unsigned short __half_as_ushort(half h) { return h.bits; }
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void __syncwarp() { g_warp_bar[t_tid.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int m) {
    const int t = t_tid.x, w = t / 32;
    g_slot[t] = v;
    g_warp_bar[w]->arrive_and_wait();
    const float o = g_slot[(t & ~31) | ((t & 31) ^ m)];
    g_warp_bar[w]->arrive_and_wait();
    return o;
}
using std::min;
#include "deltaspec_tq_attn_tile.cuh"

using namespace deltaspec_tq_attn;

template <int D, int BK, int BV>
void run(int64_t n_kv, int Hkv, int G, int N, int64_t chunk, bool bug, uint32_t seed) {
    const int H = Hkv * G;
    const size_t hbk = 2 + D * BK / 8, hbv = 2 + D * BV / 8;
    // row j, head h, stream n at j * nb1 + h * nb2 + n * nb3, with 3 spare rows between streams
    const size_t k_nb1 = Hkv * hbk, k_nb2 = hbk, k_nb3 = (n_kv + 3) * k_nb1;
    const size_t v_nb1 = Hkv * hbv, v_nb2 = hbv, v_nb3 = (n_kv + 3) * v_nb1;
    std::mt19937 rng(seed);
    std::vector<uint8_t> K(k_nb3 * N), V(v_nb3 * N);
    for (auto & b : K) b = rng() & 255;
    for (auto & b : V) b = rng() & 255;
    std::normal_distribution<float> nd;
    auto set_scale = [&](uint8_t * p) { f16_bits h = f32_to_f16(0.5f + std::fabs(nd(rng))); memcpy(p, &h, 2); };
    for (int n = 0; n < N; ++n) for (int64_t j = 0; j < n_kv; ++j) for (int h = 0; h < Hkv; ++h) {
        set_scale(&K[n * k_nb3 + j * k_nb1 + h * k_nb2]);
        set_scale(&V[n * v_nb3 + j * v_nb1 + h * v_nb2]);
    }
    std::vector<float> q((size_t)N * H * D);
    for (auto & x : q) x = nd(rng) * 0.3f;
    // mask [n_kv, 1, 1, N]: stream n sees rows <= n_kv - 1 - 37 n but every 11th; masked rows get NaN scales
    std::vector<f16_bits> mask((size_t)N * n_kv);
    for (int n = 0; n < N; ++n) for (int64_t j = 0; j < n_kv; ++j) {
        const bool vis = j <= n_kv - 1 - 37 * n && j % 11 != 5;
        mask[n * n_kv + j] = f32_to_f16(vis ? 0.0f : -INFINITY);
        if (!vis) for (int h = 0; h < Hkv; ++h) {
            f16_bits nan = 0x7e00;
            memcpy(&K[n * k_nb3 + j * k_nb1 + h * k_nb2], &nan, 2);
            memcpy(&V[n * v_nb3 + j * v_nb1 + h * v_nb2], &nan, 2);
        }
    }
    const float scale = 1.0f / std::sqrt((float)D);
    const int64_t n_split = (n_kv + chunk - 1) / chunk;
    std::vector<float> part((size_t)n_split * N * H * (D + 2), 12345.0f);
    g_gdim = {(unsigned)n_split, (unsigned)Hkv, (unsigned)N};
    std::barrier<> bb(128); std::barrier<> wb0(32), wb1(32), wb2(32), wb3(32);
    g_block_bar = &bb; g_warp_bar[0] = &wb0; g_warp_bar[1] = &wb1; g_warp_bar[2] = &wb2; g_warp_bar[3] = &wb3;
    for (int n = 0; n < N; ++n) for (int hk = 0; hk < Hkv; ++hk) for (int64_t s = 0; s < n_split; ++s) {
        g_bid = {(unsigned)s, (unsigned)hk, (unsigned)n};
        std::vector<std::thread> th;
        for (int t = 0; t < 128; ++t) th.emplace_back([&, t] {
            t_tid = {(unsigned)t, 0, 0};
            tq_decode_attn_tile<D, BK, BV>(q.data(), (const char *)K.data(), k_nb1, k_nb2, k_nb3, (const char *)V.data(),
                                           v_nb1, v_nb2, v_nb3, (const char *)mask.data(), n_kv * 2, N, n_kv, H, G, scale,
                                           chunk, bug, part.data());
        });
        for (auto & x : th) x.join();
    }
    // the splits merged by tq_decode_merge_coords (no barriers: its threads run one after another),
    // against attention over the decoded rows in float64
    std::vector<float> merged((size_t)N * H * D, 12345.0f);
    for (int64_t hn = 0; hn < (int64_t)N * H; ++hn) {
        g_bid = {(unsigned)hn, 0, 0};
        for (int i = 0; i < D; ++i) {
            t_tid = {(unsigned)i, 0, 0};
            tq_decode_merge_coords<D>(part.data(), n_split, merged.data());
        }
    }
    auto cent = [](int bits, int k) { return bits == 3 ? deltaspec_tq3_centroids[dim_index<D>()][k] : deltaspec_tq4_centroids[dim_index<D>()][k]; };
    auto code = [](int bits, const uint8_t * qs, int i) {
        return bits == 3 ? ((qs[i / 4] >> (2 * (i % 4))) & 3) | ((qs[D / 4 + i / 8] >> (i % 8)) & 1) << 2 : (qs[i / 2] >> (4 * (i % 2))) & 15;
    };
    double max_diff = 0, max_val = 0;
    for (int n = 0; n < N; ++n) for (int h = 0; h < H; ++h) {
        const int hk = h / G;
        const float * o = &merged[(size_t)(n * H + h) * D];
        // reference
        std::vector<double> sc(n_kv, -INFINITY); double m = -INFINITY;
        for (int64_t j = 0; j < n_kv; ++j) {
            if (f16_to_f32(mask[n * n_kv + j]) == -INFINITY) continue;
            const uint8_t * r = &K[n * k_nb3 + j * k_nb1 + hk * k_nb2]; f16_bits d; memcpy(&d, r, 2);
            double dot = 0; for (int i = 0; i < D; ++i) dot += (double)q[(size_t)(n * H + h) * D + i] * cent(BK, code(BK, r + 2, i));
            sc[j] = dot * f16_to_f32(d) * scale; m = std::max(m, sc[j]);
        }
        double Sr = 0; std::vector<double> ref(D, 0);
        for (int64_t j = 0; j < n_kv; ++j) { if (sc[j] == -INFINITY) continue; const double w = std::exp(sc[j] - m); Sr += w;
            const uint8_t * r = &V[n * v_nb3 + j * v_nb1 + hk * v_nb2]; f16_bits d; memcpy(&d, r, 2);
            for (int i = 0; i < D; ++i) ref[i] += w * f16_to_f32(d) * cent(BV, code(BV, r + 2, i)); }
        for (int i = 0; i < D; ++i) { const double a = o[i], b = ref[i] / Sr; max_diff = std::max(max_diff, std::fabs(a - b)); max_val = std::max(max_val, std::fabs(b)); }
    }
    printf("case D=%d K=tq%d V=tq%d n_kv=%lld Hkv=%d G=%d N=%d chunk=%lld rel %.3g blocks %lld\n", D, BK, BV,
           (long long)n_kv, Hkv, G, N, (long long)chunk, max_diff / max_val, (long long)(n_split * Hkv * N));
}

// n_kv, KV heads, query heads per KV head, streams, rows per block (a multiple of 128: several tiles
// per block, partial last tiles, a split of one partial tile)
int main(int argc, char ** argv) {
    const bool bug = argc > 1 && std::strcmp(argv[1], "skip_last_row") == 0;
    run<256, 3, 3>(1000, 2, 6, 2, 256, bug, 1);
    run<256, 4, 3>(300, 1, 8, 1, 128, bug, 2);
    run<256, 3, 4>(257, 2, 1, 1, 384, bug, 3);
    run<256, 4, 4>(520, 1, 2, 1, 512, bug, 7);
    run<128, 4, 4>(700, 2, 3, 3, 128, bug, 4);
    run<128, 3, 3>(130, 1, 5, 1, 128, bug, 5);
    run<128, 3, 4>(1000, 1, 7, 1, 512, bug, 6);
    run<128, 4, 3>(200, 3, 8, 2, 256, bug, 8);
    return 0;
}
