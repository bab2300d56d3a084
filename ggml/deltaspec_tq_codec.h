// The tq3/tq4 codec on the host (deltaspec_tq.h has the format): one head vector at a time, in the
// fixed order of operations that ggml/cuda/deltaspec_tq.cu's warp reproduces, so that both write the
// same bytes. Every multiply-add that must match is an explicit fmaf (a single rounding, as the GPU's
// __fmaf_rn), every other step a single IEEE operation; files including this are compiled with
// -ffp-contract=off so the compiler fuses nothing else. Used inside ggml-cpu (the CPU backend's nodes)
// and by the host API (deltaspec_tq.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "deltaspec_tq_codebook.h"
#include "ggml.h"

namespace deltaspec_tq {

constexpr int kMaxHeadDim = 256;
constexpr int kLanes = 32;  // the partial sums of a CUDA warp

// The test-only planted bugs (tests/test_turboquant.py): DELTASPEC_TEST_TQ_BUG names one for the
// process ("uniform_codebook": evenly spaced levels instead of Lloyd-Max; "no_rotation": R = I;
// "v_not_rotated_back": the CPU attention node leaves a tq V's output in the rotated domain).
inline bool planted(const char * name) {
    static const char * const bug = std::getenv("DELTASPEC_TEST_TQ_BUG");
    return bug != nullptr && std::strcmp(bug, name) == 0;
}

// index of D in the codebook tables (D = 32 << index), -1 when not served
inline int head_dim_index(int64_t D) {
    for (int i = 0; i < DELTASPEC_TQ_N_HEAD_DIMS; ++i) {
        if (D == (int64_t)32 << i) return i;
    }
    return -1;
}

inline size_t head_bytes(int bits, int64_t D) { return 2 + (size_t)D * bits / 8; }

// 1/sqrt(D) as the float both backends multiply by
inline float inv_sqrt_dim(int64_t D) {
    static const float table[DELTASPEC_TQ_N_HEAD_DIMS] = {0.17677669529663687f, 0.125f, 0.08838834764831845f, 0.0625f};
    return table[head_dim_index(D)];
}

inline bool negated(int64_t i) { return (deltaspec_tq_signs[i / 64] >> (i % 64)) & 1; }

inline void fwht(float * y, int64_t D) {
    for (int64_t h = 1; h < D; h *= 2) {
        for (int64_t i = 0; i < D; i += 2 * h) {
            for (int64_t j = i; j < i + h; ++j) {
                const float a = y[j], b = y[j + h];
                y[j] = a + b;
                y[j + h] = a - b;
            }
        }
    }
}

// y = R x = H S x / sqrt(D), in place
inline void rotate(float * y, int64_t D) {
    if (planted("no_rotation")) return;
    for (int64_t i = 0; i < D; ++i) {
        if (negated(i)) y[i] = -y[i];
    }
    fwht(y, D);
    const float s = inv_sqrt_dim(D);
    for (int64_t i = 0; i < D; ++i) y[i] = y[i] * s;
}

// x = R^T y = S H y / sqrt(D) (H is symmetric), in place
inline void unrotate(float * y, int64_t D) {
    if (planted("no_rotation")) return;
    fwht(y, D);
    const float s = inv_sqrt_dim(D);
    for (int64_t i = 0; i < D; ++i) {
        y[i] = y[i] * s;
        if (negated(i)) y[i] = -y[i];
    }
}

// The codebook (centroids ascending) and its thresholds for D at `bits`.
struct Codebook {
    const float * c;
    const float * mid;
    int n;
};

inline Codebook codebook(int bits, int64_t D) {
    const int d = head_dim_index(D);
    if (planted("uniform_codebook")) {  // evenly spaced levels over the same range, for the tests
        static float c[2][16], mid[2][15];
        const int n = 1 << bits, k = bits - 3;
        const float * lm = bits == 3 ? deltaspec_tq3_centroids[d] : deltaspec_tq4_centroids[d];
        for (int i = 0; i < n; ++i) c[k][i] = lm[0] + (lm[n - 1] - lm[0]) * (float)i / (float)(n - 1);
        for (int i = 0; i + 1 < n; ++i) mid[k][i] = 0.5f * (c[k][i] + c[k][i + 1]);
        return {c[k], mid[k], n};
    }
    if (bits == 3) return {deltaspec_tq3_centroids[d], deltaspec_tq3_thresholds[d], 8};
    return {deltaspec_tq4_centroids[d], deltaspec_tq4_thresholds[d], 16};
}

// the warp's butterfly reduction of 32 lane partials: every lane ends with the same sum
inline float lane_reduce(float * p) {
    for (int off = kLanes / 2; off > 0; off /= 2) {
        float next[kLanes];
        for (int l = 0; l < kLanes; ++l) next[l] = p[l] + p[l ^ off];
        std::memcpy(p, next, sizeof(next));
    }
    return p[0];
}

inline void pack(int bits, int64_t D, const uint8_t * idx, uint8_t * out) {
    uint8_t * qs = out + 2;
    if (bits == 3) {
        uint8_t * qh = qs + D / 4;
        for (int64_t j = 0; j < D / 4; ++j) {
            qs[j] = (uint8_t)((idx[4 * j] & 3) | (idx[4 * j + 1] & 3) << 2 | (idx[4 * j + 2] & 3) << 4 |
                              (idx[4 * j + 3] & 3) << 6);
        }
        for (int64_t j = 0; j < D / 8; ++j) {
            uint8_t b = 0;
            for (int k = 0; k < 8; ++k) b |= (uint8_t)((idx[8 * j + k] >> 2) << k);
            qh[j] = b;
        }
    } else {
        for (int64_t j = 0; j < D / 2; ++j) qs[j] = (uint8_t)(idx[2 * j] | idx[2 * j + 1] << 4);
    }
}

inline int index_at(int bits, int64_t D, const uint8_t * in, int64_t i) {
    const uint8_t * qs = in + 2;
    if (bits == 3) return (qs[i / 4] >> (2 * (i % 4)) & 3) | ((qs[D / 4 + i / 8] >> (i % 8)) & 1) << 2;
    return qs[i / 2] >> (4 * (i % 2)) & 15;
}

// one head vector x (D floats) -> head_bytes(bits, D) bytes at out
inline void quantize_head(int bits, int64_t D, const float * x, uint8_t * out) {
    float y[kMaxHeadDim];
    std::memcpy(y, x, D * sizeof(float));
    rotate(y, D);
    const Codebook cb = codebook(bits, D);
    const int64_t per_lane = D / kLanes;
    float p[kLanes];
    for (int l = 0; l < kLanes; ++l) {
        float s = 0.0f;
        for (int64_t k = 0; k < per_lane; ++k) s = std::fmaf(y[l * per_lane + k], y[l * per_lane + k], s);
        p[l] = s;
    }
    const float sigma = std::sqrt(lane_reduce(p) * (1.0f / (float)D));
    float th[15];
    for (int k = 0; k + 1 < cb.n; ++k) th[k] = sigma * cb.mid[k];
    uint8_t idx[kMaxHeadDim];
    for (int64_t i = 0; i < D; ++i) {
        int n = 0;
        for (int k = 0; k + 1 < cb.n; ++k) n += y[i] > th[k];
        idx[i] = (uint8_t)n;
    }
    float num[kLanes], den[kLanes];
    for (int l = 0; l < kLanes; ++l) {
        float a = 0.0f, b = 0.0f;
        for (int64_t k = 0; k < per_lane; ++k) {
            const int64_t i = l * per_lane + k;
            const float c = cb.c[idx[i]];
            a = std::fmaf(y[i], c, a);
            b = std::fmaf(c, c, b);
        }
        num[l] = a;
        den[l] = b;
    }
    const float nu = lane_reduce(num), de = lane_reduce(den);
    const float d = de > 0.0f ? nu / de : 0.0f;
    const ggml_fp16_t h = ggml_fp32_to_fp16(d);
    std::memcpy(out, &h, 2);
    pack(bits, D, idx, out);
}

// head_bytes(bits, D) bytes -> D floats of the rotated vector
inline void dequantize_head_rotated(int bits, int64_t D, const uint8_t * in, float * y) {
    ggml_fp16_t h;
    std::memcpy(&h, in, 2);
    const float d = ggml_fp16_to_fp32(h);
    const Codebook cb = codebook(bits, D);
    for (int64_t i = 0; i < D; ++i) y[i] = d * cb.c[index_at(bits, D, in, i)];
}

}  // namespace deltaspec_tq
