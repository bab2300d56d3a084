// The rows ops on the CPU (deltaspec_rows.h), compiled into ggml-cpu (ggml/cpu/inject.cmake), whose
// ggml-cpu.c calls the two dispatchers below in place of ggml_compute_forward_gated_delta_net and
// ggml_compute_forward_ssm_conv. Being part of ggml-cpu, this file is built with its flags and calls
// the same vector helpers (vec.h) in the same order as ggml's ops.cpp does for one sequence: that is
// what makes a chain's results ggml's bits.
#include "deltaspec_rows.h"
#include "ggml-cpu-impl.h"
#include "ops.h"
#include "vec.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace {

const int32_t * rows_of(const ggml_tensor * dst, int src) { return (const int32_t *)dst->src[src]->data; }

int32_t entry(const int32_t * rows, int64_t i, int e) { return rows[i * DELTASPEC_ROWS_N_COLS + e]; }

// The test-only planted bugs (tests/test_rows_op.py): DELTASPEC_TEST_ROWS_BUG names one. Read where
// a walk or a thread's share starts, not per value.
bool planted(const char * name) {
    const char * bug = std::getenv("DELTASPEC_TEST_ROWS_BUG");
    return bug != nullptr && std::strcmp(bug, name) == 0;
}

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

// Work items are (head, walk) pairs, which share nothing: each thread takes every nth.
void rows_gated_delta_net(const ggml_compute_params * params, ggml_tensor * dst) {
    const int32_t * rows = rows_of(dst, 6);
    const int64_t S = dst->src[2]->ne[0], H = dst->src[2]->ne[1], R = dst->src[2]->ne[2];
    int64_t n_walks = 0;
    while (n_walks < R && entry(rows, n_walks, DELTASPEC_ROWS_WALK_END) >= 0) ++n_walks;
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

// The conv: each thread takes a range of channels through every row. A row's window is gathered
// along its ancestors (anc: the newest Kc-1 of them, oldest first, m of them found), the rest from
// its slot's committed window. Write-backs come after every row of the range has read the pool.
void rows_ssm_conv(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor *pool_t = dst->src[0], *c_t = dst->src[1], *x_t = dst->src[2];
    const int32_t * rows = rows_of(dst, 3);
    const int64_t Kc = c_t->ne[0], C = c_t->ne[1], R = x_t->ne[1], W = Kc - 1;
    float * pool = (float *)pool_t->data;
    const float * w = (const float *)c_t->data;
    float * y = (float *)dst->data;
    const int64_t per_thread = (C + params->nth - 1) / params->nth;
    const int64_t c0 = params->ith * per_thread, c1 = c0 + per_thread < C ? c0 + per_thread : C;
    if (c0 >= c1) return;
    int64_t anc[DELTASPEC_ROWS_MAX_KC];
    const bool bug_short_window = planted("short_window"), bug_conv_order = planted("conv_order");
    const bool bug_no_write_back = planted("no_write_back");

    // the window entry j (0 = oldest) of row r, given its m ancestors anc[W-m..W-1]
    auto window = [&](int64_t r, int64_t m, int64_t j, int64_t ch) -> float {
        if (j >= W - m) return ((const float *)((const char *)x_t->data + anc[j] * x_t->nb[1]))[ch];
        const int64_t slot = entry(rows, r, DELTASPEC_ROWS_SLOT);
        return pool[(slot * C + ch) * W + j + m];
    };
    auto ancestors = [&](int64_t r) {
        int64_t m = 0;
        for (int64_t a = entry(rows, r, DELTASPEC_ROWS_PARENT); a >= 0 && m < W;
             a = entry(rows, a, DELTASPEC_ROWS_PARENT)) {
            anc[W - 1 - m++] = a;
            if (bug_short_window) break;  // planted: only the parent, then the pool
        }
        return m;
    };

    for (int64_t r = 0; r < R; ++r) {
        if (entry(rows, r, DELTASPEC_ROWS_SLOT) < 0) continue;
        const int64_t m = ancestors(r);
        const float * x_r = (const float *)((const char *)x_t->data + r * x_t->nb[1]);
        float * y_r = y + r * C;
        for (int64_t ch = c0; ch < c1; ++ch) {
            // ggml's ssm_conv order: oldest input first, one float sum
            const float * w_ch = w + ch * Kc;
            float sumf = 0.0f;
            if (bug_conv_order) {  // planted: newest input first (other bits)
                sumf += x_r[ch] * w_ch[W];
                for (int64_t j = W - 1; j >= 0; --j) sumf += window(r, m, j, ch) * w_ch[j];
            } else {
                for (int64_t j = 0; j < W; ++j) sumf += window(r, m, j, ch) * w_ch[j];
                sumf += x_r[ch] * w_ch[W];
            }
            y_r[ch] = sumf;
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        const int64_t slot = entry(rows, r, DELTASPEC_ROWS_SLOT);
        if (slot < 0 || !(entry(rows, r, DELTASPEC_ROWS_FLAGS) & DELTASPEC_ROW_WRITE_BACK)) continue;
        if (bug_no_write_back) continue;
        const int64_t m = ancestors(r);
        const float * x_r = (const float *)((const char *)x_t->data + r * x_t->nb[1]);
        for (int64_t ch = c0; ch < c1; ++ch) {
            // the window after r: its own window shifted by one, then x_r
            float * dst_w = pool + (slot * C + ch) * W;
            float next[DELTASPEC_ROWS_MAX_KC];
            for (int64_t j = 0; j + 1 < W; ++j) next[j] = window(r, m, j + 1, ch);
            for (int64_t j = 0; j + 1 < W; ++j) dst_w[j] = next[j];
            dst_w[W - 1] = x_r[ch];
        }
    }
}

}  // namespace

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
