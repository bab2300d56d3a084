// deltaspec_top: each logits row reduced on the device to what sampling and log-probabilities need
// when the sampler's chain starts with a small top-k: the row's k largest logits with their token
// ids, in order, and the row's log-sum-exp. So k + k + 1 words cross to the host instead of a
// vocabulary of floats (248K on Qwen3.5), and log_softmax of any of those k tokens is exact
// (logit - lse).
//
// Result: I32 {2k + 1, R} for logits F32 {n_vocab, R} (rows contiguous), per row
//   [0, k)     the k largest logits (F32 bits), largest first; ties go to the lower id first, as a
//              sort by (logit descending, id ascending) of the whole row would order them, so the
//              first j entries are exactly the row's top j for every j <= k
//   [k, 2k)    their token ids
//   [2k]       log(sum(exp(row))) (F32 bits; computed in double on the CPU, float on CUDA)
//
// How it reaches both backends without a changed upstream file (as the rows ops, deltaspec_rows.h):
// the node is a GGML_OP_TOP_K node (ggml-cuda accepts that type for any row length when it uses CUB)
// with DELTASPEC_TOP_MAGIC in op_params[1]; ggml-cpu.c's ggml_compute_forward_top_k and ggml-cuda.cu's
// ggml_cuda_op_top_k are renamed at build time to our dispatchers (ggml/cpu/deltaspec_top_cpu.cpp,
// ggml/cuda/deltaspec_top.cu), which run our node and hand every other TOP_K node to ggml's own
// function. ggml's CPU planner gives a TOP_K node a work buffer of one int32 per column per thread,
// which our CPU side uses as ggml's does (the row's ids, partially sorted).
//
// Why not ggml_top_k + ggml_get_rows + a softmax: ggml's top_k returns ids in no particular order
// with no tie rule (its CUDA form either sorts the whole row with CUB or, with CCCL >= 3.2, runs one
// DeviceTopK launch per row), and ggml has no row max to make a stable log-sum-exp from.
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DELTASPEC_TOP_MAGIC 0x70544453  // "DSTp": op_params[1] of a top node
#define DELTASPEC_TOP_K_MAX 256         // the CUDA kernel keeps the k candidates in shared memory

// op_params[2]: a planted bug (test only, CPU side; deltaspec_top_rows reads it from the environment)
enum deltaspec_top_bug {
    DELTASPEC_TOP_BUG_NONE = 0,
    DELTASPEC_TOP_BUG_NO_LSE = 1,     // the row's max written where its log-sum-exp belongs
    DELTASPEC_TOP_BUG_K_MINUS_1 = 2,  // only the first k-1 candidates are the row's top; the last is any other
};

// The node above for logits F32 {n_vocab, R}, 1 <= k <= min(n_vocab, DELTASPEC_TOP_K_MAX).
// DELTASPEC_TEST_TOP_BUG ("no_lse", "k_minus_1"; unset: none) plants a bug into every node built.
struct ggml_tensor * deltaspec_top_rows(struct ggml_context * ctx, struct ggml_tensor * logits, int k);

// The same node over rows a grammar masks (src[1]): allowed I32 {ceil(n_vocab / 32), R}, token t of
// row r allowed where bit t % 32 of word t / 32 of row r is set. A token not allowed counts as a logit
// of -inf, in the top k and in the log-sum-exp alike: the row reduced exactly as the host reduces a row
// that TokenConstraint::mask_row masked (forbidden logits set to -inf), so a grammar's masked rows
// need not cross to the host whole. A row with fewer than k allowed tokens has -inf candidates after
// them, the lowest forbidden ids first (the sort's tie rule).
struct ggml_tensor * deltaspec_top_rows_allowed(struct ggml_context * ctx, struct ggml_tensor * logits, int k,
                                                struct ggml_tensor * allowed);

static inline bool deltaspec_top_allows(const int32_t * allowed_row, int64_t token) {
    return allowed_row == NULL || ((uint32_t)allowed_row[token >> 5] >> (token & 31)) & 1u;
}

static inline bool deltaspec_is_top_node(const struct ggml_tensor * t) {
    int32_t magic;
    memcpy(&magic, (const char *)t->op_params + sizeof(int32_t), sizeof(magic));
    return t->op == GGML_OP_TOP_K && magic == DELTASPEC_TOP_MAGIC;
}

static inline int deltaspec_top_k_of(const struct ggml_tensor * t) { return (int)((t->ne[0] - 1) / 2); }

#ifdef __cplusplus
}
#endif
