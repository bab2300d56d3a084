// The tq cache nodes on the CPU (ggml/deltaspec_tq.h), compiled into ggml-cpu (ggml/cpu/inject.cmake),
// whose ggml-cpu.c calls the dispatchers below in place of ggml_compute_forward_set_rows and
// ggml_compute_forward_flash_attn_ext: our nodes are computed here, every other node by ggml.
#include "deltaspec_tq.h"
#include "deltaspec_tq_codec.h"
#include "ggml-cpu-impl.h"
#include "ggml-cpu.h"
#include "ops.h"
#include "simd-mappings.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using namespace deltaspec_tq;

// cache rows idx[t] <- quantized x[:, t] (tq, or rotated then ggml's rounding); rows split over the threads
void tq_set_rows(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * x = dst->src[0];
    const ggml_tensor * idx = dst->src[1];
    const int format = dst->op_params[1];
    const int64_t D = dst->op_params[2];
    const int64_t n_heads = x->ne[0] / D, T = x->ne[1];
    const bool tq = format != DELTASPEC_KV_ROTATED;
    const size_t hb = tq ? head_bytes(format, D) : ggml_row_size(dst->type, D);
    float y[kMaxHeadDim];
    for (int64_t t = params->ith; t < T; t += params->nth) {
        const int64_t row = ((const int64_t *)idx->data)[t];
        GGML_ASSERT(row >= 0 && row < dst->ne[1]);
        const float * src = (const float *)((const char *)x->data + t * x->nb[1]);
        uint8_t * out = (uint8_t *)dst->data + row * dst->nb[1];
        for (int64_t h = 0; h < n_heads; ++h) {
            if (tq) {
                quantize_head(format, D, src + h * D, out + h * hb);
            } else {
                memcpy(y, src + h * D, D * sizeof(float));
                rotate(y, D);
                ggml_get_type_traits_cpu(dst->type)->from_float(y, out + h * hb, D);
            }
        }
    }
}

// One cached row of K or V as D floats: tq rows in the rotated domain, other types (rotated or not)
// through ggml's to_float.
void load_row(const ggml_tensor * t, int format, int64_t D, const char * row, float * out) {
    if (format == DELTASPEC_KV_TQ3 || format == DELTASPEC_KV_TQ4) {
        dequantize_head_rotated(format, D, (const uint8_t *)row, out);
    } else if (t->type == GGML_TYPE_F32) {
        memcpy(out, row, D * sizeof(float));
    } else {
        ggml_get_type_traits(t->type)->to_float(row, out, D);
    }
}

// q.k in 8 partial sums (D is a multiple of 32), a form the compiler vectorizes
float dot8(const float * a, const float * b, int64_t D) {
    float p[8] = {0};
    for (int64_t i = 0; i < D; i += 8) {
        for (int l = 0; l < 8; ++l) p[l] += a[i + l] * b[i + l];
    }
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

constexpr int64_t kQueryTile = 16;  // queries (of each head of a group) sharing one pass over the cache
constexpr int64_t kKvTile = 32;     // cached rows decoded at a time

// Attention in the rotated domain of whichever side is rotated (tq or a rotated ggml type). Work units are (stream, kv head, tile of
// queries): each decodes a KV row once for all the query heads of its group and the queries of its tile.
void tq_flash_attn(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *mask = dst->src[3];
    const int format_k = dst->op_params[DELTASPEC_TQ_FA_PARAM + 1], format_v = dst->op_params[DELTASPEC_TQ_FA_PARAM + 2];
    float scale;
    memcpy(&scale, dst->op_params, sizeof(float));
    const int64_t D = q->ne[0], T = q->ne[1], H = q->ne[2], N = q->ne[3];
    const int64_t n_kv = k->ne[1], Hkv = k->ne[2], G = H / Hkv;
    const int64_t n_tiles = (T + kQueryTile - 1) / kQueryTile, n_units = N * Hkv * n_tiles;

    std::vector<float> qr(kQueryTile * G * D), acc(kQueryTile * G * D), kbuf(kKvTile * D), vbuf(kKvTile * D);
    std::vector<float> m(kQueryTile * G), s(kQueryTile * G);
    for (int64_t unit = params->ith; unit < n_units; unit += params->nth) {
        const int64_t n = unit / (Hkv * n_tiles), hk = unit / n_tiles % Hkv, t0 = unit % n_tiles * kQueryTile;
        const int64_t nt = std::min(kQueryTile, T - t0), nq = nt * G;
        // query a = (t - t0) * G + g, of head hk * G + g
        for (int64_t a = 0; a < nq; ++a) {
            const int64_t t = t0 + a / G, h = hk * G + a % G;
            const float * src = (const float *)((const char *)q->data + t * q->nb[1] + h * q->nb[2] + n * q->nb[3]);
            memcpy(&qr[a * D], src, D * sizeof(float));
            if (format_k != DELTASPEC_KV_PLAIN) rotate(&qr[a * D], D);
            m[a] = -INFINITY;
            s[a] = 0.0f;
        }
        std::fill(acc.begin(), acc.begin() + nq * D, 0.0f);
        const char * kbase = (const char *)k->data + hk * k->nb[2] + n * k->nb[3];
        const char * vbase = (const char *)v->data + hk * v->nb[2] + n * v->nb[3];
        for (int64_t j0 = 0; j0 < n_kv; j0 += kKvTile) {
            const int64_t nj = std::min(kKvTile, n_kv - j0);
            bool any = false;  // skip tiles every query of the unit masks out (causal prefill)
            for (int64_t t = t0; t < t0 + nt && !any; ++t) {
                const ggml_fp16_t * mrow = (const ggml_fp16_t *)((const char *)mask->data + t * mask->nb[1] +
                                                                 (n % mask->ne[3]) * mask->nb[3]);
                for (int64_t j = j0; j < j0 + nj && !any; ++j) any = GGML_CPU_FP16_TO_FP32(mrow[j]) != -INFINITY;
            }
            if (!any) continue;
            for (int64_t j = 0; j < nj; ++j) {
                load_row(k, format_k, D, kbase + (j0 + j) * k->nb[1], &kbuf[j * D]);
                load_row(v, format_v, D, vbase + (j0 + j) * v->nb[1], &vbuf[j * D]);
            }
            for (int64_t a = 0; a < nq; ++a) {
                const int64_t t = t0 + a / G;
                const ggml_fp16_t * mrow = (const ggml_fp16_t *)((const char *)mask->data + t * mask->nb[1] +
                                                                 (n % mask->ne[3]) * mask->nb[3]);
                float * o = &acc[a * D];
                const float * qa = &qr[a * D];
                for (int64_t j = 0; j < nj; ++j) {
                    const float mv = GGML_CPU_FP16_TO_FP32(mrow[j0 + j]);
                    if (mv == -INFINITY) continue;
                    const float * kr = &kbuf[j * D];
                    const float dot = dot8(qa, kr, D);
                    const float sc = dot * scale + mv;
                    float w = 1.0f;
                    if (sc > m[a]) {
                        const float shrink = m[a] == -INFINITY ? 0.0f : expf(m[a] - sc);
                        for (int64_t i = 0; i < D; ++i) o[i] *= shrink;
                        s[a] *= shrink;
                        m[a] = sc;
                    } else {
                        w = expf(sc - m[a]);
                    }
                    const float * vr = &vbuf[j * D];
                    for (int64_t i = 0; i < D; ++i) o[i] += w * vr[i];
                    s[a] += w;
                }
            }
        }
        for (int64_t a = 0; a < nq; ++a) {
            const int64_t t = t0 + a / G, h = hk * G + a % G;
            float * o = &acc[a * D];
            const float inv = s[a] > 0.0f ? 1.0f / s[a] : 0.0f;
            for (int64_t i = 0; i < D; ++i) o[i] *= inv;
            if (format_v != DELTASPEC_KV_PLAIN && !planted("v_not_rotated_back")) unrotate(o, D);  // planted: left rotated
            memcpy((char *)dst->data + h * dst->nb[1] + t * dst->nb[2] + n * dst->nb[3], o, D * sizeof(float));
        }
    }
}

}  // namespace

extern "C" {

void deltaspec_cpu_set_rows(const ggml_compute_params * params, ggml_tensor * dst) {
    if (deltaspec_tq_is_set_rows(dst)) {
        tq_set_rows(params, dst);
    } else {
        ggml_compute_forward_set_rows(params, dst);
    }
}

void deltaspec_cpu_flash_attn_ext(const ggml_compute_params * params, ggml_tensor * dst) {
    if (deltaspec_tq_is_flash_attn(dst)) {
        tq_flash_attn(params, dst);
    } else {
        ggml_compute_forward_flash_attn_ext(params, dst);
    }
}

}  // extern "C"
