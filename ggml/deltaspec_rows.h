// deltaspec_rows: the Gated DeltaNet recurrence and its short causal conv over a batch of ROWS, where
// each row starts from its parent row's state. Chains (one sequence's prefill or verify batch), trees
// (tree verification) and rows of different sequences (decoding N sequences) are all one op.
//
// A batch holds R rows. Row r has
//   parent[r]  an earlier row of the batch (0 <= parent[r] < r) or -1,
//   slot[r]    an index into a pool of committed recurrent states (one per sequence slot); -1 skips
//              the row (it computes nothing and writes nothing: padding, or rows left out of a replay),
//   flags[r]   DELTASPEC_ROW_* bits.
// Row r's recurrence starts from the state after row parent[r] if parent[r] >= 0, otherwise from
// pool[slot[r]]; a row and its parent share a slot. Its conv window (the Kc-1 inputs before it) is
// gathered along its ancestors, newest first, and falls back to the slot's committed window when the
// ancestors run out. So every root-to-leaf path of a tree computes what that path computes as a chain,
// and rows of different slots compute what each sequence computes alone.
//
// Bits: on the CPU, a chain (parent = r-1, one slot) gives ggml_gated_delta_net's and ggml_ssm_conv's
// results bitwise (the same arithmetic in the same order), and every path of a tree gives its chain's.
// On CUDA the recurrence uses the arithmetic of deltaspec's verify kernel (ggml/cuda/deltaspec_deltanet.cu),
// so a chain gives that kernel's bits, and a tree path its chain's.
//
// Committing. The pools are read, never written, unless a row asks for it (the write goes to the
// pool tensor's own memory: keep the pools in a persistent buffer of the backend that runs the node,
// so that no scheduler copy of them takes the write instead):
//   DELTASPEC_ROW_WRITE_BACK  the DeltaNet state and the conv window after this row are stored to
//                             pool[slot[r]]. At most one row per slot, and it must be that slot's last
//                             row in the batch (so every row of the slot has read the pool before).
//   DELTASPEC_ROW_KEEP_STATE  the DeltaNet state after this row is kept in the op's result, at
//                             saved index rows[DELTASPEC_ROWS_SAVED, r] (the conv window of any row
//                             can be gathered again from the conv's inputs, so it has no such flag).
// What the engine does with them:
//   decode of N sequences     R = N roots (parent -1), each with its slot and WRITE_BACK;
//   prefill chunk             a chain, its last row WRITE_BACK;
//   verify (chain or tree)    no WRITE_BACK; then either
//     (a) replay: the same ops again over the verify batch's inputs, with the rows off the accepted
//         path skipped (slot -1) and the accepted leaf WRITE_BACK: a chain's cost, nothing stored
//         per row; or
//     (b) keep: KEEP_STATE on every row in the verify, then copy the accepted row's saved state into
//         the pool and run the conv op once more as in (a) (cheap: Kc-1 gathers per channel).
//
// How the ops reach both backends without a changed upstream file: each op is a node of an existing
// ggml op type, GGML_OP_GATED_DELTA_NET or GGML_OP_SSM_CONV, carrying one more source (the rows
// tensor) and DELTASPEC_ROWS_MAGIC in op_params[1]. ggml's scheduler places it like any node of that
// type (ggml-cuda accepts both types; its SSM_CONV wants C % 128 == 0). The backends' entry points for
// those types are renamed at build time to deltaspec's dispatchers, which run these ops for our nodes
// and hand every other node to ggml's own function: ggml-cpu.c's ggml_compute_forward_gated_delta_net
// and ggml_compute_forward_ssm_conv (ggml/cpu/inject.cmake, ggml/cpu/deltaspec_rows_cpu.cpp) and
// ggml-cuda's ggml_cuda_op_gated_delta_net and ggml_cuda_op_ssm_conv (ggml/cuda/inject.cmake,
// ggml/cuda/deltaspec_rows.cu). GGML_OP_CUSTOM was not used because ggml-cuda refuses it: the
// scheduler would then run the recurrence on the CPU and copy its inputs there every layer.
// ggml's CPU planner sizes the recurrence's work buffer from op_params[0] (ggml's K): our node sets it
// to 2, which gives each thread the S_v + S_v*S_v floats of one working state.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DELTASPEC_ROWS_MAGIC 0x77524453  // "DSRw": op_params[1] of a rows node
#define DELTASPEC_ROWS_MAX 65536         // rows per batch (the plan's indices fit in int32 with room)
#define DELTASPEC_ROWS_MAX_KC 16         // the conv's kernel size Kc: 2 .. this (qwen35: 4)

enum deltaspec_row_flag {
    DELTASPEC_ROW_WRITE_BACK = 1,
    DELTASPEC_ROW_KEEP_STATE = 2,
};

// The rows tensor: I32 [DELTASPEC_ROWS_N_COLS, P] (P >= R, the room for walk positions): entry e of
// index i at rows[i * DELTASPEC_ROWS_N_COLS + e], where i is a row (< R), a walk position or a walk
// (< P) as each entry below says.
// The caller writes PARENT, SLOT and FLAGS; deltaspec_rows_plan checks them and writes the rest,
// which is how both backends walk the batch:
//   a WALK is the rows of one slot in ascending order (a slot with no rows has none); walks are
//   numbered by their slot, ascending. POSITIONS number the rows of all walks, walk after walk.
//   A row continues in registers from the row walked before it when that row is its parent;
//   otherwise it starts from the pool (parent -1) or from its parent's saved state, which is why a
//   row whose child is not walked right after it is saved (SAVED >= 0). Depth-first order of a tree's
//   rows (first child right after its parent) keeps the saved states to the branch points.
//   A SPLIT walk (P > R, at most DELTASPEC_ROWS_EXTRA_WALKS per batch): a walk's rows run one after
//   another, so a tree of a long chain with side branches (DDTree's shape: 1 + 22 rows, 17 deep) costs
//   all its rows in sequence. Where room allows, the plan walks one slot as two walks that run at
//   the same time (CUDA: other thread blocks): its deepest root-to-leaf path, then every other row
//   with its ancestors, ascending. The ancestors the second walk shares with the first are computed
//   by both, from the same inputs with the same arithmetic, so both write the same bits to their
//   output and saved states. It is done for the slot it shortens most (the longest walk shrinks),
//   never for a slot with a WRITE_BACK row (the other walk would read its pool while it is rewritten).
enum deltaspec_rows_col {
    DELTASPEC_ROWS_PARENT = 0,    // [row]  parent row or -1                          (caller)
    DELTASPEC_ROWS_SLOT = 1,      // [row]  pool slot, -1 = skipped                   (caller)
    DELTASPEC_ROWS_FLAGS = 2,     // [row]  DELTASPEC_ROW_* bits                      (caller)
    DELTASPEC_ROWS_SAVED = 3,     // [row]  index of its state in the result's saved states, or -1
    DELTASPEC_ROWS_ORDER = 4,     // [position] the row walked there; -1 past the last position
    DELTASPEC_ROWS_START = 5,     // [position] its start: -1 the previous position's state,
                                  //            -2 pool[slot], k >= 0 saved state k
    DELTASPEC_ROWS_WALK_END = 6,  // [walk] one past its last position; -1 past the last walk
    DELTASPEC_ROWS_N_COLS = 7,
};

// Walks a plan may add to its slots' by splitting (the CUDA recurrence's grid has room for that many
// more than the batch has slots, when the rows tensor has room for positions beyond R).
#define DELTASPEC_ROWS_EXTRA_WALKS 1

// Checks a batch and writes its rows tensor's data (rows: n_positions * DELTASPEC_ROWS_N_COLS int32,
// n_positions >= n_rows the rows tensor's P: R allows no split walk, 2 R any). flags may be NULL
// (all 0). Returns the number of saved states the batch needs (at most R: n_saved of
// deltaspec_rows_gated_delta_net must be at least that), or -1 with a message naming the row and the
// rule it breaks in err (err_size bytes, NUL-terminated; err may be NULL).
int64_t deltaspec_rows_plan(int64_t n_rows, const int32_t * parent, const int32_t * slot, const int32_t * flags,
                            int64_t n_slots, int64_t n_positions, int32_t * rows, char * err, size_t err_size);

// The recurrence (ggml_gated_delta_net's, scalar gate, S_k == S_v = S, H_v % H_k == 0, q/k head
// h % H_k serving value head h):
//   q, k  : F32 [S, H_k, R, 1] (rows of S contiguous; q is scaled by 1/sqrt(S) inside, as in ggml)
//   v     : F32 [S, H_v, R, 1] (rows of S contiguous)
//   g     : F32 [1, H_v, R, 1] contiguous, the log-decay (state *= exp(g))
//   beta  : F32 [1, H_v, R, 1] contiguous
//   pool  : F32 [S, S, H_v, n_slots] contiguous, each head's state stored transposed as ggml stores
//           it (element (i, j) of S at j * S + i); rewritten in place only by WRITE_BACK rows
//   rows  : I32 [DELTASPEC_ROWS_N_COLS, P >= R] from deltaspec_rows_plan
//   n_saved: room for that many saved states (the plan's count, or more)
// result: F32 [S * H_v, R + S * n_saved]: the output y of row r at [S * H_v, r] (ggml's
//   [S, H_v, R] order; not written for skipped rows), then saved state k at
//   [S * S * H_v] floats from (R * S * H_v + k * S * S * H_v) in the pool's layout.
struct ggml_tensor * deltaspec_rows_gated_delta_net(struct ggml_context * ctx, struct ggml_tensor * q,
                                                    struct ggml_tensor * k, struct ggml_tensor * v,
                                                    struct ggml_tensor * g, struct ggml_tensor * beta,
                                                    struct ggml_tensor * pool, struct ggml_tensor * rows,
                                                    int64_t n_saved);

// The most walks the plans a recurrence node computes can hold: both backends look at walks
// 0 .. deltaspec_rows_walks_max(node) - 1 only. Without it (max_walks 0) that is one per slot of the
// pool plus a split's, as far as the rows tensor has room; CUDA launches a row of thread blocks per
// walk it may have, and those past the plan's last walk return at once, but a graph whose batches
// touch few slots of a large pool would launch hundreds of them per layer: its builder states the
// bound (the slots its batches touch, plus DELTASPEC_ROWS_EXTRA_WALKS where it lets plans split).
// A plan with more walks than the bound would leave rows uncomputed: deltaspec_rows_count_walks
// lets the caller check.
void deltaspec_rows_set_max_walks(struct ggml_tensor * node, int64_t max_walks);

static inline int64_t deltaspec_rows_walks_max(const struct ggml_tensor * node) {
    const int64_t P = node->src[6]->ne[1], R = node->src[2]->ne[2], n_slots = node->src[5]->ne[3];
    const int64_t stated = node->op_params[3];
    const int64_t bound = stated > 0 ? stated : n_slots + (P > R ? DELTASPEC_ROWS_EXTRA_WALKS : 0);
    return bound < P ? bound : P;
}

// The walks of a plan (rows: n_positions * DELTASPEC_ROWS_N_COLS int32 from deltaspec_rows_plan).
static inline int64_t deltaspec_rows_count_walks(const int32_t * rows, int64_t n_positions) {
    int64_t n = 0;
    while (n < n_positions && rows[n * DELTASPEC_ROWS_N_COLS + DELTASPEC_ROWS_WALK_END] >= 0) ++n;
    return n;
}

// The causal depthwise conv (ggml_ssm_conv's, without the activation):
//   pool  : F32 [Kc-1, C, n_slots] contiguous, each slot's last Kc-1 inputs per channel, oldest
//           first; rewritten in place only by WRITE_BACK rows
//   x     : F32 [C, R] (rows of C contiguous), this batch's inputs
//   c     : F32 [Kc, C] contiguous, the conv weights (2 <= Kc <= DELTASPEC_ROWS_MAX_KC)
//   rows  : I32 [DELTASPEC_ROWS_N_COLS, P >= R] from deltaspec_rows_plan
// result: F32 [C, R, 1]: y[c, r] = sum_j c[j, c] * w_r[j] over j = 0 .. Kc-1 in that order, w_r = the
//   Kc-1 inputs before row r (its window) then x[:, r]; not written for skipped rows. ggml-cuda may
//   fuse a following SILU (and a bias ADD before it) into the node, as it does for ggml_ssm_conv.
struct ggml_tensor * deltaspec_rows_ssm_conv(struct ggml_context * ctx, struct ggml_tensor * pool,
                                             struct ggml_tensor * x, struct ggml_tensor * c,
                                             struct ggml_tensor * rows);

// Shape and type checks of the two builders (which abort on what these refuse): true when fine,
// otherwise false with a message naming the tensor and what was expected in err.
bool deltaspec_rows_gated_delta_net_check(const struct ggml_tensor * q, const struct ggml_tensor * k,
                                          const struct ggml_tensor * v, const struct ggml_tensor * g,
                                          const struct ggml_tensor * beta, const struct ggml_tensor * pool,
                                          const struct ggml_tensor * rows, int64_t n_saved, char * err,
                                          size_t err_size);
bool deltaspec_rows_ssm_conv_check(const struct ggml_tensor * pool, const struct ggml_tensor * x,
                                   const struct ggml_tensor * c, const struct ggml_tensor * rows, char * err,
                                   size_t err_size);

// Whether t is a node of these ops (what the backends' dispatchers ask).
static inline bool deltaspec_is_rows_node(const struct ggml_tensor * t) {
    const int src = t->op == GGML_OP_GATED_DELTA_NET ? 6 : t->op == GGML_OP_SSM_CONV ? 3 : -1;
    return src >= 0 && t->src[src] != NULL && t->op_params[1] == DELTASPEC_ROWS_MAGIC;
}

// Whether the ggml-cpu linked here carries the CPU side (ggml/cpu/inject.cmake); a ggml without it
// would run ggml's own op on these nodes. Builders of a graph should refuse without it.
bool deltaspec_rows_cpu_available(void);

#ifdef __cplusplus
}
#endif
