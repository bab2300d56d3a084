// Q6_K matrix x 2..32 f32 columns on tensor cores: Q4_K_M's Q6_K tensors (the output head, half
// the ffn down matrices, attention v) when verifying a draft chain. ggml's tile kernels took them
// at ~4.9 ms of a 17-token verify on the 27B (bench/HISTORY.md), several times their weight read.
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
//     int8 scale and per 8 columns, one int8 mma.m16n8k16: A = the 16 rows' weights q (0..63 as
//     unsigned bytes, assembled from the 4 low and 2 high bits), B = x's int8 values, C; then
//     S += sc * C per row. Once per block the weights' offset of -32, S -= 32 * sum_g sc_g X_g
//     (X_g: x's sum over group g, from quantize_x256) as two more mma over the 16 groups, and
//     y += dx * d * S. The same integers as q - 32 fed to the mma would give, for fewer
//     instructions a weight: these kernels are bound by their issue rate (Nsight Compute, ffn
//     down at 16 columns: 2.4 instructions a cycle per SM of 4, 23 a mma, 3 of them turning q
//     into q - 32 bytes; 22.8 -> 17.7 M instructions without them; bench/HISTORY.md).
//   * few rows (5120: 1.2 waves of thread blocks): two thread blocks of a cluster share a tile,
//     each taking every other step, and add up their sums at the end (q6k_mma_k_split, mma_x.cuh).
// Lane (g, t) gives the mma weights 4t..4t+3 of a 16-weight group: the same byte offsets in ql
// (low bits) and qh (high bits), read from the stage as 4-byte words: two words funnel-shifted
// by 16 bits for odd blocks, which start 2 bytes past a word (by 0 for even ones, so that one
// form serves both without predicates or address math per word).
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

// The same with A unsigned (the weights' q, 0..63, before their offset of -32).
__device__ __forceinline__ void mma_u8s8_k16(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(0));
}

// 4 weights' q (0..63) as bytes, quadrant k (0..3): low bits from the nibbles of ql (low nibbles
// for k < 2, high for k >= 2), high bits from bits 2k, 2k + 1 of each byte of qh.
__device__ __forceinline__ uint32_t q6_unsigned(uint32_t ql, uint32_t qh, int k) {
    const uint32_t low = (k < 2 ? ql : ql >> 4) & 0x0F0F0F0Fu;
    const uint32_t high = k < 2 ? qh << (4 - 2 * k) : qh >> (2 * k - 4);
    return low | (high & 0x30303030u);
}

// y[c * ldy + r] = W[r] . x[c] for r < n_rows, c < n_cols (<= 8 * NT), from x as quantize_x256
// wrote it (XFormat::q6k), padded to 8 * NT columns; R tiles of 16 rows per thread block.
template <int NT, int R>
__global__ void __launch_bounds__(256, 2)  // two blocks per SM: <= 128 registers
q6k_mma(const uint8_t * __restrict__ W, const MmaX x, float * y, int64_t ldy, YResidual residual, int n_rows,
        int n_cols, int n_blocks, int64_t row_bytes) {
    constexpr int NP = 8 * NT, KS = 8 / R, kStageBytes = q6k_mma_stage_bytes(R);
    // x's fragments of a block (8 sub-blocks, 16 registers per 8 columns) loaded together before
    // its math, at 9..16 columns only. H200, kernels_bench, ffn down (5120 x 17408): 16 columns
    // 59.6 -> 57.1 us, output head 528.9 -> 524.1; at 8 columns 48.4 -> 51.5 and at 17 (with x
    // in two halves) 63.4 -> 76.1: more registers held across the mma than those forms spare.
    // (Loading the step's first block's x before the step's barrier, to overlap the stage's
    // wait: ffn down at 16 columns 47.3 -> 46.5 us, output head 482 -> 501; not kept.)
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
            // rows g and g + 8 of the block, from the 4-byte word at or below its start: an odd
            // block starts 2 bytes past a word, so each word a lane needs is two words shifted by sh
            const uint8_t * stage = smem + (j & 1) * kStageBytes;
            const int r0 = 16 * tile + g, sh = 16 * (blk & 1);
            const uint32_t * rw[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int o = (r0 + 8 * r) * kQ6KMmaRowStage + blk * kQ6KBytes;
                rw[r] = reinterpret_cast<const uint32_t *>(stage + (o & ~3));
            }
            auto word = [&](int r, int i) { return __funnelshift_r(rw[r][i], rw[r][i + 1], sh); };  // bytes 4i..4i+3
            uint32_t sc[2][4];  // the 16 int8 scales of rows g, g + 8 (bytes 192..207)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
#pragma unroll
                for (int k = 0; k < 4; ++k) sc[r][k] = word(r, 48 + k);
            }
            int S[NT][4] = {};
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                uint32_t qh[2][2];  // [row][l16]: high bits of weights 4t..4t+3 (bytes 128 + 32n + 16 l16)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) qh[r][h] = word(r, 32 + 8 * n + 4 * h + t);
                }
#pragma unroll
                for (int k2 = 0; k2 < 2; ++k2) {
                    uint32_t ql[2][2];  // [row][l16]: low bits, quadrants k2 and k2 + 2 (bytes 64n + 32 k2 + 16 l16)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
#pragma unroll
                        for (int h = 0; h < 2; ++h) ql[r][h] = word(r, 16 * n + 8 * k2 + 4 * h + t);
                    }
#pragma unroll
                    for (int k = k2; k < 4; k += 2) {
                        uint32_t a[2][2];  // [row][l16]: weights 4t..4t+3 of the group, 0..63
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
#pragma unroll
                            for (int h = 0; h < 2; ++h) a[r][h] = q6_unsigned(ql[r][h], qh[r][h], k);
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
                                mma_u8s8_k16(c, a[0][h], a[1][h], h ? bq.y : bq.x);
                                const int s0 = sbyte(sc[0][i >> 2], i & 3), s1 = sbyte(sc[1][i >> 2], i & 3);
                                S[nt][0] += s0 * c[0];
                                S[nt][1] += s0 * c[1];
                                S[nt][2] += s1 * c[2];
                                S[nt][3] += s1 * c[3];
                            }
                        }
                    }
                }
            }
            float d[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) d[r] = __half2float(__ushort_as_half((unsigned short)(rw[r][52] >> sh)));
            // the weights' offset: S -= 32 * sum over groups of scale x (x's group sum), two more mma
            // (the sums as int8 high and low parts), whose A is the scales of groups 4t..4t+3: sc[r][t],
            // read again (indexing sc at run time would put it in local memory)
            const uint32_t sct[2] = {word(0, 48 + t), word(1, 48 + t)};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const XSums & xsum = x.sums[(int64_t)b * NP + 8 * nt + g];
                int mh[4], ml[4];
                mma_s8_k16(mh, sct[0], sct[1], reinterpret_cast<const uint32_t *>(xsum.hi)[t]);
                mma_s8_k16(ml, sct[0], sct[1], reinterpret_cast<const uint32_t *>(xsum.lo)[t]);
                const float2 dx = *reinterpret_cast<const float2 *>(x.dx + (int64_t)b * NP + 8 * nt + 2 * t);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const int v = S[nt][k] - 32 * (64 * mh[k] + ml[k]);
                    acc[nt][k] += (k & 1 ? dx.y : dx.x) * d[k >> 1] * (float)v;
                }
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
// keeps 4 or more steps (5120 x 17408: 320 blocks, 9 steps), else 1. (A rule that counted waves
// x steps a block chose 3 there, 960 blocks of 3 steps, 4 waves against 3 of 5: slower, 47.9 ->
// 52.9 us at 16 columns; kernels_bench --k-splits 1,2,3,4, bench/HISTORY.md.)
inline int q6k_mma_k_split(int64_t blocks, int k_steps) {
    const int64_t slots = 2 * (int64_t)device_sm_count();
    return blocks < 2 * slots && k_steps >= 8 ? 2 : 1;
}

// The product alone, from x already quantized (XFormat::q6k): a pair's second product.
inline void launch_q6k_mma_product(const void * W, const MmaX & xq, float * y, int64_t ldy, int64_t n_rows,
                                   int64_t n_k, int n_cols, int64_t row_bytes, cudaStream_t stream,
                                   YResidual residual = YResidual{}, int row_tiles = 0, int k_split = 0) {
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

// Host side: W in ggml's Q6_K layout with n_k a multiple of 1024 (rows then start 8-byte aligned)
// and an 8-byte aligned base; x: n_cols (2..32) f32 columns of n_k values, ldx floats apart,
// 16-byte aligned; y: n_cols columns of n_rows, ldy apart. scratch: mma_x_bytes(n_k, n_cols)
// bytes of device memory, 16-byte aligned.
// norm: a folded rms_norm of x (n_k <= kMmaNormMaxK), or none; glu: a folded SwiGLU, or none;
// residual: added to y as it is stored, or none. row_tiles: R (1 or 2), 0 = mma_row_tiles;
// k_split: thread blocks per cluster sharing a tile's k (1..4, sm_90+), 0 = q6k_mma_k_split.
inline void launch_q6k_mma(const void * W, const float * x, int64_t ldx, float * y, int64_t ldy, int64_t n_rows,
                           int64_t n_k, int n_cols, int64_t row_bytes, void * scratch, cudaStream_t stream,
                           XNorm norm = XNorm{}, XGlu glu = XGlu{}, YResidual residual = YResidual{},
                           int row_tiles = 0, int k_split = 0) {
    const MmaX xq = launch_quantize_x256<XFormat::q6k>(x, ldx, n_k, n_cols, scratch, stream, norm, glu);
    launch_q6k_mma_product(W, xq, y, ldy, n_rows, n_k, n_cols, row_bytes, stream, residual, row_tiles, k_split);
}

}  // namespace deltaspec_cuda
