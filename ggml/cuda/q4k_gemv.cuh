// Q4_K matrix x one f32 vector on CUDA (the decode step's mat-vec), reading ggml's block_q4_K
// layout as it is stored: no repacking, no second copy of the weights, no q8_1 pass over x.
//
// block_q4_K (144 bytes, 256 weights): half d, half dmin, 12 bytes of 6-bit sub-block scales and
// mins (8 sub-blocks of 32), 128 bytes of nibbles. qs[32*j + l] holds weight 64*j + l in its low
// nibble and weight 64*j + 32 + l in its high nibble; w = d*sc*q - dmin*m.
//
// Mapping: a lane owns one 16-byte slice of qs ("chunk" c = 0..7 of a block: 16 low and 16 high
// nibbles); 8 lanes cover a block and a warp 4 blocks per step of one row. x is quantized to int8 once per thread block (one scale per 16 values, as ggml's q8_1 does
// per 32) into shared memory, and 4 nibbles at a time meet x in one dp4a. The mins use the exact
// sums of x.
//
// How it got here (H200, bench/kernels/kernels_bench.py, 27B shapes): f32 math with one PRMT and
// one FFMA per weight, 4 rows per warp: 1.2-1.8 TB/s, like ggml's own mat-vec; dp4a with x
// quantized in each warp's registers: no better; splitting K across warps: worse (189 registers,
// 12 % occupancy, latency-bound per Nsight Compute); x prepared once per block in shared memory,
// one row per warp (39-61 registers): 1.7-2.5 TB/s; then a grid of resident blocks that each
// prepare x once and walk many rows (bench/HISTORY.md has the numbers).
#pragma once

#include "gemv_common.cuh"

namespace deltaspec_cuda {

constexpr int kQ4KBytes = 144;

// The 6-bit scales and mins of sub-blocks 2j (low nibbles) and 2j+1 (high nibbles) from the 12
// scale bytes s[0..11] = words w1, w2, w3 (header bytes 4..15), without local-memory indexing.
__device__ __forceinline__ void q4k_scales(uint32_t w1, uint32_t w2, uint32_t w3, int j, int & sc_lo, int & m_lo,
                                           int & sc_hi, int & m_hi) {
    if (j < 2) {  // sub-blocks 0..3: sc = s[is] & 63, m = s[is + 4] & 63
        const uint32_t sc = __byte_perm(w1, 0, 0x4440 | (2 * j)) | (__byte_perm(w1, 0, 0x4440 | (2 * j + 1)) << 8);
        const uint32_t mm = __byte_perm(w2, 0, 0x4440 | (2 * j)) | (__byte_perm(w2, 0, 0x4440 | (2 * j + 1)) << 8);
        sc_lo = sc & 63;
        sc_hi = (sc >> 8) & 63;
        m_lo = mm & 63;
        m_hi = (mm >> 8) & 63;
    } else {  // sub-blocks 4..7: from s[is + 4] (low 4 bits: sc, high: m) and the top 2 bits of s[is - 4], s[is]
        const int k = 2 * j - 4;  // is - 4 for the low sub-block
        const uint32_t a0 = __byte_perm(w3, 0, 0x4440 | k), a1 = __byte_perm(w3, 0, 0x4440 | (k + 1));
        const uint32_t b0 = __byte_perm(w1, 0, 0x4440 | k), b1 = __byte_perm(w1, 0, 0x4440 | (k + 1));
        const uint32_t c0 = __byte_perm(w2, 0, 0x4440 | k), c1 = __byte_perm(w2, 0, 0x4440 | (k + 1));
        sc_lo = (a0 & 0xF) | ((b0 >> 6) << 4);
        sc_hi = (a1 & 0xF) | ((b1 >> 6) << 4);
        m_lo = (a0 >> 4) | ((c0 >> 6) << 4);
        m_hi = (a1 >> 4) | ((c1 >> 6) << 4);
    }
}

// x slice of one (block, chunk): 16 values paired with the low nibbles, 16 with the high ones,
// quantized to int8 (as ggml's q8_1 does, but in registers), and their exact sums for the mins
struct XSlice {
    int lo[4], hi[4];
    float d_lo, d_hi, sum_lo, sum_hi;
};

// The contribution of one 16-byte chunk of one block to its row's dot product.
__device__ __forceinline__ float q4k_chunk(uint4 head, uint4 qs, int j, const XSlice & x) {
    int ilo = 0, ihi = 0;
    ilo = __dp4a((int)(qs.x & 0x0F0F0F0Fu), x.lo[0], ilo);
    ihi = __dp4a((int)((qs.x >> 4) & 0x0F0F0F0Fu), x.hi[0], ihi);
    ilo = __dp4a((int)(qs.y & 0x0F0F0F0Fu), x.lo[1], ilo);
    ihi = __dp4a((int)((qs.y >> 4) & 0x0F0F0F0Fu), x.hi[1], ihi);
    ilo = __dp4a((int)(qs.z & 0x0F0F0F0Fu), x.lo[2], ilo);
    ihi = __dp4a((int)((qs.z >> 4) & 0x0F0F0F0Fu), x.hi[2], ihi);
    ilo = __dp4a((int)(qs.w & 0x0F0F0F0Fu), x.lo[3], ilo);
    ihi = __dp4a((int)((qs.w >> 4) & 0x0F0F0F0Fu), x.hi[3], ihi);
    int sc_lo, m_lo, sc_hi, m_hi;
    q4k_scales(head.y, head.z, head.w, j, sc_lo, m_lo, sc_hi, m_hi);
    const float2 dm = __half22float2(*reinterpret_cast<const __half2 *>(&head.x));
    const float qx = (float)(sc_lo * ilo) * x.d_lo + (float)(sc_hi * ihi) * x.d_hi;
    return dm.x * qx - dm.y * ((float)m_lo * x.sum_lo + (float)m_hi * x.sum_hi);
}

// y[r] = W[r] . x (+ bias[r]: ggml fuses a following residual add as a bias) for r < n_rows; with
// GATED, y[r] = (W[r] . x) * silu(G[r] . x) (ggml's fused SwiGLU: W is "up", G is "gate"). With
// norm.w, x stands for rms_norm(x) * norm.w (a folded norm, gemv_common.cuh).
// W and G: n_rows rows of row_bytes each (n_blocks blocks of 256).
// Each warp owns one row at a time (and its gate row) and walks its blocks 4 at a time, the next
// step's weight loads issued before this step's math; warps of a block take rows 8 apart, blocks
// gridDim.x * 8 apart. With SPLIT_K (matrices of few rows, such as DeltaNet's 48-row alpha and
// beta, which 8 rows a block would leave on a handful of SMs), the 8 warps of a block share one
// row, each walking every 8th group of 4 blocks, and a block's rows are gridDim.x apart. With
// PAIRED (any plain product of 4096+ rows, made for wide matrices of a few thousand rows such as
// ffn down: 5120 x 17408), a warp takes two rows 8 apart at once, so a block covers 16 rows:
// twice the weight loads in flight per warp, all rows of ffn down in one wave of resident blocks
// (with one row a warp, 5120 rows needed a second wave on a fifth of the blocks), and x is
// prepared once per 16 rows.
template <bool SPLIT_K, bool PAIRED = false>
constexpr int kQ4KRowsPerBlock = SPLIT_K ? 1 : PAIRED ? 16 : 8;

template <bool GATED, bool SPLIT_K, bool PAIRED>
__global__ void __launch_bounds__(256)
q4k_gemv(const uint8_t * __restrict__ W, const uint8_t * __restrict__ G, const float * x,
         const float * bias, float * y, int n_rows, int n_blocks, int64_t row_bytes, XNorm norm) {
    static_assert(!(PAIRED && (GATED || SPLIT_K)), "PAIRED is a form of the plain kernel");
    constexpr int L = GATED || PAIRED ? 2 : 1;
    constexpr int kRowsPerBlock = kQ4KRowsPerBlock<SPLIT_K, PAIRED>;
    constexpr int kBlocksPerStep = SPLIT_K ? 32 : 4;  // a row's blocks one step of the warp(s) covers
    extern __shared__ uint8_t smem[];
    __shared__ float partial[SPLIT_K ? 8 : 1][L];  // SPLIT_K: each warp's share of the row's sums
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = lane & 7, j = c >> 1, lo_off = 64 * j + 16 * (c & 1);
    const int first_ib = (lane >> 3) + (SPLIT_K ? 4 * warp : 0);
    const int stride = gridDim.x * kRowsPerBlock;
    const uint8_t * rows[L];
    uint4 head[L], qs[L];  // the step at hand of this warp's row (blocks first_ib + kBlocksPerStep * step)
    auto load = [&](int ib, uint4 (&h)[L], uint4 (&q)[L]) {
#pragma unroll
        for (int r = 0; r < L; ++r) {
            h[r] = load_stream(rows[r] + (int64_t)ib * kQ4KBytes);
            q[r] = load_stream(rows[r] + (int64_t)ib * kQ4KBytes + 16 + 16 * c);
        }
    };
    auto start_row = [&](int row) {  // point at a row and issue its first loads
        rows[0] = W + row * row_bytes;
        if constexpr (GATED) rows[1] = G + row * row_bytes;
        if constexpr (PAIRED) rows[1] = W + min(row + 8, n_rows - 1) * row_bytes;  // past the end: a copy, unused
        if (first_ib < n_blocks) load(first_ib, head, qs);
    };
    int row = blockIdx.x * kRowsPerBlock + (SPLIT_K ? 0 : warp);
    if (row < n_rows) start_row(row);  // in flight while x is prepared (and the kernel before ends)
    wait_for_inputs();
    const XShared xs_block = prepare_x(x, n_blocks * 256, smem, norm);

    for (; row < n_rows; row += stride) {
        float acc[L] = {};
        for (int ib = first_ib; ib < n_blocks; ib += kBlocksPerStep) {
            uint4 head_next[L], qs_next[L];
            if (ib + kBlocksPerStep < n_blocks) load(ib + kBlocksPerStep, head_next, qs_next);
            XSlice xs;
            const int4 lo = *reinterpret_cast<const int4 *>(xs_block.values(ib, lo_off));
            const int4 hi = *reinterpret_cast<const int4 *>(xs_block.values(ib, lo_off + 32));
            xs.lo[0] = lo.x; xs.lo[1] = lo.y; xs.lo[2] = lo.z; xs.lo[3] = lo.w;
            xs.hi[0] = hi.x; xs.hi[1] = hi.y; xs.hi[2] = hi.z; xs.hi[3] = hi.w;
            const float2 dl = xs_block.slice(ib, lo_off / 16), dh = xs_block.slice(ib, lo_off / 16 + 2);
            xs.d_lo = dl.x; xs.sum_lo = dl.y; xs.d_hi = dh.x; xs.sum_hi = dh.y;
#pragma unroll
            for (int r = 0; r < L; ++r) {
                acc[r] += q4k_chunk(head[r], qs[r], j, xs);
                head[r] = head_next[r];
                qs[r] = qs_next[r];
            }
        }
        if (row + stride < n_rows) start_row(row + stride);  // in flight during the sums below
        float v[L];
#pragma unroll
        for (int r = 0; r < L; ++r) v[r] = warp_sum(acc[r]) * xs_block.scale;
        if constexpr (SPLIT_K) {  // every warp of the block is on this row: add up their shares
            if (lane == 0) {
#pragma unroll
                for (int r = 0; r < L; ++r) partial[warp][r] = v[r];
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < L; ++r) {
                v[r] = 0.0f;
#pragma unroll
                for (int w = 0; w < 8; ++w) v[r] += partial[w][r];
            }
            __syncthreads();  // partial is rewritten for the next row
            if (warp != 0) continue;
        }
        if (lane == 0) {
            if constexpr (GATED) {
                y[row] = v[0] * silu(v[1]);
            } else {
#pragma unroll
                for (int r = 0; r < L; ++r) {  // bias may be y itself (in place)
                    const int out = row + 8 * r;
                    if (out < n_rows) y[out] = bias ? v[r] + bias[out] : v[r];
                }
            }
        }
    }
}

// Matrices with fewer rows than this take the SPLIT_K kernel.
constexpr int64_t kQ4KSplitKRows = 256;
// Plain products with at least this many rows take the PAIRED form in the engine
// (deltaspec_matmul.cu has the measurements).
constexpr int64_t kQ4KPairedMinRows = 4096;

// Host side: W (and G when gated) in ggml's Q4_K layout, n_cols a multiple of 256; x, y and bias
// (optional, not with G) f32 on the device; 16-byte aligned rows. resident: a grid of the blocks
// that stay resident (each walks many rows); otherwise one block per 8 rows, or per row when
// split (for the benchmark). norm: an rms_norm to fold into x (none by default). paired_rows: the
// PAIRED form for a plain (not gated, not split) product.
inline void launch_q4k_gemv(const void * W, const void * G, const float * x, float * y, int64_t n_rows,
                            int64_t n_cols, int64_t row_bytes, cudaStream_t stream, bool resident = true,
                            const float * bias = nullptr, XNorm norm = XNorm{}, bool paired_rows = false) {
    const int n_blocks = (int)(n_cols / 256);
    const size_t smem = x_smem_bytes(n_cols);
    const bool split = n_rows < kQ4KSplitKRows;
    const bool paired = paired_rows && !G && !split;
    const int rows_per_block = split ? kQ4KRowsPerBlock<true> : paired ? kQ4KRowsPerBlock<false, true>
                                                                       : kQ4KRowsPerBlock<false>;
    const int64_t groups = (n_rows + rows_per_block - 1) / rows_per_block;
    const auto kernel = split    ? (G ? q4k_gemv<true, true, false> : q4k_gemv<false, true, false>)
                        : paired ? q4k_gemv<false, false, true>
                                 : (G ? q4k_gemv<true, false, false> : q4k_gemv<false, false, false>);
    const unsigned grid = launch_grid(kernel, smem, groups, resident);
    launch(kernel, grid, 256, smem, stream, (const uint8_t *)W, (const uint8_t *)G, x, G ? nullptr : bias, y,
           (int)n_rows, n_blocks, row_bytes, norm);
}

}  // namespace deltaspec_cuda
