// Model state for up to n_seq_max sequences: per sequence slot the attention KV cache and the
// DeltaNet recurrent state (conv window + DeltaNet state), all slots of a layer in one tensor.
#pragma once

#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "hparams.h"
#include "layer_split.h"

namespace deltaspec {

// One sequence slot. Its tensors are plain tensors (no view op) over the slot's part of the pool's
// tensors, so a one-sequence graph reads and writes them exactly as it would tensors of its own
// (ggml-cuda's fusions look for those forms), while a graph over several sequences reads the
// pool's tensors (StatePool).
struct SequenceState {
    int64_t n_ctx = 0;            // KV rows, a multiple of kv_pad
    int64_t n_past = 0;           // tokens already in the state

    // indexed by layer; null where the layer is of the other kind
    std::vector<ggml_tensor *> k;     // {Hkv*D, n_ctx}
    std::vector<ggml_tensor *> v;     // {Hkv*D, n_ctx}
    std::vector<ggml_tensor *> conv;  // {Kc-1, C} F32: last Kc-1 inputs per channel, oldest first
    std::vector<ggml_tensor *> ssm;   // {S*S*Hv} F32: DeltaNet state, layout {S_v, S_k, Hv}

    // The chain verify's capacity (Engine::eval_verify; 0 when unused): the longest verify batch.
    // The state after each of its tokens stays in the verify graph's outputs until keep() (see
    // VerifyStates).
    int64_t n_slots = 0;

    // FA's CUDA vector kernels want the visible KV length to be a multiple of 256.
    static constexpr int64_t kv_pad = 256;

    void clear();                 // empty sequence: zero the live recurrent state, n_past = 0
    int64_t n_kv_for(int64_t n_tokens_total) const;  // KV rows attention must see
};

// Every slot's state; per layer one tensor holds all slots, slot s at a fixed offset:
//   k, v: {Hkv*D, n_ctx * n_seq}: slot s owns rows s*n_ctx .. (s+1)*n_ctx-1
//   conv: {(Kc-1)*C, n_seq} F32, ssm: {S*S*Hv, n_seq} F32: slot s is row s
// so a graph over sequences in consecutive slots reads and writes their recurrent states as one view
// and their KV rows as FA streams (a strided view).
struct StatePool {
    int64_t n_seq = 0;
    int64_t n_ctx = 0;  // per slot, as SequenceState::n_ctx
    std::vector<ggml_tensor *> k, v, conv, ssm;  // by layer, null where the layer is of the other kind
    std::vector<SequenceState> slots;

    ggml_context * ctx = nullptr;        // the pool's tensors (and the checkpoint copies)
    ggml_context * alias_ctx = nullptr;  // the slots' tensors over them
    ggml_backend_buffer_t buffer = nullptr;             // one device: every tensor
    std::vector<ggml_backend_buffer_t> split_buffers;  // a layer split: one per device instead

    StatePool() = default;
    StatePool(const StatePool &) = delete;
    StatePool & operator=(const StatePool &) = delete;
    ~StatePool();

    void release();  // free the tensors (allocate_state may then run again)
    // slot `to` <- slot `from` (KV rows, recurrent state, n_past): device copies
    void copy_slot(int64_t from, int64_t to);
};

// format_k / format_v (deltaspec_kv_format, ggml/deltaspec_tq.h): 1 = type_k / type_v holding rotated
// rows, 3 or 4 = a tq3 / tq4 cache instead of type_k / type_v. With `split` (active), each layer's
// tensors go to a buffer of that layer's place (LayerSplit::block), the device of its weights.
void allocate_state(StatePool & pool, const HParams & hp, int64_t n_ctx, int64_t n_seq, ggml_type type_k,
                    ggml_type type_v, int64_t n_slots, ggml_backend_t backend, int format_k = 0, int format_v = 0,
                    const LayerSplit * split = nullptr);

// One tensor of the state as allocated (read from the ggml tensor, not from what was asked for).
struct StateTensorInfo {
    std::string kind;    // "k", "v" (attention KV cache), "conv", "ssm" (live recurrent state)
    int layer = -1;
    int slot = 0;        // the sequence slot it belongs to
    ggml_type type = GGML_TYPE_COUNT;
    int kv_format = 0;   // deltaspec_kv_format: 1 rotated rows of `type`, 3 / 4 tq3 / tq4 (`type` only
                         // carries the bytes)
    size_t nbytes = 0;   // ggml_nbytes
    int64_t ne0 = 0, ne1 = 0;
    std::string buffer;  // the backend buffer holding it ("CPU", "CUDA0", ...)
};

// Every allocated tensor of every slot, by slot, then layer, in the order k, v, conv, ssm.
std::vector<StateTensorInfo> state_tensor_info(const StatePool & pool);

// `to`'s live recurrent state <- `from`'s, every recurrent layer; device copies (KV rows untouched).
void copy_recurrent_state(const SequenceState & from, SequenceState & to);

}  // namespace deltaspec
