// Per-sequence model state: the attention KV cache and the DeltaNet recurrent state.
#pragma once

#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "hparams.h"

namespace deltaspec {

struct SequenceState {
    int64_t n_ctx = 0;            // KV rows, a multiple of kv_pad
    int64_t n_past = 0;           // tokens already in the state

    // indexed by layer; null where the layer is of the other kind
    std::vector<ggml_tensor *> k;     // {Hkv*D, n_ctx}
    std::vector<ggml_tensor *> v;     // {Hkv*D, n_ctx}
    std::vector<ggml_tensor *> conv;  // {Kc-1, C} F32: last Kc-1 inputs per channel, oldest first
    std::vector<ggml_tensor *> ssm;   // {S*S*Hv} F32: DeltaNet state, layout {S_v, S_k, Hv}

    // Speculative verification (n_slots = 0 when unused): the longest verify batch. The state
    // after each of its tokens stays in the verify graph's outputs until keep() (see
    // VerifyStates); here is one saved copy of the live state, for a drafter's checkpoint.
    int64_t n_slots = 0;
    std::vector<ggml_tensor *> conv_saved;  // like conv (n_slots > 0)
    std::vector<ggml_tensor *> ssm_saved;   // like ssm (n_slots > 0)

    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buffer = nullptr;

    // FA's CUDA vector kernels want the visible KV length to be a multiple of 256.
    static constexpr int64_t kv_pad = 256;

    SequenceState() = default;
    SequenceState(const SequenceState &) = delete;
    SequenceState & operator=(const SequenceState &) = delete;
    ~SequenceState();

    void clear();                 // empty sequence: zero the live recurrent state, n_past = 0
    void release();               // free the tensors (allocate_state may then run again)
    int64_t n_kv_for(int64_t n_tokens_total) const;  // KV rows attention must see
};

void allocate_state(SequenceState & st, const HParams & hp, int64_t n_ctx, ggml_type type_k, ggml_type type_v,
                    int64_t n_slots, ggml_backend_t backend);

// One tensor of the state as allocated (read from the ggml tensor, not from what was asked for).
struct StateTensorInfo {
    std::string kind;    // "k", "v" (attention KV cache), "conv", "ssm" (live recurrent state),
                         // "conv_saved", "ssm_saved" (the drafter's checkpoint copy)
    int layer = -1;
    ggml_type type = GGML_TYPE_COUNT;
    size_t nbytes = 0;   // ggml_nbytes
    int64_t ne0 = 0, ne1 = 0;
    std::string buffer;  // the backend buffer holding it ("CPU", "CUDA0", ...)
};

// Every allocated tensor of the state, by layer, in the order k, v, conv, ssm, conv_saved, ssm_saved.
std::vector<StateTensorInfo> state_tensor_info(const SequenceState & st);

// the saved recurrent state <- the live one (or the reverse), every recurrent layer; device copies.
void copy_recurrent_state(SequenceState & st, bool to_saved);

}  // namespace deltaspec
