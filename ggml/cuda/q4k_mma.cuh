// Q4_K matrix x 2..32 f32 columns on tensor cores: the products of verifying a draft (a chain of
// up to 32 tokens), meant to cost close to one column's weight read. ggml sends 2-8 columns to its
// mat-vec (which re-reads and re-decodes the weights per column group) and 9+ to its tile kernels
// (mmq); verifying 17 tokens costs 2.9 decode steps that way (bench/HISTORY.md).
//
// x is first quantized per column and per 256 values (one Q4_K block) to int8 with one f32 scale,
// plus the integer sum of each 32-value sub-block (quantize_x256, mma_x.cuh). A thread block of 8
// warps then takes R tiles of 16 rows (with_row_tiles, mma_x.cuh); the 8 / R warps of a tile
// split its Q4_K blocks (warp w: blocks w / R, w / R + 8 / R, ...) and meet in shared memory at
// the end. Per block and per 8 columns a warp runs, all in integers:
//   * one int8 mma.m16n8k32 per sub-block: A = the 16 rows' nibbles of the sub-block (0..15),
//     B = x's int8 values, C_s; then  S += sc_s * C_s  (the 6-bit sub-block scale, per row);
//   * the mins  M = sum_s m_s * xsum_s  as two more mma (xsum up to +-4064 is split into int8
//     high and low parts: xsum = 64 * hi + lo);
// and only then touches floats once:  y += dx * (d * S - dmin * M).  (Scaling every
// sub-block's result in f32 costs more with every column: 2.9x one column at 17.)
//
// Weights go through shared memory: each warp copies its 16 rows' next block there (cp.async, 16
// bytes a lane) while it multiplies the current one, and loads all of x's fragments of a block at
// once, before it waits for the block's weights. Holding the current and next block in registers
// instead (48 of its 128) leaves no room to load x ahead: its fragments come one sub-block at a
// time between the mma, each an L1/L2 round trip. H200, kernels_bench, 16 columns, against that
// form: ffn gate+up stack 55.4 -> 46.2 us, ffn down 36.7 -> 34.5, DeltaNet stack
// 28.1 -> 24.0, ssm_out 17.4 -> 16.5 (one column, the mat-vec: 36.7 / 25.4 / 20.2 / 11.7). Three
// or four blocks in flight per warp were slower than two: the extra shared memory comes out of
// the L1 that serves x to the warps of a block.
//
// Which weights of a sub-block a lane gives to the mma's k slots only has to agree with x's: lane
// (g, t) of the mma (g = lane / 4, t = lane % 4) reads bytes 8t..8t+7 of each 32-byte group of
// its rows' nibbles (slots 4t..4t+3 and 16+4t..16+4t+3) and x's int8 values 8t..8t+7 of the same
// sub-block for column g (one 8-byte load; the 8 columns' loads are 256 contiguous bytes), so
// neither side needs a shuffle.
#pragma once

#include "gemv_common.cuh"
#include "mma_x.cuh"
#include "q4k_gemv.cuh"

namespace deltaspec_cuda {

__device__ __forceinline__ void mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
    // not volatile: no side effects, so the compiler may interleave the mma of a block's 8
    // sub-blocks with the integer work on earlier results instead of waiting on each in turn
    asm(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

// A block's 16 rows sit kQ4KStageRowBytes apart in a stage, so that a lane's 8-byte reads (row
// g + 8r, bytes 16 + 32j + 8t) hit 32 distinct banks per half-warp.
constexpr int kQ4KStageRowBytes = 160;
constexpr int kQ4KStageBytes = 16 * kQ4KStageRowBytes;
constexpr int kQ4KMmaStages = 2;  // blocks of weights per warp in shared memory
constexpr size_t kQ4KMmaSmem = (size_t)8 * kQ4KMmaStages * kQ4KStageBytes;  // 40 KB: no opt-in needed
static_assert(kQ4KMmaSmem <= 48 * 1024, "more than 48 KiB of dynamic shared memory needs an opt-in");

// y[c * ldy + r] = W[r] . x[c] for r < n_rows, c < n_cols (<= 8 * NT), from x as quantize_x256
// wrote it (XFormat::q4k), padded to 8 * NT columns; R tiles of 16 rows per thread block.
template <int NT, int R>
__global__ void __launch_bounds__(256, 2)  // two blocks per SM: <= 128 registers
q4k_mma(const uint8_t * __restrict__ W, const MmaX x, float * y, int64_t ldy, YResidual residual, int n_rows,
        int n_cols, int n_blocks, int64_t row_bytes) {
    constexpr int NP = 8 * NT, KS = 8 / R, STAGES = kQ4KMmaStages;
    constexpr int XSUB = NT <= 2 ? 8 : 4;  // sub-blocks of x loaded at once (2 NT registers each)
    static_assert(mma_partial_floats<NT> * sizeof(float) <= kQ4KMmaSmem, "the partial sums reuse the stages");
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const KSplit ks = k_split();  // thread blocks of a cluster sharing the tiles' k (mma_x.cuh)
    const int row_base = blockIdx.x / ks.size * 16 * R, tile_base = row_base + 16 * (warp % R);
    uint8_t * stages = smem + warp * STAGES * kQ4KStageBytes;

    // the 144 16-byte chunks of one block of 16 rows: lane L copies chunks L, L + 32, ... (row c / 9)
    int64_t src[5];
    int dst[5];
#pragma unroll
    for (int i = 0; i < 5; ++i) {
        const int c = min(lane + 32 * i, 143), r = c / 9, part = c % 9;
        src[i] = min(tile_base + r, n_rows - 1) * row_bytes + 16 * part;
        dst[i] = r * kQ4KStageRowBytes + 16 * part;
    }
    // this warp's blocks: first, first + stride, ...
    const int first = ks.rank * KS + warp / R, stride = KS * ks.size;
    const int n_mine = first < n_blocks ? (n_blocks - first + stride - 1) / stride : 0;
    auto stage_block = [&](int i) {  // this warp's i-th block into stage i % STAGES
        if (i < n_mine) {
            const uint8_t * w = W + (int64_t)(first + i * stride) * kQ4KBytes;
            uint8_t * s = stages + (i % STAGES) * kQ4KStageBytes;
#pragma unroll
            for (int k = 0; k < 5; ++k) {
                if (k < 4 || lane < 16) cp_async16(s + dst[k], w + src[k]);
            }
        }
        asm volatile("cp.async.commit_group;");  // empty groups too: the wait below counts groups
    };
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) stage_block(i);
    wait_for_inputs();  // x and the residual come from earlier kernels

    float acc[NT][4] = {};
    for (int i = 0; i < n_mine; ++i) {
        const int b = first + i * stride;
        uint2 xf[XSUB][NT];  // x's B fragments, loaded while the weights land
        auto load_x = [&](int s0) {
#pragma unroll
            for (int s = 0; s < XSUB; ++s) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    xf[s][nt] = *reinterpret_cast<const uint2 *>(
                        x.values + ((int64_t)(8 * b + s0 + s) * NP + 8 * nt + g) * 32 + 8 * t);
                }
            }
        };
        load_x(0);
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
        __syncwarp();  // every lane's chunks of block i have landed, and stage (i - 1) % STAGES is read
        stage_block(i + STAGES - 1);
        const uint8_t * s = stages + (i % STAGES) * kQ4KStageBytes;
        const uint8_t * rows[2] = {s + g * kQ4KStageRowBytes, s + (g + 8) * kQ4KStageRowBytes};
        uint4 head[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) head[r] = *reinterpret_cast<const uint4 *>(rows[r]);

        int S[NT][4] = {};
        uint32_t mins[2] = {0, 0};  // lanes t = 0, 1: the mins of sub-blocks 4t..4t+3 of rows g, g + 8
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (XSUB < 8 && 2 * j == XSUB) load_x(XSUB);
            int sc[2][2], mn[2][2];  // [row][low / high nibble sub-block]
            uint2 qs[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                q4k_scales(head[r].y, head[r].z, head[r].w, j, sc[r][0], mn[r][0], sc[r][1], mn[r][1]);
                if ((j >> 1) == t) mins[r] |= (uint32_t)(mn[r][0] | (mn[r][1] << 8)) << (16 * (j & 1));
                qs[r] = *reinterpret_cast<const uint2 *>(rows[r] + 16 + 32 * j + 8 * t);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint2 * xs = xf[(2 * j + h) % XSUB];
                const uint32_t a0 = (qs[0].x >> (4 * h)) & 0x0F0F0F0Fu, a1 = (qs[1].x >> (4 * h)) & 0x0F0F0F0Fu;
                const uint32_t a2 = (qs[0].y >> (4 * h)) & 0x0F0F0F0Fu, a3 = (qs[1].y >> (4 * h)) & 0x0F0F0F0Fu;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    int c[4];
                    mma_s8(c, a0, a1, a2, a3, xs[nt].x, xs[nt].y);
                    S[nt][0] += sc[0][h] * c[0];
                    S[nt][1] += sc[0][h] * c[1];
                    S[nt][2] += sc[1][h] * c[2];
                    S[nt][3] += sc[1][h] * c[3];
                }
            }
        }
        float2 dm[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) dm[r] = __half22float2(*reinterpret_cast<const __half2 *>(&head[r].x));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const XSums & xsum = x.sums[(int64_t)b * NP + 8 * nt + g];
            const uint32_t hi = t < 2 ? reinterpret_cast<const uint32_t *>(xsum.hi)[t] : 0u;
            const uint32_t lo = t < 2 ? reinterpret_cast<const uint32_t *>(xsum.lo)[t] : 0u;
            int mh[4], ml[4];
            mma_s8(mh, mins[0], mins[1], 0u, 0u, hi, 0u);
            mma_s8(ml, mins[0], mins[1], 0u, 0u, lo, 0u);
            const float2 d = *reinterpret_cast<const float2 *>(x.dx + (int64_t)b * NP + 8 * nt + 2 * t);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 rd = dm[k >> 1];
                const float v = rd.x * (float)S[nt][k] - rd.y * (float)(64 * mh[k] + ml[k]);
                acc[nt][k] += (k & 1 ? d.y : d.x) * v;
            }
        }
    }
    asm volatile("cp.async.wait_group 0;");
    __syncthreads();  // the stages are free: the warps' partial sums take their place (and the
                      // other blocks of the cluster read them there)
    mma_reduce_store<NT, R>(acc, reinterpret_cast<float *>(smem), y, ldy, residual, row_base, n_rows, n_cols);
}

// R for a Q4_K product of n_rows x n_cols: mma_row_tiles', except that at 17-24 columns two
// tiles pay for 5120-row matrices even in a wave 61 % full (H100, kernels_bench, 24 columns, R = 1
// -> 2: ffn down 44.6 -> 39.2 us, ssm_out 21.7 -> 19.1; 17 columns: 44.1 -> 39.9, 21.2 -> 19.5),
// where at 16 the H200 had them lose (1.33 -> 1.46x one column, mma_row_tiles; why 3 column tiles
// differ from 2 there was not measured). So where mma_row_tiles keeps one tile, 3 column tiles take
// two once those fill half a wave. (A lower fill for mma_row_tiles' own rule would also move the
// ffn stack from 2 tiles to 4, which the same run measured slower: 63.8 -> 67.1 us.)
// bench/HISTORY.md, 2026-12-06. DELTASPEC_MMA_HALF_WAVE_TILES=0 keeps mma_row_tiles' choice (A/B).
inline int q4k_mma_row_tiles(int64_t n_rows, int n_cols) {
    static const bool half_wave_tiles = env_switch_on("DELTASPEC_MMA_HALF_WAVE_TILES");
    const int r = mma_row_tiles(n_rows, 4);
    const bool half_wave = mma_padded_cols(n_cols) == 24 && (n_rows + 31) / 32 >= device_sm_count();
    return r == 1 && half_wave_tiles && half_wave ? 2 : r;
}

// The product alone, from x already quantized (XFormat::q4k): a pair's second product.
inline void launch_q4k_mma_product(const void * W, const MmaX & xq, float * y, int64_t ldy, int64_t n_rows,
                                   int64_t n_k, int n_cols, int64_t row_bytes, cudaStream_t stream,
                                   YResidual residual = YResidual{}, int row_tiles = 0, int k_split = 0) {
    const int n_blocks = (int)(n_k / 256);
    const uint8_t * w = static_cast<const uint8_t *>(W);
    with_row_tiles<4>(row_tiles > 0 ? row_tiles : q4k_mma_row_tiles(n_rows, n_cols), [&](auto r) {
        const int64_t tiles = (n_rows + 16 * r.value - 1) / (16 * r.value);
        const int c = mma_k_split_allowed(k_split > 0 ? k_split : 1);
        with_column_tiles(n_cols, [&](auto nt) {
            launch_clustered(q4k_mma<nt.value, r.value>, (unsigned)(tiles * c), 256, kQ4KMmaSmem, stream, c, w, xq,
                             y, ldy, residual, (int)n_rows, n_cols, n_blocks, row_bytes);
        });
    });
}

// Host side: W in ggml's Q4_K layout (n_k a multiple of 256, 16-byte aligned rows), x: n_cols (2..32)
// f32 columns of n_k values, ldx floats apart, 16-byte aligned; y: n_cols columns of n_rows, ldy
// apart. scratch: mma_x_bytes(n_k, n_cols) bytes of device memory, 16-byte aligned.
// norm: a folded rms_norm of x (n_k <= kMmaNormMaxK), or none; glu: a folded SwiGLU, or none;
// residual: added to y as it is stored, or none. row_tiles: R (1, 2 or 4), 0 = q4k_mma_row_tiles;
// k_split: thread blocks per cluster sharing a tile's k (1..4, sm_90+), 0 = 1 (mma_x.cuh:
// splitting made Q4_K slower).
inline void launch_q4k_mma(const void * W, const float * x, int64_t ldx, float * y, int64_t ldy, int64_t n_rows,
                           int64_t n_k, int n_cols, int64_t row_bytes, void * scratch, cudaStream_t stream,
                           XNorm norm = XNorm{}, XGlu glu = XGlu{}, YResidual residual = YResidual{},
                           int row_tiles = 0, int k_split = 0) {
    const MmaX xq = launch_quantize_x256<XFormat::q4k>(x, ldx, n_k, n_cols, scratch, stream, norm, glu);
    launch_q4k_mma_product(W, xq, y, ldy, n_rows, n_k, n_cols, row_bytes, stream, residual, row_tiles, k_split);
}

}  // namespace deltaspec_cuda
