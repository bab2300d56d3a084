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
    ggml_tensor * mask = nullptr;      // F32 {n_kv, n}: 0 / -inf; only for a causal block
};

// Context injection: g = RMSNorm(fc . features) * hidden_norm; per layer K = RoPE(k_norm(wk . g)),
// V = wv . g, written to the cache rows. No attention: the context rows are keys and values only.
void build_dflash_inject(ggml_context * ctx, ggml_cgraph * gf, const DFlashGraphWeights & w, DFlashInputs & in,
                         int64_t n);

// The block pass over n = block_size tokens whose K/V go to cache rows n_kv-n .. n_kv-1: every
// block query attends to all n_kv rows (the context and the whole block, non-causal unless
// hp.causal). Returns the logits {n_vocab, n-1} of the predicted slots 1 .. n-1.
ggml_tensor * build_dflash_block(ggml_context * ctx, ggml_cgraph * gf, const DFlashGraphWeights & w,
                                 DFlashInputs & in, int64_t n, int64_t n_kv);

}  // namespace deltaspec
