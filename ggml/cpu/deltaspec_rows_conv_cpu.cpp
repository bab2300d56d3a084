// The rows conv on the CPU (deltaspec_rows.h), inside ggml-cpu (ggml/cpu/inject.cmake).
#include "ops.h"
#include "rows_cpu.h"

#include <utility>

namespace deltaspec_rows_cpu {

// Each thread takes the channels ggml's ssm_conv would give it (the same split), and runs every row
// of the batch through them: it gathers the row's window and input into sx (Kc floats a channel,
// oldest first), then hands ggml's own ssm_conv a one-token tensor over sx. So every output is
// computed by ggml's compiled loop over the same channel range, which is what makes the bits
// ggml's for any Kc: that loop's code (vectorized across channels, fused multiply-adds or not) is
// GCC's choice and differs between kernel sizes (Kc = 3 came out fused here, Kc = 4 not).
// Write-backs come after every row of the range has read the pool.
void rows_ssm_conv(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor *pool_t = dst->src[0], *c_t = dst->src[1], *x_t = dst->src[2];
    const int32_t * rows = rows_of(dst, 3);
    const int64_t Kc = c_t->ne[0], C = c_t->ne[1], R = x_t->ne[1], W = Kc - 1;
    float * pool = (float *)pool_t->data;
    const int64_t per_thread = (C + params->nth - 1) / params->nth;
    const int64_t c0 = params->ith * per_thread, c1 = c0 + per_thread < C ? c0 + per_thread : C;
    if (c0 >= c1) return;
    const int64_t n_ch = c1 - c0;
    const bool bug_short_window = planted("short_window"), bug_conv_order = planted("conv_order");
    const bool bug_no_write_back = planted("no_write_back");

    int64_t anc[DELTASPEC_ROWS_MAX_KC];  // a row's newest ancestors, oldest first: anc[W-m .. W-1]
    auto ancestors = [&](int64_t r) {
        int64_t m = 0;
        for (int64_t a = entry(rows, r, DELTASPEC_ROWS_PARENT); a >= 0 && m < W;
             a = entry(rows, a, DELTASPEC_ROWS_PARENT)) {
            anc[W - 1 - m++] = a;
            if (bug_short_window) break;  // planted: only the parent, then the pool
        }
        return m;
    };
    auto x_at = [&](int64_t r) { return (const float *)((const char *)x_t->data + r * x_t->nb[1]); };
    // sx[ch * Kc + j], ch of this thread's range: row r's window (j < W) and input (j = W)
    float * sx = (float *)malloc(n_ch * Kc * sizeof(float));
    GGML_ASSERT(sx != nullptr && "deltaspec_rows_ssm_conv: no memory for a window");
    auto gather = [&](int64_t r) {
        const int64_t m = ancestors(r), slot = entry(rows, r, DELTASPEC_ROWS_SLOT);
        for (int64_t j = 0; j < W; ++j) {
            if (j >= W - m) {
                const float * x_a = x_at(anc[j]);
                for (int64_t ch = c0; ch < c1; ++ch) sx[(ch - c0) * Kc + j] = x_a[ch];
            } else {  // the slot's window, shifted by the m ancestors found
                for (int64_t ch = c0; ch < c1; ++ch) sx[(ch - c0) * Kc + j] = pool[(slot * C + ch) * W + j + m];
            }
        }
        const float * x_r = x_at(r);
        for (int64_t ch = c0; ch < c1; ++ch) sx[(ch - c0) * Kc + W] = x_r[ch];
        if (bug_conv_order) {  // planted: the window's two oldest inputs swapped
            for (int64_t ch = 0; ch < n_ch; ++ch) std::swap(sx[ch * Kc], sx[ch * Kc + 1]);
        }
    };

    // ggml_ssm_conv's operands for one token of this range: sx {Kc, n_ch, 1}, c {Kc, n_ch}, y {n_ch, 1, 1}
    ggml_tensor sx_t = *x_t, w_t = *c_t, y_t = *dst;
    sx_t.ne[0] = Kc, sx_t.ne[1] = n_ch, sx_t.ne[2] = 1, sx_t.ne[3] = 1;
    sx_t.nb[0] = sizeof(float), sx_t.nb[1] = Kc * sizeof(float), sx_t.nb[2] = sx_t.nb[3] = n_ch * sx_t.nb[1];
    sx_t.data = sx;
    w_t.ne[1] = n_ch;
    w_t.data = (char *)c_t->data + c0 * c_t->nb[1];
    y_t.ne[0] = n_ch, y_t.ne[1] = 1, y_t.ne[2] = 1;
    y_t.src[0] = &sx_t, y_t.src[1] = &w_t;
    ggml_compute_params one = *params;
    one.ith = 0, one.nth = 1;  // the range is this thread's already
    for (int64_t r = 0; r < R; ++r) {
        if (entry(rows, r, DELTASPEC_ROWS_SLOT) < 0) continue;
        gather(r);
        y_t.data = (char *)dst->data + r * dst->nb[1] + c0 * dst->nb[0];
        ggml_compute_forward_ssm_conv(&one, &y_t);
    }
    for (int64_t r = 0; r < R; ++r) {
        const int64_t slot = entry(rows, r, DELTASPEC_ROWS_SLOT);
        if (slot < 0 || !(entry(rows, r, DELTASPEC_ROWS_FLAGS) & DELTASPEC_ROW_WRITE_BACK)) continue;
        if (bug_no_write_back) continue;
        gather(r);  // the window after r: the last W of (window, input)
        for (int64_t ch = c0; ch < c1; ++ch) {
            for (int64_t j = 0; j < W; ++j) pool[(slot * C + ch) * W + j] = sx[(ch - c0) * Kc + j + 1];
        }
    }
    free(sx);
}

}  // namespace deltaspec_rows_cpu
