// The rows recurrence on the CPU (deltaspec_rows.h), compiled into ggml-cpu (ggml/cpu/inject.cmake),
// whose ggml-cpu.c calls the two dispatchers below in place of ggml_compute_forward_gated_delta_net
// and ggml_compute_forward_ssm_conv (the conv: deltaspec_rows_conv_cpu.cpp). Being part of ggml-cpu,
// this file is built with its flags and calls the same vector helpers (vec.h) in the same order as
// ggml's ops.cpp does for one sequence: that is what makes a chain's results ggml's bits.
#include "deltaspec_rows.h"
#include "ggml-cpu-impl.h"
#include "ops.h"
#include "rows_cpu.h"
#include "vec.h"

#include <cmath>
#include <cstring>

using namespace deltaspec_rows_cpu;

namespace {

// One (head, walk) of the recurrence: the walk's rows in order, one working state `s` (S*S floats,
// transposed as ggml stores it) carried from row to row, reloaded where a row does not continue the
// row before it. delta: S floats of scratch.
void walk_head(const ggml_tensor * dst, int64_t head, int64_t begin, int64_t end, float * delta, float * s) {
    const ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *g = dst->src[3], *beta = dst->src[4];
    const ggml_tensor * pool_t = dst->src[5];
    const int32_t * rows = rows_of(dst, 6);
    const int64_t S = v->ne[0], H = v->ne[1], R = v->ne[2], Hk = q->ne[1];
    const int64_t state_size = S * S, head_state = head * state_size, all_heads = H * state_size;
    float * pool = (float *)pool_t->data;
    float * y = (float *)dst->data;
    float * saved = y + R * S * H;
    const float scale = 1.0f / sqrtf((float)S);
    // q/k heads tile the value heads (planted: the interleaved mapping instead)
    const int64_t qk_head = planted("gqa_interleaved") ? head / (H / Hk) : head % Hk;
    const bool plain_dot = planted("plain_dot");  // planted: a dot product in another order
    const bool bug_continue = planted("continue"), bug_slot0 = planted("slot0");
    const bool bug_no_write_back = planted("no_write_back");

    for (int64_t pos = begin; pos < end; ++pos) {
        const int64_t r = entry(rows, pos, DELTASPEC_ROWS_ORDER);
        const int32_t start = entry(rows, pos, DELTASPEC_ROWS_START);
        const int32_t slot = entry(rows, r, DELTASPEC_ROWS_SLOT);
        if (start == -2) {
            const int64_t from = bug_slot0 ? 0 : slot;  // planted: every root reads slot 0
            memcpy(s, pool + from * all_heads + head_state, state_size * sizeof(float));
        } else if (start >= 0 && !bug_continue) {  // planted: a branch continues its sibling's state
            memcpy(s, saved + start * all_heads + head_state, state_size * sizeof(float));
        }
        const float * q_d = (const float *)((const char *)q->data + r * q->nb[2] + qk_head * q->nb[1]);
        const float * k_d = (const float *)((const char *)k->data + r * k->nb[2] + qk_head * k->nb[1]);
        const float * v_d = (const float *)((const char *)v->data + r * v->nb[2] + head * v->nb[1]);
        const float g_val = *(const float *)((const char *)g->data + r * g->nb[2] + head * g->nb[1]);
        const float beta_val = *(const float *)((const char *)beta->data + r * beta->nb[2] + head * beta->nb[1]);

        // ggml's order (ops.cpp, one token of a sequence): decay, delta = (v - S^T k) * beta, the
        // rank-1 update, then y = S^T q * scale; s[j * S + i] is element (i, j) of the state
        ggml_vec_scale_f32((int)state_size, s, expf(g_val));
        for (int64_t j = 0; j < S; ++j) {
            float sum = 0.0f;
            if (plain_dot) {
                for (int64_t i = 0; i < S; ++i) sum += s[j * S + i] * k_d[i];
            } else {
                ggml_vec_dot_f32((int)S, &sum, 0, s + j * S, 0, k_d, 0, 1);
            }
            delta[j] = (v_d[j] - sum) * beta_val;
        }
        for (int64_t j = 0; j < S; ++j) ggml_vec_mad_f32((int)S, s + j * S, k_d, delta[j]);
        float * y_row = y + (r * H + head) * S;
        for (int64_t j = 0; j < S; ++j) {
            float sum = 0.0f;
            ggml_vec_dot_f32((int)S, &sum, 0, s + j * S, 0, q_d, 0, 1);
            y_row[j] = sum * scale;
        }

        const int32_t saved_index = entry(rows, r, DELTASPEC_ROWS_SAVED);
        if (saved_index >= 0) memcpy(saved + saved_index * all_heads + head_state, s, state_size * sizeof(float));
        if ((entry(rows, r, DELTASPEC_ROWS_FLAGS) & DELTASPEC_ROW_WRITE_BACK) && !bug_no_write_back) {
            memcpy(pool + slot * all_heads + head_state, s, state_size * sizeof(float));
        }
    }
}

}  // namespace

namespace deltaspec_rows_cpu {

// Work items are (head, walk) pairs, which share nothing: each thread takes every nth.
void rows_gated_delta_net(const ggml_compute_params * params, ggml_tensor * dst) {
    const int32_t * rows = rows_of(dst, 6);
    const int64_t S = dst->src[2]->ne[0], H = dst->src[2]->ne[1];
    // the walks the node's bound lets the backends see (deltaspec_rows_walks_max: the CUDA grid's too)
    const int64_t n_walks = deltaspec_rows_count_walks(rows, deltaspec_rows_walks_max(dst));
    // ggml's planner gave each thread S + S*S floats (op_params[0] = 2), after a cache line
    const int64_t per_thread = S + S * S;
    float * delta = (float *)params->wdata + params->ith * per_thread + CACHE_LINE_SIZE_F32;
    float * s = delta + S;
    for (int64_t item = params->ith; item < H * n_walks; item += params->nth) {
        const int64_t walk = item / H, head = item % H;
        const int64_t begin = walk == 0 ? 0 : entry(rows, walk - 1, DELTASPEC_ROWS_WALK_END);
        walk_head(dst, head, begin, entry(rows, walk, DELTASPEC_ROWS_WALK_END), delta, s);
    }
}

}  // namespace deltaspec_rows_cpu

extern "C" {

// ggml-cpu.c calls these in place of ggml's (inject.cmake renames its calls).
void deltaspec_cpu_gated_delta_net(const ggml_compute_params * params, ggml_tensor * dst) {
    if (deltaspec_is_rows_node(dst)) {
        rows_gated_delta_net(params, dst);
    } else {
        ggml_compute_forward_gated_delta_net(params, dst);
    }
}

void deltaspec_cpu_ssm_conv(const ggml_compute_params * params, ggml_tensor * dst) {
    if (deltaspec_is_rows_node(dst)) {
        rows_ssm_conv(params, dst);
    } else {
        ggml_compute_forward_ssm_conv(params, dst);
    }
}

// Its presence tells deltaspec_rows_cpu_available() that this ggml-cpu carries the ops.
__attribute__((visibility("default"))) int deltaspec_rows_cpu_marker(void) { return 1; }

}  // extern "C"
