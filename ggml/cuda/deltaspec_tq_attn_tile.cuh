// One-token attention over tq rows read in place, by tiles of cached rows (the default in-place kernel
// of ggml/cuda/deltaspec_tq.cu; its older one-warp-per-row kernel stays there for A/B).
//
// Why tiles: a tq row is ~100 bytes, so at long depth the one-token step is bound by per-row latency,
// not by bandwidth. The warp-per-row kernel spends per row and query head a 5-shuffle reduction and an
// exp, serially dependent, and looks centroids up in constant memory with 32 different indices per
// warp (serialized). Here a block of kTileRows threads takes a tile of kTileRows rows of one KV head
// and stream in three phases separated by barriers:
//   0. the tile's K and V codes are copied into shared memory with coalesced 16-bit loads (rows are
//      only 2-byte aligned: a head block is 2 + D*bits/8 bytes); K rows at an odd word stride so that
//      phase 1's row-per-thread reads hit 32 different banks;
//   1. scores: thread t computes row t's dot products with the G query heads (queries in shared
//      memory, read as broadcast float4s; centroids from a shared table), no shuffles;
//   2. softmax: warp w takes heads w and w + 4: the tile's max (one warp reduction per head per tile,
//      not per row), the rescale factor of the running state, and the weights p_j * d_v(j) written
//      back to shared memory;
//   3. values: thread t owns D/kTileRows output coordinates of every head; per row it decodes its
//      coordinates of the V row and adds weight * centroid (no exp in this loop).
// A block walks `chunk` rows (whole tiles) with a running max/sum per head and writes its partial
// state (accumulator, max, sum) as the warp kernel does; merge_attention_splits (attn_split_merge.cuh) combines the splits
// with a thread per output coordinate (the warp kernel's merge loops over the splits D/32 times per lane).
// Same math as the warp kernel and the CPU node, up to float rounding (summation order, and the
// V scale multiplied into the weight rather than into the centroid).
#pragma once

#include "attn_split_merge.cuh"
#include "deltaspec_tq_warp.cuh"

namespace deltaspec_tq_attn {

using namespace deltaspec_tq_warp;

constexpr int kMaxGroup = 8;    // query heads per KV head the in-place kernels serve
constexpr int kTileRows = 128;  // cached rows per tile = threads per block
constexpr int kTileWarps = kTileRows / 32;
static_assert(kMaxGroup == 2 * kTileWarps, "phase 2: warp w keeps the running state of heads w and w + kTileWarps");

// index of value i (of D) in a tq row's packed bits (qs points past the fp16 scale)
template <int BITS, int D> __device__ __forceinline__ int index_at(const uint8_t * qs, int i) {
    return BITS == 3 ? ((qs[i / 4] >> (2 * (i % 4))) & 3) | ((qs[D / 4 + i / 8] >> (i % 8)) & 1) << 2
                     : (qs[i / 2] >> (4 * (i % 2))) & 15;
}

// A row's codes in shared memory: kWords 32-bit words, rows kStride words apart (odd, so that thread t
// reading word w of row t hits bank (t * kStride + w) % 32, different for the 32 threads of a warp).
template <int BITS, int D> struct StagedRow {
    static constexpr int kWords = D * BITS / 32;
    static constexpr int kStride = kWords + 1;
    static_assert(kWords % 2 == 0, "the odd stride needs an even word count");
};

// codes of rows j0 .. j0 + rows - 1 (row j at base + j * nb1, codes after its 2-byte scale) -> dst
template <int BITS, int D>
__device__ __forceinline__ void stage_codes(const char * __restrict__ base, size_t nb1, int64_t j0, int rows,
                                            uint32_t * __restrict__ dst) {
    constexpr int kHalves = 2 * StagedRow<BITS, D>::kWords, kStrideHalves = 2 * StagedRow<BITS, D>::kStride;
    uint16_t * d16 = reinterpret_cast<uint16_t *>(dst);
#pragma unroll 4
    for (int u = threadIdx.x; u < rows * kHalves; u += kTileRows) {
        const int r = u / kHalves, o = u % kHalves;
        d16[r * kStrideHalves + o] = reinterpret_cast<const uint16_t *>(base + (j0 + r) * nb1)[1 + o];
    }
}

// dot[g] += q_g . centroids of one staged row (unscaled), values 8 at a time: for tq3 the low bits of
// values 8s..8s+7 are half-word s of qs, their high bits byte s of qh (word D/16 + s/4); for tq4 they
// are word s
template <int BITS, int D>
__device__ __forceinline__ void dot_row(const uint32_t * __restrict__ row, const float (*__restrict__ q)[D],
                                        const float * __restrict__ cent, int G, float (&dot)[kMaxGroup]) {
#pragma unroll 2
    for (int s = 0; s < D / 8; ++s) {
        float c[8];
        if (BITS == 3) {
            const uint32_t lo = row[s / 2] >> (16 * (s % 2));
            const uint32_t hi = row[D / 16 + s / 4] >> (8 * (s % 4));
#pragma unroll
            for (int k = 0; k < 8; ++k) c[k] = cent[((lo >> (2 * k)) & 3) | (((hi >> k) & 1) << 2)];
        } else {
            const uint32_t w = row[s];
#pragma unroll
            for (int k = 0; k < 8; ++k) c[k] = cent[(w >> (4 * k)) & 15];
        }
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
            if (g < G) {
                const float4 a = *reinterpret_cast<const float4 *>(&q[g][8 * s]);
                const float4 b = *reinterpret_cast<const float4 *>(&q[g][8 * s + 4]);
                float d = dot[g];
                d = fmaf(a.x, c[0], d);
                d = fmaf(a.y, c[1], d);
                d = fmaf(a.z, c[2], d);
                d = fmaf(a.w, c[3], d);
                d = fmaf(b.x, c[4], d);
                d = fmaf(b.y, c[5], d);
                d = fmaf(b.z, c[6], d);
                dot[g] = fmaf(b.w, c[7], d);
            }
        }
    }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, off));
    return x;
}

__device__ __forceinline__ float half_at(const char * p) {
    return __half2float(*reinterpret_cast<const half *>(p));
}

// Block (split, kv head, stream) over rows [split * chunk, min(n_kv, +chunk)); chunk a multiple of
// kTileRows. qrot: the rotated queries [D, H, 1, N] contiguous; part: as merge_attention_splits reads it.
// skip_last_row: the planted bug of tests/test_gpu_turboquant.py (each tile's last row left out).
constexpr int kTileBlocksPerSm = 4;  // resident at once (~47 KB of shared memory each at D=256), at most 128 registers

template <int D, int BK, int BV>
__global__ void __launch_bounds__(kTileRows, kTileBlocksPerSm)
    tq_decode_attn_tile(const float * __restrict__ qrot, const char * __restrict__ K, size_t k_nb1, size_t k_nb2,
                        size_t k_nb3, const char * __restrict__ V, size_t v_nb1, size_t v_nb2, size_t v_nb3,
                        const char * __restrict__ mask, size_t mask_nb3, int64_t mask_ne3, int64_t n_kv, int H, int G,
                        float scale, int64_t chunk, bool skip_last_row, float * __restrict__ part) {
    using KRow = StagedRow<BK, D>;
    using VRow = StagedRow<BV, D>;
    constexpr int NV = D / kTileRows;  // output coordinates per thread
    static_assert(NV >= 1 && D % kTileRows == 0, "head dims 128 and 256");
    __shared__ __align__(16) float q_s[kMaxGroup][D];
    __shared__ __align__(16) float w_s[kTileRows][kMaxGroup];  // scores (phase 1), then weights (phase 2)
    __shared__ uint32_t k_s[kTileRows * KRow::kStride];
    __shared__ uint32_t v_s[kTileRows * VRow::kStride];
    __shared__ float dv_s[kTileRows], alpha_s[kMaxGroup], ck_s[16], cv_s[16];

    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int64_t split = blockIdx.x, hk = blockIdx.y, n = blockIdx.z, n_split = gridDim.x;
    const char * Kb = K + hk * k_nb2 + n * k_nb3;
    const char * Vb = V + hk * v_nb2 + n * v_nb3;
    const half * mrow = (const half *)(mask + (n % mask_ne3) * mask_nb3);
    for (int i = t; i < kMaxGroup * D; i += kTileRows) {
        const int g = i / D;
        q_s[g][i % D] = g < G ? qrot[((hk * G + g) + (int64_t)H * n) * D + i % D] : 0.0f;
    }
    if (t < (1 << BK)) ck_s[t] = centroid<BK, D>(t);
    if (t < (1 << BV)) cv_s[t] = centroid<BV, D>(t);

    float m_run[2] = {-INFINITY, -INFINITY}, s_run[2] = {0.0f, 0.0f};  // of heads warp, warp + kTileWarps
    float acc[kMaxGroup][NV];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
        for (int k = 0; k < NV; ++k) acc[g][k] = 0.0f;
    }
    const int64_t j_begin = split * chunk, j_end = min(n_kv, j_begin + chunk);
    for (int64_t j0 = j_begin; j0 < j_end; j0 += kTileRows) {
        const int rows = (int)min((int64_t)kTileRows, j_end - j0);
        __syncthreads();  // the previous tile's phase 3 is done with v_s and w_s (the first time: q_s, tables)
        // phase 0
        stage_codes<BK, D>(Kb, k_nb1, j0, rows, k_s);
        stage_codes<BV, D>(Vb, v_nb1, j0, rows, v_s);
        float mv = -INFINITY, dk = 0.0f;
        if (t < rows) {
            mv = __half2float(mrow[j0 + t]);
            if (skip_last_row && t == rows - 1) mv = -INFINITY;
            if (mv != -INFINITY) {  // a masked row may be unwritten cache: its scales are never read
                dk = half_at(Kb + (j0 + t) * k_nb1) * scale;
                dv_s[t] = half_at(Vb + (j0 + t) * v_nb1);
            }
        }
        __syncthreads();
        // phase 1: row t's scores
        if (mv != -INFINITY) {
            float dot[kMaxGroup];
#pragma unroll
            for (int g = 0; g < kMaxGroup; ++g) dot[g] = 0.0f;
            dot_row<BK, D>(k_s + t * KRow::kStride, q_s, ck_s, G, dot);
#pragma unroll
            for (int g = 0; g < kMaxGroup; ++g) w_s[t][g] = dot[g] * dk + mv;
        } else {
#pragma unroll
            for (int g = 0; g < kMaxGroup; ++g) w_s[t][g] = -INFINITY;
        }
        __syncthreads();
        // phase 2: the running state of heads warp and warp + kTileWarps; weights 0 for masked rows
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int g = warp + e * kTileWarps;
            if (g < G) {
                float sc[kTileRows / 32], tile_max = -INFINITY;
#pragma unroll
                for (int r = 0; r < kTileRows / 32; ++r) {
                    sc[r] = w_s[lane + 32 * r][g];
                    tile_max = fmaxf(tile_max, sc[r]);
                }
                const float m_new = fmaxf(m_run[e], warp_max(tile_max));
                const float alpha = m_run[e] == -INFINITY ? 0.0f : expf(m_run[e] - m_new);
                float sum = 0.0f;
#pragma unroll
                for (int r = 0; r < kTileRows / 32; ++r) {
                    const int j = lane + 32 * r;
                    const float p = sc[r] == -INFINITY ? 0.0f : expf(sc[r] - m_new);
                    sum += p;
                    w_s[j][g] = p > 0.0f ? p * dv_s[j] : 0.0f;
                }
                s_run[e] = s_run[e] * alpha + warp_sum(sum);
                m_run[e] = m_new;
                if (lane == 0) alpha_s[g] = alpha;
            }
        }
        __syncthreads();
        // phase 3: acc[g][k] (coordinate t * NV + k of head g) rescaled, then the tile's weighted V rows
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
            if (g < G) {
                const float alpha = alpha_s[g];
#pragma unroll
                for (int k = 0; k < NV; ++k) acc[g][k] *= alpha;
            }
        }
#pragma unroll 4
        for (int r = 0; r < rows; ++r) {
            const uint8_t * vrow = reinterpret_cast<const uint8_t *>(v_s + r * VRow::kStride);
            float c[NV];
#pragma unroll
            for (int k = 0; k < NV; ++k) c[k] = cv_s[index_at<BV, D>(vrow, t * NV + k)];
            const float4 wa = *reinterpret_cast<const float4 *>(&w_s[r][0]);
            const float4 wb = *reinterpret_cast<const float4 *>(&w_s[r][4]);
            const float w[kMaxGroup] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
            for (int g = 0; g < kMaxGroup; ++g) {
                if (g < G) {
#pragma unroll
                    for (int k = 0; k < NV; ++k) acc[g][k] = fmaf(w[g], c[k], acc[g][k]);
                }
            }
        }
    }
    // the block's part of each head: accumulator, max, sum
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
        if (g < G) {
            float * out = part + (((n * H) + hk * G + g) * n_split + split) * (D + 2);
#pragma unroll
            for (int k = 0; k < NV; ++k) out[t * NV + k] = acc[g][k];
        }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int g = warp + e * kTileWarps;
        if (g < G && lane == 0) {
            float * out = part + (((n * H) + hk * G + g) * n_split + split) * (D + 2);
            out[D] = m_run[e];
            out[D + 1] = s_run[e];
        }
    }
}

}  // namespace deltaspec_tq_attn
