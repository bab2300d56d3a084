// The tq quantizer and rotation kernels (ggml/deltaspec_tq.h), one warp per head vector, in a header of
// their own so that the same source compiles twice: into ggml-cuda (deltaspec_tq.cu) and on the host
// (csrc/tq_warp_emulation.cpp, with host stand-ins of the few CUDA intrinsics used here, lanes run as
// threads), where the CPU-only test suite compares the bytes this source writes with the CPU codec's
// (tests/test_turboquant.py) and the GPU diagnostic compares them with the device's.
//
// Lane l holds values l*D/32 .. (l+1)*D/32-1. The rotation's butterflies run in registers for the
// stages inside a lane and through shuffles for the others; the sums are the lanes' fused
// multiply-adds in order, then a butterfly reduction. That is the arithmetic of
// ggml/deltaspec_tq_codec.h step for step, with every operation an explicit round-to-nearest
// intrinsic (ggml-cuda compiles with -use_fast_math, which would otherwise contract and approximate).
// One difference no intrinsic removes: -use_fast_math flushes denormal operands and results to zero
// (the .ftz forms), the CPU does not; they differ only for head vectors whose squares fall below
// 1.2e-38, i.e. values under ~1e-19 (the host emulation flushes as the device does).
//
// The includer provides: __constant__, __device__, __global__, __forceinline__, __restrict__,
// __shared__, __host__, threadIdx/blockIdx, __fadd_rn, __fsub_rn, __fmul_rn, __fmaf_rn, __fdiv_rn, __fsqrt_rn,
// __shfl_xor_sync, __syncwarp, half, __float2half_rn and __half_as_ushort.
#pragma once

#include <cstdint>
#include <cstring>

#include "deltaspec_tq_codebook.h"

namespace deltaspec_tq_warp {

__constant__ float c_tq3_centroids[DELTASPEC_TQ_N_HEAD_DIMS][8] = DELTASPEC_TQ3_CENTROIDS_INIT;
__constant__ float c_tq3_thresholds[DELTASPEC_TQ_N_HEAD_DIMS][7] = DELTASPEC_TQ3_THRESHOLDS_INIT;
__constant__ float c_tq4_centroids[DELTASPEC_TQ_N_HEAD_DIMS][16] = DELTASPEC_TQ4_CENTROIDS_INIT;
__constant__ float c_tq4_thresholds[DELTASPEC_TQ_N_HEAD_DIMS][15] = DELTASPEC_TQ4_THRESHOLDS_INIT;
__constant__ uint64_t c_tq_signs[8] = DELTASPEC_TQ_SIGNS_INIT;

constexpr int kWarpsPerBlock = 4;

template <int D> __host__ __device__ constexpr int dim_index() { return D == 32 ? 0 : D == 64 ? 1 : D == 128 ? 2 : 3; }
// 1/sqrt(D) as ggml/deltaspec_tq_codec.h's inv_sqrt_dim
template <int D> __device__ __forceinline__ float inv_sqrt_dim() {
    return D == 32 ? 0.17677669529663687f : D == 64 ? 0.125f : D == 128 ? 0.08838834764831845f : 0.0625f;
}

__device__ __forceinline__ bool negated(int i) { return (c_tq_signs[i / 64] >> (i % 64)) & 1; }

template <int BITS, int D> __device__ __forceinline__ float centroid(int k) {
    return BITS == 3 ? c_tq3_centroids[dim_index<D>()][k] : c_tq4_centroids[dim_index<D>()][k];
}
template <int BITS, int D> __device__ __forceinline__ float threshold(int k) {
    return BITS == 3 ? c_tq3_thresholds[dim_index<D>()][k] : c_tq4_thresholds[dim_index<D>()][k];
}

// The Walsh-Hadamard butterflies of the warp's D values (N = D/32 per lane), stages ascending.
template <int N> __device__ __forceinline__ void fwht_warp(float (&y)[N], int lane) {
#pragma unroll
    for (int h = 1; h < N; h *= 2) {
#pragma unroll
        for (int k = 0; k < N; ++k) {
            if ((k & h) == 0) {
                const float a = y[k], b = y[k + h];
                y[k] = __fadd_rn(a, b);
                y[k + h] = __fsub_rn(a, b);
            }
        }
    }
#pragma unroll
    for (int m = 1; m < 32; m *= 2) {  // stage h = m * N pairs lane with lane ^ m
        const bool upper = lane & m;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const float other = __shfl_xor_sync(0xffffffff, y[k], m);
            y[k] = upper ? __fsub_rn(other, y[k]) : __fadd_rn(y[k], other);
        }
    }
}

__device__ __forceinline__ float warp_sum(float p) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) p = __fadd_rn(p, __shfl_xor_sync(0xffffffff, p, off));
    return p;
}

// y = R x (inverse: x = R^T y) of one head vector per warp, in registers
template <int D> __device__ __forceinline__ void rotate_warp(float (&y)[D / 32], int lane, bool inverse) {
    constexpr int N = D / 32;
    if (!inverse) {
#pragma unroll
        for (int k = 0; k < N; ++k) y[k] = negated(lane * N + k) ? -y[k] : y[k];
    }
    fwht_warp<N>(y, lane);
#pragma unroll
    for (int k = 0; k < N; ++k) {
        y[k] = __fmul_rn(y[k], inv_sqrt_dim<D>());
        if (inverse && negated(lane * N + k)) y[k] = -y[k];
    }
}

// x: F32 rows (row t at x + t * x_nb1, head h at h*D floats); cache row idx[t], head h at h * head bytes
template <int BITS, int D>
__global__ void tq_quantize(const char * __restrict__ x, size_t x_nb1, const int64_t * __restrict__ idx,
                            char * __restrict__ cache, size_t cache_nb1, int64_t T, int64_t H) {
    constexpr int N = D / 32, HB = 2 + D * BITS / 8, LEVELS = 1 << BITS;
    __shared__ uint8_t s_idx[kWarpsPerBlock][D];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t vec = (int64_t)blockIdx.x * kWarpsPerBlock + warp;
    if (vec >= T * H) return;  // whole warps leave together
    const int64_t t = vec / H, h = vec % H;
    const float * src = (const float *)(x + t * x_nb1) + h * D + lane * N;
    float y[N];
#pragma unroll
    for (int k = 0; k < N; ++k) y[k] = src[k];
    rotate_warp<D>(y, lane, false);

    float p = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) p = __fmaf_rn(y[k], y[k], p);
    const float sigma = __fsqrt_rn(__fmul_rn(warp_sum(p), 1.0f / (float)D));
    float num = 0.0f, den = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        int n = 0;
#pragma unroll
        for (int c = 0; c + 1 < LEVELS; ++c) n += y[k] > __fmul_rn(sigma, threshold<BITS, D>(c));
        s_idx[warp][lane * N + k] = (uint8_t)n;
        const float cv = centroid<BITS, D>(n);
        num = __fmaf_rn(y[k], cv, num);
        den = __fmaf_rn(cv, cv, den);
    }
    num = warp_sum(num);
    den = warp_sum(den);
    const float d = den > 0.0f ? __fdiv_rn(num, den) : 0.0f;
    __syncwarp();

    uint8_t * out = (uint8_t *)(cache + idx[t] * cache_nb1) + h * HB;
    const uint8_t * ix = s_idx[warp];
    if (lane == 0) {
        // One 16-bit store of the fp16's bits (out is 2-byte aligned: every head block and row has an
        // even size). Not a byte-wise copy of the `half`: for that, nvcc 13.0's ptxas (sm_90a) emitted
        // F2I.U8.F16.TRUNC (the scale's VALUE converted to a saturated integer) as the low byte
        // instead of its low 8 bits, so the device's low byte read min(255, trunc(d)).
        *reinterpret_cast<uint16_t *>(out) = __half_as_ushort(__float2half_rn(d));
    }
    uint8_t * qs = out + 2;
    if (BITS == 3) {
        for (int j = lane; j < D / 4; j += 32) {
            qs[j] = (uint8_t)((ix[4 * j] & 3) | (ix[4 * j + 1] & 3) << 2 | (ix[4 * j + 2] & 3) << 4 | (ix[4 * j + 3] & 3) << 6);
        }
        for (int j = lane; j < D / 8; j += 32) {
            uint8_t b = 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) b |= (uint8_t)((ix[8 * j + k] >> 2) << k);
            qs[D / 4 + j] = b;
        }
    } else {
        for (int j = lane; j < D / 2; j += 32) qs[j] = (uint8_t)(ix[2 * j] | ix[2 * j + 1] << 4);
    }
}

// n_vec vectors of D floats: vector v = (i0, i1, i2) with v = i0 + n0 * (i1 + n1 * i2) read at
// src + i0*nb1 + i1*nb2 + i2*nb3, written contiguously to dst + v*D; rotated (or back).
template <int D>
__global__ void tq_rotate(const char * __restrict__ src, size_t nb1, size_t nb2, size_t nb3, int64_t n0, int64_t n1,
                          int64_t n_vec, float * __restrict__ dst, bool inverse) {
    constexpr int N = D / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t v = (int64_t)blockIdx.x * kWarpsPerBlock + warp;
    if (v >= n_vec) return;
    const int64_t i0 = v % n0, i1 = v / n0 % n1, i2 = v / (n0 * n1);
    const float * s = (const float *)(src + i0 * nb1 + i1 * nb2 + i2 * nb3) + lane * N;
    float y[N];
#pragma unroll
    for (int k = 0; k < N; ++k) y[k] = s[k];
    rotate_warp<D>(y, lane, inverse);
#pragma unroll
    for (int k = 0; k < N; ++k) dst[v * D + lane * N + k] = y[k];
}

}  // namespace deltaspec_tq_warp
