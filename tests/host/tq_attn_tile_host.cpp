// The CUDA tile kernel's source (ggml/cuda/deltaspec_tq_attn_tile.cuh, tq_decode_attn_tile) run on the
// host against a float64 reference of the same attention, for tests/test_tq_attn_tile_host.py (CPU-only:
// the GPU tests are tests/test_gpu_turboquant.py). A block's 128 threads are std::threads; __syncthreads
// is a barrier of all 128, a shuffle writes a slot per thread and reads its partner's between two
// barriers of the warp's 32. The cache rows are random bytes (any bytes are a tq row) with random
// scales, and the rows a stream does not see get NaN scales: the kernel must never read them.
//
// Usage: tq_attn_tile_host [skip_last_row]   (the kernel's planted bug on)
// Prints one line per case: "case <shape> rel <max |diff| / max |value|> blocks <n>".
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {

using f16_bits = uint16_t;

float f16_to_f32(f16_bits h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024), e - 25);
    return h >> 15 ? -v : v;
}

// to nearest; normal values, zeros and infinities (what the cases use)
f16_bits f32_to_f16(float f) {
    const f16_bits sign = std::signbit(f) ? 0x8000 : 0;
    if (std::isinf(f)) return sign | 0x7c00;
    if (f == 0.0f) return sign;
    int e;
    int mant = (int)std::lrint(std::frexp(std::fabs(f), &e) * 2048);  // |f| = mant / 2048 * 2^e, 11 bits
    if (mant == 2048) {
        mant = 1024;
        ++e;
    }
    return sign | (f16_bits)((e + 14) << 10) | (f16_bits)(mant & 1023);
}

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};

thread_local Dim3 t_thread;  // this std::thread's threadIdx
Dim3 g_block, g_grid;
std::barrier<> * g_block_barrier;
std::barrier<> * g_warp_barrier[4];
float g_shuffle_slot[128];

}  // namespace

// --- host stand-ins of what the kernel's source uses ------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __constant__ static const
#define __shared__ static  // one block runs at a time: a static local is the block's shared memory
#define __launch_bounds__(...)
#define __align__(x) __attribute__((aligned(x)))
#define threadIdx (t_thread)
#define blockIdx (g_block)
#define gridDim (g_grid)

struct half {
    f16_bits bits;
};
struct float4 {
    float x, y, z, w;
};
inline float __half2float(half h) { return f16_to_f32(h.bits); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline half __float2half_rn(float f) { return {f32_to_f16(f)}; }
inline unsigned short __half_as_ushort(half h) { return h.bits; }
inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
inline void __syncwarp() { g_warp_barrier[t_thread.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    const int t = (int)t_thread.x, w = t / 32;
    g_shuffle_slot[t] = v;
    g_warp_barrier[w]->arrive_and_wait();  // every thread of the warp has written its slot
    const float other = g_shuffle_slot[(t & ~31) | ((t & 31) ^ lane_mask)];
    g_warp_barrier[w]->arrive_and_wait();  // and read its partner's before any writes again
    return other;
}
using std::min;

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunknown-pragmas"  // the source's #pragma unroll
#include "deltaspec_tq_attn_tile.cuh"
#pragma GCC diagnostic pop

using namespace deltaspec_tq_attn;

namespace {

// the value of code k at head dim D (the codebook header's host tables)
template <int D> float centroid_of(int bits, int k) {
    return bits == 3 ? deltaspec_tq3_centroids[dim_index<D>()][k] : deltaspec_tq4_centroids[dim_index<D>()][k];
}

// the code of value i of a row's packed bits (qs: past the scale), as ggml/deltaspec_tq.h lays them out
template <int D> int code_of(int bits, const uint8_t * qs, int i) {
    return bits == 3 ? ((qs[i / 4] >> (2 * (i % 4))) & 3) | ((qs[D / 4 + i / 8] >> (i % 8)) & 1) << 2
                     : (qs[i / 2] >> (4 * (i % 2))) & 15;
}

float scale_of(const uint8_t * row) {
    f16_bits d;
    memcpy(&d, row, 2);
    return f16_to_f32(d);
}

// One node: N streams of n_kv rows of Hkv heads, G query heads per KV head, blocks of `chunk` rows.
template <int D, int BK, int BV>
void run(int64_t n_kv, int Hkv, int G, int N, int64_t chunk, bool bug, uint32_t seed) {
    const int H = Hkv * G;
    const size_t k_head = 2 + D * BK / 8, v_head = 2 + D * BV / 8;
    // row j, head h, stream n at j * nb1 + h * nb2 + n * nb3, with 3 spare rows between streams
    const size_t k_nb1 = Hkv * k_head, k_nb2 = k_head, k_nb3 = (n_kv + 3) * k_nb1;
    const size_t v_nb1 = Hkv * v_head, v_nb2 = v_head, v_nb3 = (n_kv + 3) * v_nb1;
    auto k_row = [&](std::vector<uint8_t> & K, int n, int64_t j, int h) { return &K[n * k_nb3 + j * k_nb1 + h * k_nb2]; };
    auto v_row = [&](std::vector<uint8_t> & V, int n, int64_t j, int h) { return &V[n * v_nb3 + j * v_nb1 + h * v_nb2]; };

    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    std::vector<uint8_t> K(k_nb3 * N), V(v_nb3 * N);
    for (auto & b : K) b = rng() & 255;
    for (auto & b : V) b = rng() & 255;
    std::vector<float> q((size_t)N * H * D);
    for (auto & x : q) x = normal(rng) * 0.3f;
    // stream n sees rows up to n_kv - 1 - 37 n but every 11th; the rows it does not see get NaN
    // scales (an unwritten cache row may hold anything), the others scales in [0.5, ~4]
    std::vector<f16_bits> mask((size_t)N * n_kv);
    for (int n = 0; n < N; ++n) {
        for (int64_t j = 0; j < n_kv; ++j) {
            const bool visible = j <= n_kv - 1 - 37 * n && j % 11 != 5;
            mask[n * n_kv + j] = f32_to_f16(visible ? 0.0f : -INFINITY);
            for (int h = 0; h < Hkv; ++h) {
                const f16_bits kd = visible ? f32_to_f16(0.5f + std::fabs(normal(rng))) : 0x7e00;
                const f16_bits vd = visible ? f32_to_f16(0.5f + std::fabs(normal(rng))) : 0x7e00;
                memcpy(k_row(K, n, j, h), &kd, 2);
                memcpy(v_row(V, n, j, h), &vd, 2);
            }
        }
    }
    const float scale = 1.0f / std::sqrt((float)D);

    // the kernel: block by block, each block's threads as std::threads
    const int64_t n_split = (n_kv + chunk - 1) / chunk;
    std::vector<float> part((size_t)n_split * N * H * (D + 2), 12345.0f);
    g_grid = {(unsigned)n_split, (unsigned)Hkv, (unsigned)N};
    std::barrier<> block_barrier(kTileRows), w0(32), w1(32), w2(32), w3(32);
    g_block_barrier = &block_barrier;
    g_warp_barrier[0] = &w0;
    g_warp_barrier[1] = &w1;
    g_warp_barrier[2] = &w2;
    g_warp_barrier[3] = &w3;
    for (int n = 0; n < N; ++n) {
        for (int hk = 0; hk < Hkv; ++hk) {
            for (int64_t s = 0; s < n_split; ++s) {
                g_block = {(unsigned)s, (unsigned)hk, (unsigned)n};
                std::vector<std::thread> threads;
                for (int t = 0; t < kTileRows; ++t) {
                    threads.emplace_back([&, t] {
                        t_thread = {(unsigned)t, 0, 0};
                        tq_decode_attn_tile<D, BK, BV>(q.data(), (const char *)K.data(), k_nb1, k_nb2, k_nb3,
                                                       (const char *)V.data(), v_nb1, v_nb2, v_nb3,
                                                       (const char *)mask.data(), n_kv * sizeof(f16_bits), N, n_kv, H,
                                                       G, scale, chunk, bug, part.data());
                    });
                }
                for (auto & th : threads) th.join();
            }
        }
    }
    // the splits merged by merge_attention_splits (no barriers: its threads run one after another)
    std::vector<float> merged((size_t)N * H * D, 12345.0f);
    for (int64_t hn = 0; hn < (int64_t)N * H; ++hn) {
        g_block = {(unsigned)hn, 0, 0};
        for (int i = 0; i < D; ++i) {
            t_thread = {(unsigned)i, 0, 0};
            deltaspec_attn::merge_attention_splits<D>(part.data(), n_split, merged.data());
        }
    }

    // against softmax attention over the rows' values in float64
    double max_diff = 0, max_value = 0;
    for (int n = 0; n < N; ++n) {
        for (int h = 0; h < H; ++h) {
            const int hk = h / G;
            const float * qh = &q[(size_t)(n * H + h) * D];
            std::vector<double> score(n_kv, -INFINITY), want(D, 0.0);
            double m = -INFINITY, sum = 0.0;
            for (int64_t j = 0; j < n_kv; ++j) {
                if (f16_to_f32(mask[n * n_kv + j]) == -INFINITY) continue;
                const uint8_t * r = k_row(K, n, j, hk);
                double dot = 0.0;
                for (int i = 0; i < D; ++i) dot += (double)qh[i] * centroid_of<D>(BK, code_of<D>(BK, r + 2, i));
                score[j] = dot * scale_of(r) * scale;
                m = std::max(m, score[j]);
            }
            for (int64_t j = 0; j < n_kv; ++j) {
                if (score[j] == -INFINITY) continue;
                const double w = std::exp(score[j] - m);
                const uint8_t * r = v_row(V, n, j, hk);
                sum += w;
                for (int i = 0; i < D; ++i) want[i] += w * scale_of(r) * centroid_of<D>(BV, code_of<D>(BV, r + 2, i));
            }
            const float * got = &merged[(size_t)(n * H + h) * D];
            for (int i = 0; i < D; ++i) {
                max_diff = std::max(max_diff, std::fabs(got[i] - want[i] / sum));
                max_value = std::max(max_value, std::fabs(want[i] / sum));
            }
        }
    }
    printf("case D=%d K=tq%d V=tq%d n_kv=%lld Hkv=%d G=%d N=%d chunk=%lld rel %.3g blocks %lld\n", D, BK, BV,
           (long long)n_kv, Hkv, G, N, (long long)chunk, max_diff / max_value, (long long)(n_split * Hkv * N));
}

}  // namespace

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
