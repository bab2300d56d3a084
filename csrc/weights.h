// Model weights: tensors of a qwen35 GGUF copied into one backend buffer.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "hparams.h"
#include "layer_split.h"

namespace deltaspec {

struct LayerWeights {
    ggml_tensor * attn_norm = nullptr;  // {E}, stored as 1+w
    ggml_tensor * post_norm = nullptr;  // {E}, pre-FFN norm, stored as 1+w
    ggml_tensor * ffn_gate = nullptr;   // {E, n_ff}
    ggml_tensor * ffn_up = nullptr;     // {E, n_ff}
    ggml_tensor * ffn_down = nullptr;   // {n_ff, E}

    // gated full attention
    ggml_tensor * wq = nullptr;         // {E, 2*H*D}: per head [q(D), gate(D)]
    ggml_tensor * wk = nullptr;         // {E, Hkv*D}
    ggml_tensor * wv = nullptr;         // {E, Hkv*D}
    ggml_tensor * wo = nullptr;         // {H*D, E}
    ggml_tensor * q_norm = nullptr;     // {D}
    ggml_tensor * k_norm = nullptr;     // {D}

    // Gated DeltaNet
    ggml_tensor * wqkv = nullptr;       // {E, C}: [q | k | v] channels
    ggml_tensor * wgate = nullptr;      // {E, Hv*S}: output gate z
    ggml_tensor * wbeta = nullptr;      // {E, Hv}
    ggml_tensor * walpha = nullptr;     // {E, Hv}
    ggml_tensor * dt_bias = nullptr;    // {Hv}
    ggml_tensor * ssm_a = nullptr;      // {Hv}, -exp(A_log)
    ggml_tensor * conv1d = nullptr;     // {Kc, C}
    ggml_tensor * ssm_norm = nullptr;   // {S}, plain weight (no +1)
    ggml_tensor * ssm_out = nullptr;    // {Hv*S, E}
};

// The MTP (NextN) head stored after the trunk as block n_layer (llama.cpp's blk.{n_layer}.nextn.*):
// one gated full-attention block over eh_proj(concat(enorm(embedding), hnorm(hidden))), then a
// norm and the LM head. embed, head_norm and head are the trunk's token_embd, output_norm and
// output unless the file has the block's own.
struct MtpWeights {
    LayerWeights block;                 // attention + FFN, as a full-attention trunk layer
    ggml_tensor * eh_proj = nullptr;    // {2E, E}: input [embedding | hidden] -> E
    ggml_tensor * enorm = nullptr;      // {E}, 1+w
    ggml_tensor * hnorm = nullptr;      // {E}, 1+w
    ggml_tensor * embed = nullptr;      // {E, n_vocab}
    ggml_tensor * head_norm = nullptr;  // {E}, 1+w
    ggml_tensor * head = nullptr;       // {E, n_vocab}
    size_t bytes = 0;                   // the head's own tensors (not those it shares with the trunk)

    bool present() const { return eh_proj != nullptr; }
};

struct ModelWeights {
    ggml_tensor * token_embd = nullptr; // {E, n_vocab}
    ggml_tensor * output_norm = nullptr;
    ggml_tensor * output = nullptr;     // {E, n_vocab}; == token_embd when tied
    std::vector<LayerWeights> layers;
    MtpWeights mtp;                     // present() when the file has an MTP layer

    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buffer = nullptr;             // one device: every tensor
    std::vector<ggml_backend_buffer_t> split_buffers;  // a layer split (layer_split.h): one per device instead

    ModelWeights() = default;
    ModelWeights(const ModelWeights &) = delete;
    ModelWeights & operator=(const ModelWeights &) = delete;
    ~ModelWeights();
};

// Called while the weights are copied into the backend buffer with the bytes done so far and the
// total: once with (0, total) before the first tensor, then after tensors as the copy advances
// (at most ~100 calls in all), and last with (total, total). May throw to abort the load.
using LoadProgress = std::function<void(size_t done_bytes, size_t total_bytes)>;

// Names of the ggml buffer types holding the weight tensors, each once. ggml's CPU backend takes
// its AMX (and other repacked) matmul paths only for weights in those extra buffer types, so plain
// "CPU" here is what keeps the AMX hazard (crash on Q4_K batches > 1) away from a CPU engine.
std::vector<std::string> weight_buffer_types(const ModelWeights & w);

// The weights stored as one stack (load_weights' stack_shared_inputs): per stack, the names of
// its parts in row order.
std::vector<std::vector<std::string>> weight_stacks(const ModelWeights & w);

// Reads the tensors the graph needs from `path`, and the MTP layer when the file has one
// (hp.n_layer_nextn > 0) into a buffer of `backend`. Throws
// std::runtime_error naming the tensor when the file disagrees with `hp`.
//
// With `stack_shared_inputs`, the projections of one layer that multiply the same input (DeltaNet
// qkv, gate z, beta, alpha; attention q, k, v; ffn gate and up) and share a type are stored back
// to back as one tensor, and their weights are views of its rows. The graph then multiplies a
// stack once (one launch and one pass over x instead of up to four, with the same result in every
// row) and reads each projection as a view of the product's rows (graph_qwen35.cpp).
//
// With `split` (active), each tensor goes to a buffer of its layer's place instead (LayerSplit::
// weight_place), and a tied LM head (no output.weight) is a second copy of token_embd on the output
// layer's device when that is not the input's, as llama.cpp duplicates it.
void load_weights(ModelWeights & w, const std::string & path, const HParams & hp, ggml_backend_t backend,
                  bool stack_shared_inputs, const LoadProgress & progress = nullptr, const LayerSplit * split = nullptr);

}  // namespace deltaspec
