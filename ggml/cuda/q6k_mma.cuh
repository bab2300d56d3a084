// Q6_K matrix x 2..32 f32 columns on tensor cores: Q4_K_M's Q6_K tensors (the output head, half
// the ffn down matrices, attention v) when verifying a draft chain. ggml's tile kernels took them
// at ~4.9 ms of a 17-token verify on the 27B (bench/README), several times their weight read.
//
// x is quantized as for q4k_mma (per column and 256 values to int8 with one scale; mma_x.cuh), with
// each 32-value sub-block's two halves interleaved for this kernel's k = 16 mma. A thread block of
// 8 warps takes R tiles of 16 rows (with_row_tiles, mma_x.cuh), and walks their Q6_K blocks 8 at
// a time:
//   * staging: 210-byte blocks are only 2-byte aligned, too little for wide loads, but 8 blocks
//     of a row (1680 bytes) are 8-byte aligned when rows hold a multiple of 4 blocks. So warp w
//     copies its 2R rows' next 8 blocks into shared memory with coalesced 8-byte cp.async (two
//     stages: the next 8 blocks load while these are multiplied);
//   * math: warp w then takes tile w % R and blocks w / R, w / R + 8 / R, ... of the stage (the
//     warps of the R tiles read the same x at once: L2 serves it once). Per 16 weights under one
//     int8 scale and per 8 columns, one int8 mma.m16n8k16: A = the 16 rows' weights q - 32
//     (-32..31, assembled from the 4 low and 2 high bits), B = x's int8 values, C; then
//     S += sc * C per row. Once per block  y += dx * d * S.
//   * few rows (5120: 1.2 waves of thread blocks): two thread blocks of a cluster share a tile,
//     each taking every other step, and add up their sums at the end (q6k_mma_k_split, mma_x.cuh).
// Lane (g, t) gives the mma weights 4t..4t+3 of a 16-weight group: the same byte offsets in ql
// (low bits) and qh (high bits), read from the stage as 4-byte words (shifted by 2 bytes for odd
// blocks, which start 2 bytes past a word).
//
// Block layout (q6k_gemv.cuh): ql[128], qh[64], int8 scales[16], half d. Half n (0, 1) of 128
// weights, quadrant k (0..3) of 32 and group l16 (0, 1) of 16: weight 128n + 32k + 16 l16 + i has
// low bits ql[64n + 32 (k % 2) + 16 l16 + i] >> 4 (k / 2), high bits qh[32n + 16 l16 + i] >> 2k,
// and scale scales[8n + 2k + l16].
#pragma once

#include "gemv_common.cuh"
#include "mma_x.cuh"
#include "q6k_gemv.cuh"

#include <algorithm>
#include <atomic>

namespace deltaspec_cuda {

constexpr int kQ6KMmaStepBlocks = 8;  // blocks per row and stage
constexpr int kQ6KMmaRowStage = kQ6KMmaStepBlocks * kQ6KBytes;
// R tiles of 16 rows: two stages, + 4 bytes for the word after an odd last block's d; the 8
// warps' partial sums (mma_partial_floats) reuse it at the end
__host__ __device__ constexpr int q6k_mma_stage_bytes(int R) { return 16 * R * kQ6KMmaRowStage; }
constexpr size_t q6k_mma_smem(int R) { return 2 * (size_t)q6k_mma_stage_bytes(R) + 16; }
// R = 4 would need 215 KB a block: one block per SM
constexpr int kQ6KMmaMaxRowTiles = 2;

__device__ __forceinline__ void mma_s8_k16(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(0));
}

// 4 weights q - 32 as signed bytes, from 4 low-bit nibbles and 4 high-bit pairs (each in bits 0..3
// and 0..1 of its byte): (q + 128 - 32) ^ 128 per byte, with no borrow between bytes.
__device__ __forceinline__ uint32_t q6_bytes(uint32_t low, uint32_t high) {
    const uint32_t q = (low & 0x0F0F0F0Fu) | ((high & 0x03030303u) << 4);
    return ((q | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
}

// y[c * ldy + r] = W[r] . x[c] for r < n_rows, c < n_cols (<= 8 * NT), from x as quantize_x256
// wrote it with interleaved halves, padded to 8 * NT columns; R tiles of 16 rows per thread block.
template <int NT, int R>
__global__ void __launch_bounds__(256, 2)  // two blocks per SM: <= 128 registers
q6k_mma(const uint8_t * __restrict__ W, const MmaX x, float * y, int64_t ldy, YResidual residual, int n_rows,
        int n_cols, int n_blocks, int64_t row_bytes) {
    constexpr int NP = 8 * NT, KS = 8 / R, kStageBytes = q6k_mma_stage_bytes(R);
    // x's fragments of a block (8 sub-blocks, 16 registers per 8 columns) loaded together before
    // its math, at 9..16 columns only. H200, kernels_bench, ffn down (5120 x 17408): 16 columns
    // 59.6 -> 57.1 us, output head 528.9 -> 524.1; at 8 columns 48.4 -> 51.5 and at 17 (with x
    // in two halves) 63.4 -> 76.1: more registers held across the mma than those forms spare.
    constexpr bool kPreloadX = NT == 2;
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    // the thread blocks of a cluster share the tiles' steps (mma_x.cuh): this one takes steps
    // rank, rank + size, ...
    const KSplit ks = k_split();
    const int row_base = blockIdx.x / ks.size * 16 * R, tile = warp % R;
    const int n_steps = (n_blocks + kQ6KMmaStepBlocks - 1) / kQ6KMmaStepBlocks;
    const int n_mine = ks.rank < n_steps ? (n_steps - ks.rank + ks.size - 1) / ks.size : 0;

    auto stage_step = [&](int j) {  // this warp's 2R rows of the block's j-th step into stage j % 2
        const int s = ks.rank + j * ks.size;
        const int words = min(kQ6KMmaStepBlocks, n_blocks - s * kQ6KMmaStepBlocks) * kQ6KBytes / 8;
#pragma unroll
        for (int r = 0; r < 2 * R; ++r) {
            const int row = 2 * R * warp + r;
            const uint8_t * src = W + min(row_base + row, n_rows - 1) * row_bytes + (int64_t)s * kQ6KMmaRowStage;
            uint8_t * dst = smem + (j & 1) * kStageBytes + row * kQ6KMmaRowStage;
            for (int i = lane; i < words; i += 32) cp_async8(dst + 8 * i, src + 8 * i);
        }
        asm volatile("cp.async.commit_group;");
    };

    float acc[NT][4] = {};
    if (n_mine > 0) stage_step(0);
    wait_for_inputs();  // x and the residual come from earlier kernels
    for (int j = 0; j < n_mine; ++j) {
        const int s = ks.rank + j * ks.size;
        if (j + 1 < n_mine) {
            stage_step(j + 1);
            asm volatile("cp.async.wait_group 1;");
        } else {
            asm volatile("cp.async.wait_group 0;");
        }
        __syncthreads();  // every warp's rows of stage j have landed
#pragma unroll 1
        for (int blk = warp / R; blk < kQ6KMmaStepBlocks; blk += KS) {
            const int b = s * kQ6KMmaStepBlocks + blk;
            if (b >= n_blocks) break;
            uint2 xf[kPreloadX ? 8 : 1][NT];
            if constexpr (kPreloadX) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        xf[i][nt] = *reinterpret_cast<const uint2 *>(  // coherent (wait_for_inputs)
                            x.values + ((int64_t)(8 * b + i) * NP + 8 * nt + g) * 32 + 8 * t);
                    }
                }
            }
            const uint8_t * stage = smem + (j & 1) * kStageBytes;
            const int r0 = 16 * tile + g;
            const int o[2] = {r0 * kQ6KMmaRowStage + blk * kQ6KBytes, (r0 + 8) * kQ6KMmaRowStage + blk * kQ6KBytes};
            uint32_t sc[2][4];  // the 16 int8 scales of rows g, g + 8
#pragma unroll
            for (int r = 0; r < 2; ++r) {
#pragma unroll
                for (int k = 0; k < 4; ++k) sc[r][k] = stage_word(stage, o[r] + 192 + 4 * k);
            }
            int S[NT][4] = {};
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                uint32_t qh[2][2];  // [row][l16]
#pragma unroll
                for (int r = 0; r < 2; ++r) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) qh[r][h] = stage_word(stage, o[r] + 128 + 32 * n + 16 * h + 4 * t);
                }
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    uint32_t a[2][2];  // [row][l16]: weights 4t..4t+3 of the group
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const uint32_t ql = stage_word(stage, o[r] + 64 * n + 32 * (k & 1) + 16 * h + 4 * t);
                            a[r][h] = q6_bytes(ql >> (4 * (k >> 1)), qh[r][h] >> (2 * k));
                        }
                    }
                    const int sub = 4 * n + k;  // x's 32-value sub-block
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        uint2 bq;
                        if constexpr (kPreloadX) {
                            bq = xf[sub][nt];
                        } else {
                            bq = *reinterpret_cast<const uint2 *>(  // coherent (wait_for_inputs)
                                x.values + ((int64_t)(8 * b + sub) * NP + 8 * nt + g) * 32 + 8 * t);
                        }
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int i = 8 * n + 2 * k + h;  // the group's scale
                            int c[4];
                            mma_s8_k16(c, a[0][h], a[1][h], h ? bq.y : bq.x);
                            const int s0 = sbyte(sc[0][i >> 2], i & 3), s1 = sbyte(sc[1][i >> 2], i & 3);
                            S[nt][0] += s0 * c[0];
                            S[nt][1] += s0 * c[1];
                            S[nt][2] += s1 * c[2];
                            S[nt][3] += s1 * c[3];
                        }
                    }
                }
            }
            float d[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint32_t dw = stage_word(stage, o[r] + 208);
                d[r] = __half2float(__ushort_as_half((unsigned short)(dw & 0xFFFFu)));
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float2 dx = *reinterpret_cast<const float2 *>(x.dx + (int64_t)b * NP + 8 * nt + 2 * t);
#pragma unroll
                for (int k = 0; k < 4; ++k) acc[nt][k] += (k & 1 ? dx.y : dx.x) * d[k >> 1] * (float)S[nt][k];
            }
        }
        __syncthreads();  // stage j is read: the next iteration's copy may overwrite it
    }
    mma_reduce_store<NT, R>(acc, reinterpret_cast<float *>(smem), y, ldy, residual, row_base, n_rows, n_cols);
}

// Lets q6k_mma<NT, R> use q6k_mma_smem(R) (more than the default 48 KiB of dynamic shared memory)
// on the current device, once per device; a failure shows as the launch's error.
template <int NT, int R>
inline void allow_q6k_mma_smem() {
    static std::atomic<uint64_t> raised{0};  // bit d: done on device d
    int device = 0;
    cudaGetDevice(&device);
    if (device >= 64 || (raised.load() >> device & 1)) return;
    if (cudaFuncSetAttribute(q6k_mma<NT, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)q6k_mma_smem(R)) ==
        cudaSuccess) {
        raised |= uint64_t{1} << device;
    }
}

// Thread blocks per cluster sharing a tile's k (mma_x.cuh) for `blocks` thread blocks at one and
// `k_steps` 8-block steps per row: 2 where those blocks fill less than two waves and each half
// keeps 4 or more steps (5120 x 17408: 320 blocks, 9 steps), else 1.
inline int q6k_mma_k_split(int64_t blocks, int k_steps) {
    const int64_t slots = 2 * (int64_t)device_sm_count();
    return blocks < 2 * slots && k_steps >= 8 ? 2 : 1;
}

// Host side: W in ggml's Q6_K layout with n_k a multiple of 1024 (rows then start 8-byte aligned)
// and an 8-byte aligned base; x: n_cols (2..32) f32 columns of n_k values, ldx floats apart,
// 16-byte aligned; y: n_cols columns of n_rows, ldy apart. scratch: mma_x_bytes(n_k, n_cols)
// bytes of device memory, 16-byte aligned.
// norm: a folded rms_norm of x (n_k <= kMmaNormMaxK), or none; glu: a folded SwiGLU, or none;
// residual: added to y as it is stored, or none. row_tiles: R (1 or 2), 0 = mma_row_tiles;
// k_split: thread blocks per cluster sharing a tile's k (1, 2 or 4, sm_90+), 0 = q6k_mma_k_split.
inline void launch_q6k_mma(const void * W, const float * x, int64_t ldx, float * y, int64_t ldy, int64_t n_rows,
                           int64_t n_k, int n_cols, int64_t row_bytes, void * scratch, cudaStream_t stream,
                           XNorm norm = XNorm{}, XGlu glu = XGlu{}, YResidual residual = YResidual{},
                           int row_tiles = 0, int k_split = 0) {
    const MmaX xq = launch_quantize_x256<true, false>(x, ldx, n_k, n_cols, scratch, stream, norm, glu);
    const uint8_t * w = static_cast<const uint8_t *>(W);
    const int n_blocks = (int)(n_k / 256);
    const int tiles =
        row_tiles > 0 ? std::min(row_tiles, kQ6KMmaMaxRowTiles) : mma_row_tiles(n_rows, kQ6KMmaMaxRowTiles);
    const int n_steps = (n_blocks + kQ6KMmaStepBlocks - 1) / kQ6KMmaStepBlocks;
    with_row_tiles<kQ6KMmaMaxRowTiles>(tiles, [&](auto r) {
        const int64_t row_groups = (n_rows + 16 * r.value - 1) / (16 * r.value);
        const int c = mma_k_split_allowed(k_split > 0 ? k_split : q6k_mma_k_split(row_groups, n_steps));
        with_column_tiles(n_cols, [&](auto nt) {
            allow_q6k_mma_smem<nt.value, r.value>();
            launch_clustered(q6k_mma<nt.value, r.value>, (unsigned)(row_groups * c), 256, q6k_mma_smem(r.value),
                             stream, c, w, xq, y, ldy, residual, (int)n_rows, n_cols, n_blocks, row_bytes);
        });
    });
}

}  // namespace deltaspec_cuda
