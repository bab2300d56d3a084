// deltaspec's own CUDA kernels (ggml/cuda/), which live inside ggml-cuda when it was built with
// them (ggml/cuda/inject.cmake). They are process-wide: ggml-cuda routes its quantized mat-vecs
// and small-batch products through them once switched on.
#pragma once

#include <cstdint>
#include <vector>

#include "deltaspec_copies.h"
#include "deltaspec_deltanet.h"
#include "ggml-backend.h"
#include "ggml.h"

namespace deltaspec {

// Whether the ggml this module runs on carries them (a CPU build, or a stock ggml, does not).
bool cuda_kernels_available();

// Switch them on, unless the environment says DELTASPEC_CUDA_KERNELS=0 (for A/B measurements);
// returns whether they are on. DELTASPEC_MMA_ROW_TILES=1|2|4 forces the tensor-core kernels'
// 16-row tiles per thread block (0 or unset: their own choice); another value throws.
// DELTASPEC_CUDA_DELTANET=0 leaves verify batches' DeltaNet recurrence to ggml's kernel;
// DELTASPEC_CUDA_PDL=0 launches our kernels without programmatic dependent launch (each then
// waits for the whole kernel before it, as ggml-cuda's GGML_CUDA_PDL=0 does for ggml's).
bool enable_cuda_kernels();

// The widest product (columns, a multiple of 32; 0: 32) our tensor-core kernels take, in launches of
// up to 32 columns; wider ones go to ggml's mmq (DELTASPEC_MMA_MAX_COLUMNS sets it when the kernels
// are enabled). False without our CUDA kernels. For the benches' A/B runs.
bool cuda_set_mma_max_columns(int n);

// How many times our DeltaNet kernels (ggml/cuda/deltaspec_deltanet.cu: verify batches' op and
// keep()'s replay) were launched from the host in this process (a replayed CUDA graph launches
// the op without the host); -1 without them.
int64_t cuda_deltanet_launches();

// Registers (on) or releases (off) a CUDA backend as batch-invariant (ggml/cuda/deltaspec_invariant.h:
// each row of its steps computed as in any other batch); false if this ggml lacks the mode or the
// backend is not a CUDA one. A registered backend must be released before it is freed.
bool cuda_set_batch_invariant(ggml_backend_t backend, bool on);

// How many times the batch-invariant routes ran in this process: which = 0 products on our
// tensor-core kernels, 1 products column by column, 2 attention nodes, 3 nodes of an invariant
// backend that went to ggml's batch-shaped kernels instead (misses); -1 without the mode.
int64_t cuda_invariant_count(int which);

// Offers an op output, MUL(RMS_NORM(x), w) or (2..32 columns) a SWIGLU, to our CUDA kernels:
// when they are on and serve every one of `weights` (the products that read it) for its column
// count (1..32), they apply the op themselves and ggml-cuda skips it
// (ggml/cuda/deltaspec_matmul.cu); returns whether it was folded. Also offers (2..32 columns) an
// ADD of a residual and the product with weights[0], which that product then writes itself, and
// a product (input) with the next product of its x (weights[0], next to it in the graph), which
// our tensor-core kernels then compute with it from one quantization of x (DELTASPEC_MMA_PAIRS=0:
// not offered).
bool cuda_fold_input(ggml_tensor * input, const std::vector<const ggml_tensor *> & weights);

// How many pairs of products our tensor-core kernels computed from one quantization of x in this
// process (cuda_fold_input); -1 without our CUDA kernels.
int64_t cuda_pair_count();

// keep()'s replay of the first shape.n_tokens tokens of a verify batch's DeltaNet recurrences, all
// layers in one launch, waited for (ggml/cuda/deltaspec_deltanet.h); false when nothing ran: this
// ggml-cuda lacks it, it is off (DELTASPEC_CUDA_KERNELS=0 or DELTASPEC_CUDA_DELTANET=0) or the
// shape is not one it serves (then the caller replays another way). Throws std::runtime_error on
// a CUDA error after launching (the states may be partly advanced: no other way can recover them).
bool cuda_deltanet_replay(const deltaspec_deltanet_replay & shape,
                          const std::vector<deltaspec_deltanet_layer> & layers);

// Appends one DeltaNet layer's replay inputs (the verify graph's q, k, v, g, beta, and the state the
// replay rolls forward) to `layers`, its strides to `shape` (n_tokens untouched); false when the
// kernels do not take them: not f32 rows, q/k or g/beta strides apart, or strides other than
// those of the layers already there (one launch takes one set).
bool add_deltanet_replay_layer(const ggml_tensor * q, const ggml_tensor * k, const ggml_tensor * v,
                               const ggml_tensor * g, const ggml_tensor * beta, float * state,
                               deltaspec_deltanet_replay & shape, std::vector<deltaspec_deltanet_layer> & layers);

// The same for the rows of accepted paths (deltaspec_cuda_deltanet_replay_paths): paths[p] over
// layers[p * n_layers ..], n_layers = layers.size() / paths.size().
bool cuda_deltanet_replay_paths(const deltaspec_deltanet_replay & shape,
                                const std::vector<deltaspec_deltanet_path> & paths,
                                const std::vector<deltaspec_deltanet_layer> & layers);

// Each path's conv windows gathered from its rows (deltaspec_cuda_commit_windows), paths[p] over
// layers[p * n_layers ..]; false when nothing ran (this ggml-cuda lacks it, or the windows are not
// served); throws std::runtime_error on a CUDA error after launching.
bool cuda_commit_windows(const std::vector<deltaspec_window_path> & paths,
                         const std::vector<deltaspec_window_layer> & layers);

// Device copies of f32 rows, all in one launch, waited for (ggml/cuda/deltaspec_copies.h); false
// when this ggml-cuda lacks them or the copy failed (then the caller copies another way).
bool cuda_copy_rows(const std::vector<deltaspec_copy> & jobs);

}  // namespace deltaspec
