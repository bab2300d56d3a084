// Batch-invariant CUDA contexts (deltaspec_cuda_set_batch_invariant): on a backend registered here
// every row of a step is computed as it would be in any other batch, so a row's logits are bitwise
// the same in a one-token step, a verify chain, a draft tree or a batch of sequences.
//
// What differs between batch widths on ggml-cuda, and what this mode does instead:
//   * weight products: ggml's mat-vec sizes its thread blocks by the column count (1..8), then its
//     tile kernels (9+), ours take one column as a mat-vec and 2..32 on tensor cores, and ggml
//     fuses ffn up/gate and bias adds into one-column products only. Registered, every product
//     of a Q4_K / Q6_K matrix our tensor-core kernels serve runs on them at every width (1..32
//     columns at a time: a column's sums do not depend on the other columns'), any other matrix
//     column by column through ggml's one-column mat-vec, and a fusion ggml asks of a one-column
//     product is run as its separate ops (deltaspec_matmul.cu). The tensor-core kernels also add
//     a row's blocks in one order whatever the matrix (one row tile, no k-split: fixed_sum_order),
//     since a batch multiplies stacked weights (ffn gate/up) that a one-token step multiplies apart;
//   * attention: ggml picks its vector kernel for one query and its tile / MMA kernels for more,
//     and splits the cache over blocks by the work's size. Registered, one kernel serves every
//     query (deltaspec_invariant.cu): the cells a query sees are taken in order, 256 to a block,
//     and the blocks' partial results merged in order, so its sums are the same whichever
//     batch it is in, and wherever in the cache a draft tree put its ancestors' rows.
// The engine also stops offering norms and SwiGLUs to be folded into the products (csrc/engine.cpp).
// Everything else a Qwen3.5 step runs already computes each row on its own (norms, RoPE, the
// DeltaNet recurrence and conv, whose batch kernels give the one-token kernel's bits). Measured
// (tests/test_gpu_batch_invariant.py): bitwise on the synthetic 0.8B and the tiny models, and a
// stacked matrix's rows bitwise its part's alone; the synthetic 27B's rows bitwise its steps'
// (bench/batch_invariance.py, bench/invariance_probe.py --nodes; bench/README.md).
#pragma once

#include "common.cuh"

// Whether ctx belongs to a backend registered batch-invariant.
bool deltaspec_cuda_invariant(const ggml_backend_cuda_context & ctx);

// Whether any backend of the process is (ggml's mat-vec choice for F32/F16/BF16 weights is made
// without the context at hand: deltaspec_should_use_mmvf).
bool deltaspec_cuda_any_invariant();

// What the batch-invariant routes ran (host side), by deltaspec_cuda_invariant_count's `which`.
enum DeltaspecInvariantCount {
    kInvariantMmaProducts = 0,     // products on our tensor-core kernels
    kInvariantColumnProducts = 1,  // products column by column through ggml's mat-vec
    kInvariantAttention = 2,       // attention nodes on the invariant kernel
    kInvariantMisses = 3,          // nodes of a registered backend that went to ggml's batch-shaped kernels
    kInvariantCounts = 4,
};
void deltaspec_invariant_count(DeltaspecInvariantCount which);

// Whether the invariant attention kernel takes this FLASH_ATTN_EXT node as ggml would run it
// (F32 Q, F16 / BF16 / F32 K and V, an F16 mask, head dims 32..256, no ALiBi, softcap or sinks).
bool deltaspec_invariant_attn_serves(const ggml_tensor * node);

// node's attention into out ([D, H, T, N] contiguous, as ggml's result).
void deltaspec_invariant_attn(ggml_backend_cuda_context & ctx, const ggml_tensor * node, float * out);
