// The qwen35 forward graph: 3 Gated DeltaNet layers per gated full-attention layer, SwiGLU FFNs.
#pragma once

#include <functional>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "hparams.h"
#include "state.h"
#include "weights.h"

namespace deltaspec {

// Graph inputs of one micro-batch of T rows. Either T tokens appended to one sequence (n_seqs = 0:
// the graph reads and writes that sequence's SequenceState), or rows of n_seqs sequences,
// T / n_seqs consecutive rows each, every sequence starting from its slot's committed state and
// written back to it (the graph reads and writes the StatePool).
struct StepInputs {
    ggml_tensor * tokens = nullptr;  // I32 {T}
    ggml_tensor * pos = nullptr;     // I32 {4*T}: IMROPE positions, section-major [p.., p.., p.., 0..]
    ggml_tensor * kv_rows = nullptr; // I64 {T}: KV cache rows written by this batch (of the pool's
                                     // tensors when n_seqs > 0: slot * n_ctx + position)
    ggml_tensor * kq_mask = nullptr; // F16 {n_kv, T}, or {n_kv, T/n_seqs, 1, n_seqs}: 0 where a query
                                     // may attend, -inf elsewhere
    int64_t n_tokens = 0;
    int64_t n_kv = 0;                // KV rows attention reads per sequence (multiple of SequenceState::kv_pad)
    int64_t n_seqs = 0;              // 0: one sequence; else the sequences of the rows
    // n_seqs > 0: sequence i of the rows lives in slot first_slot + i. Its KV rows are read as FA's
    // stream i (one strided view of the pool) and its recurrent state is row first_slot + i of the
    // pool's (one view, read and written in place: no gather, no scatter).
    int64_t first_slot = 0;
    bool keep_states = false;        // a verify batch: leave the recurrent state for keep() (VerifyStates)
    // A tree verify batch (one sequence): the DeltaNet layers run the parent-indexed rows ops
    // (ggml/deltaspec_rows.h) over the pool, reading the slot's committed state and writing nothing,
    // each row starting from its parent row's state; rows is their plan (I32 [DELTASPEC_ROWS_N_COLS, P],
    // deltaspec_rows_plan's, P >= T its room for walk positions), n_saved the room for states kept at
    // branch points (T: any tree of T rows fits, so one graph serves every tree of that size). kq_mask then shows each row the slot's
    // committed KV rows and its own ancestors' (Engine::verify_tree); keep_states is set too.
    ggml_tensor * rows = nullptr;
    int64_t n_saved = 0;
};

// The most walks a plan of `in`'s rows may have: one per sequence, and a split one where the rows
// tensor has room beyond its rows (deltaspec_rows_set_max_walks; set_rows_input checks each plan).
int64_t rows_max_walks(const StepInputs & in);

StepInputs make_step_inputs(ggml_context * ctx, int64_t n_tokens, int64_t n_kv, bool keep_states = false);
// The inputs of a tree verify batch of n_tokens rows, its plan's room n_positions (see StepInputs::rows).
StepInputs make_tree_inputs(ggml_context * ctx, int64_t n_tokens, int64_t n_kv, int64_t n_positions);

// Makes `in` a tree verify batch (the rows input with room for n_positions walk positions, n_saved =
// its rows, keep_states): with n_seqs > 0, rows of several slots whose attention runs as one FA stream
// per slot (Engine::verify_rows).
void add_rows_input(ggml_context * ctx, StepInputs & in, int64_t n_positions);

// Sets one of the inputs above once the graph is allocated. An input no kept node reads is not
// allocated (e.g. the mask when the last layer is an attention layer and the batch wants no
// logits): there is nothing to set then.
inline void set_input(ggml_tensor * t, const void * data, size_t size) {
    if (t->buffer) ggml_backend_tensor_set(t, data, 0, size);
}
// Sets the rows input to a plan of deltaspec_rows_plan, after checking that it fills the tensor and
// has no more walks than the graph's recurrence nodes look at (rows_max_walks); `who` names the caller
// in the std::logic_error otherwise.
void set_rows_input(const StepInputs & in, const std::vector<int32_t> & plan, const char * who);

// The positions, KV rows and causal mask of T tokens appended to one sequence at position p0
// (token t at p0 + t sees the cache rows 0 .. p0 + t of n_kv).
void set_chain_inputs(const StepInputs & in, int64_t p0, int64_t T, int64_t n_kv);
// Inputs for n_seqs sequences of n_per_seq rows each, in slots first_slot, first_slot + 1, ...
StepInputs make_batch_inputs(ggml_context * ctx, int64_t n_seqs, int64_t n_per_seq, int64_t n_kv, int64_t first_slot);

// Where a verify batch's graph leaves what keeping its first n tokens (Engine::keep) needs,
// without re-running the target: graph outputs, which the allocator keeps untouched until the
// next graph runs. The graph advances the conv windows by all T tokens and leaves the DeltaNet
// states as they were before the batch: keep(n < T) then replays the recurrence of the first n
// tokens from these inputs (one launch on CUDA; writing every token's 3 MB state per layer, as
// the op did before, cost more: bench/HISTORY.md, "replay"), keep(T) copies the op's state after the last
// token. Per layer (null for attention layers):
//   conv_in: {Kc-1+T, C}, the conv window before the batch and the batch's inputs; the window
//            after token T-1-r is columns window_column(r) .. window_column(r)+Kc-2;
//   q, k, v, g, beta: the DeltaNet op's inputs ({S, Hk, T, 1}, {S, Hk, T, 1}, {S, Hv, T, 1},
//            {1, Hv, T, 1}, {1, Hv, T, 1}; views of graph outputs);
//   result:  the op's result, which ends with the state after the last token ({S*S*Hv} F32).
// A tree verify batch (StepInputs::rows) leaves instead what replaying its accepted path through
// the rows ops needs (Engine::keep_path): q, k, v, g, beta as above and
//   conv_x:  the conv's inputs {C, T} (the windows before them are the pool's, untouched);
// conv_in and result stay null.
struct VerifyStates {
    std::vector<ggml_tensor *> conv_in, q, k, v, g, beta, result, conv_x;
    int64_t n_tokens = 0;  // T

    int64_t window_column(int64_t r) const { return n_tokens - r; }
};

// Offered each op output that only weight products read and that our CUDA kernels may apply
// themselves while they prepare x: the norms in front of the layer inputs' and the head's
// products, input = MUL(RMS_NORM(x), w), and the SwiGLUs in front of ssm_out and ffn down; with
// the weights of those products; and the residual adds x + W h, with W. May fold the op into
// the products (cuda_kernels.h: the product then writes the sum) and returns whether it did.
// Also offered a layer's two input products of one x, input = the first and weights = {the
// second}, next to each other in the graph: our kernels may then compute both from one
// quantization of x. Empty: no folding.
using FoldInput = std::function<bool(ggml_tensor * input, const std::vector<const ggml_tensor *> & weights)>;

// Hidden states returned for every row of a one-sequence step (drafters that read the target:
// MTP reads the final normed hidden state, DFlash the outputs of chosen layers). A layer id il in
// [0, n_layer) is that decoder layer's output (the residual stream after it, HF's
// hidden_states[il + 1]); il == n_layer is the final normed hidden state, what the LM head reads
// (llama.cpp's t_h_nextn). build_qwen35 fills `out` with one graph output {E, T} per id.
struct Taps {
    std::vector<int> layers;
    std::vector<ggml_tensor *> out;
};

// Builds the graph into gf; returns logits {n_vocab, n_logit_rows} of the batch's last rows
// (n_logit_rows 1: the last token; T: every token; 0: no LM head at all, nullptr is returned).
// The graph also writes the new KV rows, conv windows and DeltaNet states into `st` (one sequence)
// or into `pool` (in.n_seqs > 0); for a verify batch (in.keep_states, one sequence) it fills
// `verify` (not null then). `taps` (optional, one sequence) receives the tapped hidden states.
ggml_tensor * build_qwen35(ggml_context * ctx, ggml_cgraph * gf, const HParams & hp, const ModelWeights & w,
                           const StatePool & pool, const SequenceState & st, const StepInputs & in,
                           int64_t n_logit_rows,
                           const FoldInput & fold_input = nullptr, VerifyStates * verify = nullptr,
                           Taps * taps = nullptr);

// Blocks the MTP head's graph (graph_mtp.cpp) shares with the trunk: a gated full-attention
// layer's mixer over the rows of `in` (x: its normed input {E, T}; the new K/V rows are written
// to k_cache / v_cache, which hold n_ctx_slot rows per slot; fold_input: offered its input
// projections as a pair, see FoldInput) and a SwiGLU FFN.
ggml_tensor * gated_attention(ggml_context * ctx, ggml_cgraph * gf, const HParams & hp, const LayerWeights & l,
                              ggml_tensor * k_cache, ggml_tensor * v_cache, int64_t n_ctx_slot, ggml_tensor * x,
                              const StepInputs & in, const FoldInput & fold_input = FoldInput());
ggml_tensor * swiglu_ffn(ggml_context * ctx, ggml_cgraph * gf, const LayerWeights & l, ggml_tensor * x,
                         const FoldInput & fold_input);

}  // namespace deltaspec
