// The top node's CPU compute (ggml/deltaspec_top.h), inside ggml-cpu: rows split over the threads,
// each row's ids partially sorted by (logit descending, id ascending; a token the node's mask
// forbids counts as -inf) in the work buffer ggml's planner sized for a TOP_K node, and its
// log-sum-exp from ggml's vectorized softmax sum (float exponentials summed in double; that buffer
// holds them first), so that a sampled token costs a vectorized pass over the vocabulary rather
// than one double exp() per token.
#include "deltaspec_top.h"
#include "ggml-cpu-impl.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

void top_rows(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * src = dst->src[0];
    const ggml_tensor * allowed = dst->src[1];  // a grammar's mask, or none
    const int64_t n = src->ne[0], n_rows = ggml_nrows(src);
    const int k = deltaspec_top_k_of(dst);
    const int bug = ggml_get_op_params_i32(dst, 2);
    // the slice ggml's own top_k takes from the same work buffer
    int32_t * ids = (int32_t *)params->wdata + (n + CACHE_LINE_SIZE_F32) * params->ith;
    for (int64_t r = params->ith; r < n_rows; r += params->nth) {
        const float * x = (const float *)((const char *)src->data + r * src->nb[1]);
        const int32_t * bits = allowed ? (const int32_t *)((const char *)allowed->data + r * allowed->nb[1]) : nullptr;
        // a forbidden token's logit is -inf (the value the host's mask gives it)
        const auto value = [x, bits](int64_t j) { return deltaspec_top_allows(bits, j) ? x[j] : -INFINITY; };
        float max_x = -INFINITY;
        if (bits) {
            for (int64_t j = 0; j < n; ++j) max_x = std::max(max_x, value(j));
        } else {
            ggml_vec_max_f32((int)n, &max_x, x);
        }
        // exp(x - max) into the buffer as floats (it is n words either way), before the ids go there;
        // a masked row is written there first, its exponentials then computed in place
        float * exps = (float *)ids;
        if (bits && std::isfinite(max_x)) {
            for (int64_t j = 0; j < n; ++j) exps[j] = value(j);
        }
        const ggml_float sum = std::isfinite(max_x) ? ggml_vec_soft_max_f32((int)n, exps, bits ? exps : x, max_x) : 0.0;
        const float lse = bug == DELTASPEC_TOP_BUG_NO_LSE || !std::isfinite(max_x) ? max_x
                                                                                    : (float)(max_x + std::log(sum));
        for (int64_t j = 0; j < n; ++j) ids[j] = (int32_t)j;
        const int sorted = bug == DELTASPEC_TOP_BUG_K_MINUS_1 ? k - 1 : k;
        if (bits) {
            std::partial_sort(ids, ids + sorted, ids + n, [&value](int32_t a, int32_t b) {
                const float va = value(a), vb = value(b);
                return va > vb || (va == vb && a < b);
            });
        } else {
            std::partial_sort(ids, ids + sorted, ids + n,
                              [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
        }
        int32_t * out = (int32_t *)((char *)dst->data + r * dst->nb[1]);
        for (int j = 0; j < k; ++j) {
            const float v = value(ids[j]);
            std::memcpy(out + j, &v, sizeof(float));
            out[k + j] = ids[j];
        }
        std::memcpy(out + 2 * k, &lse, sizeof(float));
    }
}

}  // namespace

// ggml-cpu.c's call of ggml_compute_forward_top_k, renamed (inject.cmake): our node to top_rows,
// every other TOP_K node to ggml's
extern "C" void deltaspec_cpu_top_k(const ggml_compute_params * params, ggml_tensor * dst) {
    if (deltaspec_is_top_node(dst)) {
        top_rows(params, dst);
    } else {
        ggml_compute_forward_top_k(params, dst);
    }
}
