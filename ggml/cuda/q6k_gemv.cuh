// Q6_K matrix x one f32 vector on CUDA (the decode step's mat-vec for Q4_K_M's Q6_K tensors: the
// output head, half the ffn down matrices, attention v), reading ggml's block_q6_K as stored.
//
// block_q6_K (210 bytes, 256 weights): ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16]
// (one per 16 weights), half d. For half n (128 weights) and l < 32, with ql, qh, sc advanced by
// 64, 32, 8 per half: weight l     = ql[l] & 15      | (qh[l] >> 0 & 3) << 4, scale sc[l/16 + 0]
//                      weight l+32  = ql[l+32] & 15   | (qh[l] >> 2 & 3) << 4, scale sc[l/16 + 2]
//                      weight l+64  = ql[l] >> 4      | (qh[l] >> 4 & 3) << 4, scale sc[l/16 + 4]
//                      weight l+96  = ql[l+32] >> 4   | (qh[l] >> 6 & 3) << 4, scale sc[l/16 + 6]
// and w = d * sc * (q - 32).
//
// 210-byte blocks are only 2-byte aligned, which is what holds ggml's own kernel to 16-bit loads.
// Here a warp copies 8 blocks (1680 bytes, 8-byte aligned when a row's block count is a multiple
// of 4) from global memory with coalesced 8-byte loads into its own shared-memory stage, issuing
// the next 8 blocks' loads before it computes; lanes then read their bytes from the stage with
// funnel shifts. Lane (b, n, h) of 32 takes block b of 8, half n, and l in [16h, 16h + 16): 64
// weights under four scales, each group of 16 meeting one 16-value slice of x (prepared once per
// thread block as int8, see gemv_common.cuh) in four dp4a; the -32 uses x's exact sum.
#pragma once

#include "gemv_common.cuh"

namespace deltaspec_cuda {

constexpr int kQ6KBytes = 210;
constexpr int kQ6KStepBlocks = 8;
constexpr int kQ6KStageBytes = kQ6KStepBlocks * kQ6KBytes + 16;  // + room for the funnel's last word

// 4 words from byte offset o (even) of a 4-byte aligned shared buffer
__device__ __forceinline__ void stage_words(const uint8_t * stage, int o, uint32_t (&w)[4]) {
    const uint32_t * p = reinterpret_cast<const uint32_t *>(stage + (o & ~3));
    const int shift = (o & 3) * 8;
    uint32_t a = p[0];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const uint32_t b = p[k + 1];
        w[k] = __funnelshift_r(a, b, shift);
        a = b;
    }
}

// the signed byte i (0..3) of w
__device__ __forceinline__ int sbyte(uint32_t w, int i) { return (int)(int8_t)(w >> (8 * i)); }

__global__ void __launch_bounds__(256)
q6k_gemv(const uint8_t * __restrict__ W, const float * x, const float * bias, float * y, int n_rows,
         int n_blocks, int64_t row_bytes, XNorm norm) {
    extern __shared__ uint8_t smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint8_t * stage = smem + x_smem_bytes(n_blocks * 256) + warp * kQ6KStageBytes;
    uint2 * stage8 = reinterpret_cast<uint2 *>(stage);
    // lane = 16 n + 8 h + b: the 8 lanes of a quarter warp, which share a 16-byte shared-memory
    // load's cycle, take the 8 blocks, whose x rows (272 bytes apart) start on 8 different groups
    // of 4 banks. (With b in the high bits, the lanes of a block and of the next one met on the
    // same banks: each 16-byte x load took 4 passes instead of 1.)
    const int bi = lane & 7, hl = (lane >> 3) & 1, hn = lane >> 4;
    const int n_steps = (n_blocks + kQ6KStepBlocks - 1) / kQ6KStepBlocks;
    constexpr int kLoads = (kQ6KStepBlocks * kQ6KBytes / 8 + 31) / 32;  // 8-byte loads per lane and step
    const int stride = gridDim.x * 8;

    uint2 next[kLoads];  // the next step's bytes of this warp's row
    int next_words = 0;
    auto load_step = [&](int row, int s) {
        const int nb = min(kQ6KStepBlocks, n_blocks - s * kQ6KStepBlocks);
        next_words = nb * kQ6KBytes / 8;
        const uint2 * p = reinterpret_cast<const uint2 *>(W + row * row_bytes) + s * (kQ6KStepBlocks * kQ6KBytes / 8);
#pragma unroll
        for (int i = 0; i < kLoads; ++i) {
            const int idx = lane + 32 * i;
            if (idx < next_words) next[i] = __ldcs(p + idx);
        }
    };
    int row = blockIdx.x * 8 + warp;
    if (row < n_rows) load_step(row, 0);  // in flight while x is prepared (and the kernel before ends)
    wait_for_inputs();
    const XShared xs = prepare_x(x, n_blocks * 256, smem, norm);

    for (; row < n_rows; row += stride) {
        float acc = 0.0f;
        for (int s = 0; s < n_steps; ++s) {
            const int words = next_words;
            __syncwarp();
#pragma unroll
            for (int i = 0; i < kLoads; ++i) {
                const int idx = lane + 32 * i;
                if (idx < words) stage8[idx] = next[i];
            }
            __syncwarp();
            if (s + 1 < n_steps) {
                load_step(row, s + 1);
            } else if (row + stride < n_rows) {
                load_step(row + stride, 0);  // the next row's first step, in flight during this one's math
            }
            if (bi * kQ6KBytes >= words * 8) continue;  // past the row's last block

            const int sb = bi * kQ6KBytes, b = s * kQ6KStepBlocks + bi;
            uint32_t A[4], B[4], H[4];
            stage_words(stage, sb + 64 * hn + 16 * hl, A);
            stage_words(stage, sb + 64 * hn + 32 + 16 * hl, B);
            stage_words(stage, sb + 128 + 32 * hn + 16 * hl, H);
            const uint32_t * sp = reinterpret_cast<const uint32_t *>(stage + ((sb + 192 + 8 * hn) & ~3));
            const int sshift = ((sb + 192 + 8 * hn) & 3) * 8;
            const uint32_t S0 = __funnelshift_r(sp[0], sp[1], sshift), S1 = __funnelshift_r(sp[1], sp[2], sshift);
            const int sc[4] = {sbyte(S0, hl), sbyte(S0, hl + 2), sbyte(S1, hl), sbyte(S1, hl + 2)};
            const int od = sb + 208;
            const uint32_t dw = *reinterpret_cast<const uint32_t *>(stage + (od & ~3));
            const float d = __half2float(__ushort_as_half((unsigned short)(dw >> ((od & 2) * 8))));

            float block = 0.0f;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int slice = 8 * hn + 2 * k + hl;  // of the 16 in block b
                const int4 xv = *reinterpret_cast<const int4 *>(xs.values(b, 16 * slice));
                const float2 xd = xs.slice(b, slice);
                const int xw[4] = {xv.x, xv.y, xv.z, xv.w};
                int dot = 0;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const uint32_t lo = (k & 1 ? B[i] : A[i]) >> (k & 2 ? 4 : 0);
                    const uint32_t hi = k == 0 ? H[i] << 4 : k == 1 ? H[i] << 2 : k == 2 ? H[i] : H[i] >> 2;
                    dot = __dp4a((int)((lo & 0x0F0F0F0Fu) | (hi & 0x30303030u)), xw[i], dot);
                }
                block += (float)sc[k] * (xd.x * (float)dot - 32.0f * xd.y);
            }
            acc += d * block;
        }
        acc = warp_sum(acc) * xs.scale;
        if (lane == 0) y[row] = bias ? acc + bias[row] : acc;  // bias: a fused residual add, maybe in place
    }
}

// Whether the engine runs a Q6_K mat-vec on the resident grid: not over more columns than rows
// (ffn down, 5120 x 17408), which ran one thread block per 8 rows faster: 36.6-36.7 vs 39.2-39.3
// us in three H200 runs of kernels_bench (the output head, 248320 rows, is the other way round:
// 390 vs 491 us); with the conflict-free x reads 30.1 vs 30.5 and 299-304 vs 421-433.
inline bool q6k_resident_grid(int64_t n_rows, int64_t n_cols) { return n_cols <= n_rows; }

// Host side: W in ggml's Q6_K layout with n_cols a multiple of 1024 (rows then start 8-byte
// aligned) and an 8-byte aligned base; x, y and bias (optional: y = W x + bias) f32 on the
// device, x 16-byte aligned; norm: an rms_norm to fold into x (none by default).
inline void launch_q6k_gemv(const void * W, const float * x, float * y, int64_t n_rows, int64_t n_cols,
                            int64_t row_bytes, cudaStream_t stream, bool resident = true,
                            const float * bias = nullptr, XNorm norm = XNorm{}) {
    const int n_blocks = (int)(n_cols / 256);
    const size_t smem = x_smem_bytes(n_cols) + 8 * kQ6KStageBytes;
    const unsigned grid = launch_grid(q6k_gemv, smem, (n_rows + 7) / 8, resident);
    launch(q6k_gemv, grid, 256, smem, stream, (const uint8_t *)W, x, bias, y, (int)n_rows, n_blocks, row_bytes, norm);
}

}  // namespace deltaspec_cuda
