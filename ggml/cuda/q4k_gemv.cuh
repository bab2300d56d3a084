// Q4_K matrix x one f32 vector on CUDA (the decode step's mat-vec), reading ggml's block_q4_K
// layout as it is stored: no repacking, no second copy of the weights, no q8_1 pass over x.
//
// block_q4_K (144 bytes, 256 weights): half d, half dmin, 12 bytes of 6-bit sub-block scales and
// mins (8 sub-blocks of 32), 128 bytes of nibbles. qs[32*j + l] holds weight 64*j + l in its low
// nibble and weight 64*j + 32 + l in its high nibble; w = d*sc*q - dmin*m.
//
// Mapping: a lane owns one 16-byte slice of qs ("chunk" c = 0..7 of a block: 16 low and 16 high
// nibbles); 8 lanes cover a block and a warp 4 blocks per step, of one row (rows_per_warp 1) or a
// few. x is quantized to int8 once per thread block (one scale per 16 values, as ggml's q8_1 does
// per 32) into shared memory, and 4 nibbles at a time meet x in one dp4a. The mins use the exact
// sums of x.
//
// How it got here (H200, bench/kernels/q4k_gemv_bench.py, 27B shapes): f32 math with one PRMT and
// one FFMA per weight, 4 rows per warp: 1.2-1.8 TB/s, like ggml's own mat-vec; dp4a with x
// quantized in each warp's registers: no better; splitting K across warps: worse (189 registers,
// 12 % occupancy, latency-bound per Nsight Compute); x prepared once per block in shared memory,
// one row per warp (39-61 registers): 1.7-2.5 TB/s. Not yet used by the engine: see bench/README.
#pragma once

#include <cstdint>
#include <cuda_fp16.h>

namespace deltaspec_cuda {

constexpr int kQ4KBytes = 144;

__device__ __forceinline__ uint4 load_stream(const uint8_t * p) {
    return __ldcs(reinterpret_cast<const uint4 *>(p));
}

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

// 16 floats -> 16 int8 (4 words) with one scale: x ~= scale * xq
__device__ __forceinline__ float quantize16(const float4 (&v)[4], int (&xq)[4]) {
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[k].x), fabsf(v[k].y)), fmaxf(fabsf(v[k].z), fabsf(v[k].w))));
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int q0 = __float2int_rn(v[k].x * inv), q1 = __float2int_rn(v[k].y * inv);
        const int q2 = __float2int_rn(v[k].z * inv), q3 = __float2int_rn(v[k].w * inv);
        xq[k] = (int)__byte_perm(__byte_perm(q0, q1, 0x0040), __byte_perm(q2, q3, 0x0040), 0x5410);
    }
    return amax / 127.0f;
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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// y[r] = W[r] . x for r < n_rows; with GATED, y[r] = (W[r] . x) * silu(G[r] . x) (ggml's fused
// SwiGLU: W is "up", G is "gate"). W and G: n_rows rows of row_bytes each (n_blocks blocks of 256).
// x is prepared once per thread block: every 16-value slice quantized to int8 with its scale and
// exact sum, in shared memory. A warp owns RW rows (and their gate rows when gated) and walks
// their blocks 4 at a time; the next step's weight loads are issued before this step's math.
template <bool GATED, int RW>
__global__ void __launch_bounds__(256)
q4k_gemv_smem(const uint8_t * __restrict__ W, const uint8_t * __restrict__ G, const float * __restrict__ x,
              float * __restrict__ y, int n_rows, int n_blocks, int64_t row_bytes) {
    constexpr int L = GATED ? 2 * RW : RW;
    extern __shared__ uint8_t smem[];
    int8_t * xq = reinterpret_cast<int8_t *>(smem);                              // n_blocks * 256
    float2 * xds = reinterpret_cast<float2 *>(smem + (size_t)n_blocks * 256);   // n_blocks * 16: scale, sum
    const int n_slices = n_blocks * 16;
    for (int sl = threadIdx.x; sl < n_slices; sl += blockDim.x) {
        const float4 * p = reinterpret_cast<const float4 *>(x + 16 * sl);
        float4 v[4] = {__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3)};
        int q[4];
        const float d = quantize16(v, q);
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) sum += (v[k].x + v[k].y) + (v[k].z + v[k].w);
        *reinterpret_cast<int4 *>(xq + 16 * sl) = make_int4(q[0], q[1], q[2], q[3]);
        xds[sl] = make_float2(d, sum);
    }
    __syncthreads();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * 8 + warp) * RW;
    if (row0 >= n_rows) return;
    const int c = lane & 7, j = c >> 1, lo_off = 64 * j + 16 * (c & 1);
    const uint8_t * rows[L];
#pragma unroll
    for (int r = 0; r < L; ++r) {
        const int row = min(row0 + (r % RW), n_rows - 1);
        rows[r] = (GATED && r >= RW ? G : W) + row * row_bytes;
    }
    float acc[L] = {};
    uint4 head[L], qs[L];
    int ib = lane >> 3;
    if (ib < n_blocks) {
#pragma unroll
        for (int r = 0; r < L; ++r) {
            head[r] = load_stream(rows[r] + (int64_t)ib * kQ4KBytes);
            qs[r] = load_stream(rows[r] + (int64_t)ib * kQ4KBytes + 16 + 16 * c);
        }
    }
    for (; ib < n_blocks; ib += 4) {
        uint4 head_next[L], qs_next[L];
        if (ib + 4 < n_blocks) {
#pragma unroll
            for (int r = 0; r < L; ++r) {
                head_next[r] = load_stream(rows[r] + (int64_t)(ib + 4) * kQ4KBytes);
                qs_next[r] = load_stream(rows[r] + (int64_t)(ib + 4) * kQ4KBytes + 16 + 16 * c);
            }
        }
        XSlice xs;
        const int4 lo = *reinterpret_cast<const int4 *>(xq + ib * 256 + lo_off);
        const int4 hi = *reinterpret_cast<const int4 *>(xq + ib * 256 + lo_off + 32);
        xs.lo[0] = lo.x; xs.lo[1] = lo.y; xs.lo[2] = lo.z; xs.lo[3] = lo.w;
        xs.hi[0] = hi.x; xs.hi[1] = hi.y; xs.hi[2] = hi.z; xs.hi[3] = hi.w;
        const float2 dl = xds[(ib * 256 + lo_off) / 16], dh = xds[(ib * 256 + lo_off + 32) / 16];
        xs.d_lo = dl.x; xs.sum_lo = dl.y; xs.d_hi = dh.x; xs.sum_hi = dh.y;
#pragma unroll
        for (int r = 0; r < L; ++r) {
            acc[r] += q4k_chunk(head[r], qs[r], j, xs);
            head[r] = head_next[r];
            qs[r] = qs_next[r];
        }
    }
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        const float v = warp_sum(acc[r]);
        if constexpr (GATED) {
            const float g = warp_sum(acc[RW + r]);
            if (lane == 0 && row0 + r < n_rows) y[row0 + r] = v * silu(g);
        } else {
            if (lane == 0 && row0 + r < n_rows) y[row0 + r] = v;
        }
    }
}

template <int RW>
inline void launch_q4k_gemv_smem(const void * W, const void * G, const float * x, float * y, int64_t n_rows,
                                 int64_t n_cols, int64_t row_bytes, cudaStream_t stream) {
    const int n_blocks = (int)(n_cols / 256);
    const size_t smem = (size_t)n_blocks * 256 + (size_t)n_blocks * 16 * sizeof(float2);
    const dim3 grid((unsigned)((n_rows + 8 * RW - 1) / (8 * RW))), block(256);
    // rows up to 32768 weights (as in every Qwen3.5) fit the default 48 KB; longer ones need the
    // opt-in, set outside any stream capture's concern (it is not a stream operation)
    const bool big = smem > 48 * 1024;
    if (G) {
        if (big) cudaFuncSetAttribute(q4k_gemv_smem<true, RW>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        q4k_gemv_smem<true, RW><<<grid, block, smem, stream>>>((const uint8_t *)W, (const uint8_t *)G, x, y,
                                                               (int)n_rows, n_blocks, row_bytes);
    } else {
        if (big) cudaFuncSetAttribute(q4k_gemv_smem<false, RW>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        q4k_gemv_smem<false, RW><<<grid, block, smem, stream>>>((const uint8_t *)W, nullptr, x, y, (int)n_rows,
                                                                n_blocks, row_bytes);
    }
}

// Host side: W (and G when gated) in ggml's Q4_K layout, n_cols a multiple of 256; x and y f32
// on the device; 16-byte aligned rows. rows_per_warp: 1 (fastest on the H200), 2 or 4.
inline void launch_q4k_gemv(const void * W, const void * G, const float * x, float * y, int64_t n_rows,
                            int64_t n_cols, int64_t row_bytes, cudaStream_t stream, int rows_per_warp = 1) {
    switch (rows_per_warp) {
        case 2: launch_q4k_gemv_smem<2>(W, G, x, y, n_rows, n_cols, row_bytes, stream); break;
        case 4: launch_q4k_gemv_smem<4>(W, G, x, y, n_rows, n_cols, row_bytes, stream); break;
        default: launch_q4k_gemv_smem<1>(W, G, x, y, n_rows, n_cols, row_bytes, stream); break;
    }
}

}  // namespace deltaspec_cuda
