// The qwen35 forward graph: 3 Gated DeltaNet layers per gated full-attention layer, SwiGLU FFNs.
#pragma once

#include <functional>
#include <vector>

#include "ggml.h"
#include "hparams.h"
#include "state.h"
#include "weights.h"

namespace deltaspec {

// Graph inputs of one micro-batch of T tokens appended to the sequence.
struct StepInputs {
    ggml_tensor * tokens = nullptr;  // I32 {T}
    ggml_tensor * pos = nullptr;     // I32 {4*T}: IMROPE positions, section-major [p.., p.., p.., 0..]
    ggml_tensor * kv_rows = nullptr; // I64 {T}: KV cache rows written by this batch
    ggml_tensor * kq_mask = nullptr; // F16 {n_kv, T}: 0 where a query may attend, -inf elsewhere
    int64_t n_tokens = 0;
    int64_t n_kv = 0;                // KV rows attention reads (multiple of SequenceState::kv_pad)
    bool keep_states = false;        // a verify batch: keep every token's recurrent state (VerifyStates)
};

StepInputs make_step_inputs(ggml_context * ctx, int64_t n_tokens, int64_t n_kv, bool keep_states = false);

// Where a verify batch's graph leaves the recurrent state after each of its T tokens, for a
// rollback (Engine::keep) without re-running the target and without copying every token's state
// away: graph outputs, which the allocator keeps untouched until the next graph runs. Per layer
// (null for attention layers):
//   conv_in: {Kc-1+T, C}, the conv window before the batch and the batch's inputs; the window
//            after token T-1-r is columns window_column(r) .. window_column(r)+Kc-2;
//   states:  the DeltaNet op's result; the state after token T-1-r ({S*S*Hv} F32) starts
//            state_offset(r) bytes in.
struct VerifyStates {
    std::vector<ggml_tensor *> conv_in;
    std::vector<ggml_tensor *> states;
    int64_t n_tokens = 0;     // T
    size_t states_offs = 0;   // where the states start in the op's result (after the outputs)
    size_t state_bytes = 0;   // one state

    int64_t window_column(int64_t r) const { return n_tokens - r; }
    size_t state_offset(int64_t r) const { return states_offs + (size_t)r * state_bytes; }
};

// Offered each op output that only weight products read and that our CUDA kernels may apply
// themselves while they prepare x: the norms in front of the layer inputs' and the head's
// products, input = MUL(RMS_NORM(x), w), and the SwiGLUs in front of ssm_out and ffn down; with
// the weights of those products; and the residual adds x + W h, with W. May fold the op into
// the products (cuda_kernels.h: the product then writes the sum) and returns whether it did.
// Empty: no folding.
using FoldInput = std::function<bool(ggml_tensor * input, const std::vector<const ggml_tensor *> & weights)>;

// Builds the graph into gf; returns logits {n_vocab, n_logit_rows} of the batch's last rows
// (n_logit_rows 1: the last token; T: every token; 0: no LM head at all, nullptr is returned).
// The graph also writes the new KV rows, conv windows and DeltaNet states into `st`; for a verify
// batch (in.keep_states) it fills `verify` (not null then).
ggml_tensor * build_qwen35(ggml_context * ctx, ggml_cgraph * gf, const HParams & hp, const ModelWeights & w,
                           const SequenceState & st, const StepInputs & in, int64_t n_logit_rows,
                           const FoldInput & fold_input = nullptr, VerifyStates * verify = nullptr);

}  // namespace deltaspec
