// The host side of the top node (deltaspec_top.h): the builder. Its compute lives in ggml-cpu
// (ggml/cpu/deltaspec_top_cpu.cpp) and ggml-cuda (ggml/cuda/deltaspec_top.cu).
#include "deltaspec_top.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace {

int read_top_bug() {
    const char * env = std::getenv("DELTASPEC_TEST_TOP_BUG");
    const std::string v = env ? env : "";
    if (v.empty()) return DELTASPEC_TOP_BUG_NONE;
    if (v == "no_lse") return DELTASPEC_TOP_BUG_NO_LSE;
    if (v == "k_minus_1") return DELTASPEC_TOP_BUG_K_MINUS_1;
    throw std::invalid_argument("DELTASPEC_TEST_TOP_BUG (test only) must be unset, 'no_lse' or 'k_minus_1', not '" +
                                v + "'");
}

}  // namespace

struct ggml_tensor * deltaspec_top_rows(struct ggml_context * ctx, struct ggml_tensor * logits, int k) {
    // read once per process: the tests plant it for a whole run
    static const int bug = read_top_bug();
    if (logits->type != GGML_TYPE_F32 || logits->nb[0] != sizeof(float) || logits->nb[1] != logits->ne[0] * sizeof(float)) {
        throw std::invalid_argument("deltaspec_top_rows: the logits must be F32 rows stored contiguously");
    }
    if (k < 1 || k > logits->ne[0] || k > DELTASPEC_TOP_K_MAX) {
        throw std::invalid_argument("deltaspec_top_rows: k = " + std::to_string(k) + " outside [1, min(n_vocab = " +
                                    std::to_string(logits->ne[0]) + ", " + std::to_string(DELTASPEC_TOP_K_MAX) + ")]");
    }
    ggml_tensor * t = ggml_new_tensor_4d(ctx, GGML_TYPE_I32, 2 * (int64_t)k + 1, logits->ne[1], logits->ne[2], logits->ne[3]);
    t->op = GGML_OP_TOP_K;
    t->src[0] = logits;
    const int32_t params[3] = {0, DELTASPEC_TOP_MAGIC, bug};
    std::memcpy(t->op_params, params, sizeof(params));
    return t;
}

struct ggml_tensor * deltaspec_top_rows_allowed(struct ggml_context * ctx, struct ggml_tensor * logits, int k,
                                                struct ggml_tensor * allowed) {
    ggml_tensor * t = deltaspec_top_rows(ctx, logits, k);
    const int64_t n_words = (logits->ne[0] + 31) / 32;
    if (allowed->type != GGML_TYPE_I32 || !ggml_is_contiguous(allowed) || allowed->ne[0] != n_words ||
        ggml_nrows(allowed) != ggml_nrows(logits)) {
        throw std::invalid_argument("deltaspec_top_rows_allowed: the mask must be I32 {" + std::to_string(n_words) +
                                    ", " + std::to_string(ggml_nrows(logits)) + "}, contiguous (one bit per token of "
                                    "each logits row)");
    }
    t->src[1] = allowed;
    return t;
}
