// The DFlash drafter's two graphs (z-lab DFlashDraftModel; llama.cpp src/models/dflash.cpp is the
// same computation): context injection and the block pass.
#pragma once

#include <cstdint>
#include <vector>

#include "dflash_model.h"
#include "ggml.h"

namespace deltaspec {

struct DFlashGraphWeights {
    const DFlashHParams & hp;
    ggml_tensor * fc;           // {n_feat, E}
    ggml_tensor * hidden_norm;  // {E}
    ggml_tensor * output_norm;  // {E}
    const std::vector<DFlashLayer> & layers;
    ggml_tensor * token_embd;   // the target's {E, n_vocab}
    ggml_tensor * output;       // the target's LM head {E, n_vocab}
    const std::vector<ggml_tensor *> & k_cache;  // per layer {Hkv*D, n_ctx} F32
    const std::vector<ggml_tensor *> & v_cache;
};

// Inputs of a graph over n rows.
struct DFlashInputs {
    ggml_tensor * features = nullptr;  // F32 {n_feat, n} (inject only)
    ggml_tensor * tokens = nullptr;    // I32 {n} (block only)
    ggml_tensor * pos = nullptr;       // I32 {n}: RoPE positions
    ggml_tensor * rows = nullptr;      // I64 {n}: cache rows written (= positions)
};

// Context injection: g = RMSNorm(fc . features) * hidden_norm; per layer K = RoPE(k_norm(wk . g)),
// V = wv . g, written to the cache rows. No attention: the context rows are keys and values only.
void build_dflash_inject(ggml_context * ctx, ggml_cgraph * gf, const DFlashGraphWeights & w, DFlashInputs & in,
                         int64_t n);

// The block pass: block j of N (n = block_size tokens: the anchor, then mask tokens; rows j*n ..
// j*n + n-1 of the inputs) writes its K/V to caches[j] (its sequence's slot: w's k_cache / v_cache
// are not read) at cache rows n_kv[j]-n .. n_kv[j]-1, and every block query attends to all n_kv[j]
// rows of its cache (the context and the whole block, non-causal unless hp.causal); the
// projections, FFNs and LM head run over every block's rows at once (each weight read once for
// all). `masks` (hp.causal): one {n_kv[j], n} input per block. Returns the logits
// {n_vocab, (n-1) * N} of the predicted slots 1 .. n-1, block j's at columns j*(n-1) ..
struct DFlashSlotCache {
    const std::vector<ggml_tensor *> & k;  // per layer {Hkv*D, n_ctx} F32
    const std::vector<ggml_tensor *> & v;
};
ggml_tensor * build_dflash_blocks(ggml_context * ctx, ggml_cgraph * gf, const DFlashGraphWeights & w,
                                  const std::vector<DFlashSlotCache> & caches, DFlashInputs & in,
                                  std::vector<ggml_tensor *> & masks, int64_t n, const std::vector<int64_t> & n_kv);

}  // namespace deltaspec
