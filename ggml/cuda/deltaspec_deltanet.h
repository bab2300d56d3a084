// deltaspec_cuda_deltanet_replay (deltaspec_deltanet.cu, inside ggml-cuda when it carries our
// kernels): rolls every DeltaNet layer's live state forward by the first tokens of a verify batch,
// in one launch. Plain C, so that the engine can declare it weak and link against a ggml-cuda
// without it.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// One layer: the recurrence's inputs as the verify graph left them (q, k: the l2-normed heads; v;
// g: the log-decay; beta) and its live state (n_v_heads states of state_dim^2 floats, each stored
// transposed as ggml's op stores it), which is read and rewritten in place.
struct deltaspec_deltanet_layer {
    const float * q;
    const float * k;
    const float * v;
    const float * g;
    const float * beta;
    float * state;
};

// What every layer shares: head counts (q/k head h % n_qk_heads serves v head h), the tokens to
// replay, and strides in floats (g and beta share theirs).
struct deltaspec_deltanet_replay {
    int64_t n_v_heads, n_qk_heads, state_dim, n_tokens;
    int64_t qk_head, qk_token, v_head, v_token, gate_head, gate_token;
};

// Runs the first shape->n_tokens tokens of every layer's recurrence on the device holding
// layers[0].state and waits for it; the caller must have synchronized whatever wrote the inputs.
// The arithmetic is that of the verify op (ggml's, see the .cu), so the state is the one the op
// passed through. Returns 1 when done; 0 when nothing was launched (our kernels are off, the
// state size is not one it serves, the state is not device memory: the caller replays another
// way); -1 on a CUDA error after launching (the states may be partly advanced).
int deltaspec_cuda_deltanet_replay(const struct deltaspec_deltanet_replay * shape,
                                   const struct deltaspec_deltanet_layer * layers, int n_layers);

// The longest accepted path deltaspec_cuda_deltanet_replay_paths takes (its rows travel in the
// launch's parameters, beside the layers).
#define DELTASPEC_DELTANET_PATH_MAX 128

// The rows of one slot's accepted path in a verify batch of rows (a tree's root-to-leaf path, or a
// chain's kept prefix), root first: row r's inputs are at r times the shape's token strides.
struct deltaspec_deltanet_path {
    int32_t n_rows;
    int32_t rows[DELTASPEC_DELTANET_PATH_MAX];
};

// As deltaspec_cuda_deltanet_replay, for the rows of paths instead of the first n tokens:
// paths[p] rolls layers[p * n_layers .. (p + 1) * n_layers - 1] forward (each path its slot's
// states), all in one wait. shape->n_tokens is not read. Returns 0 without launching anything
// when a path is longer than DELTASPEC_DELTANET_PATH_MAX (or as the other does).
int deltaspec_cuda_deltanet_replay_paths(const struct deltaspec_deltanet_replay * shape,
                                         const struct deltaspec_deltanet_path * paths, int n_paths,
                                         const struct deltaspec_deltanet_layer * layers, int n_layers);

#ifdef __cplusplus
}
#endif
