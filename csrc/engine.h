// One qwen35 model: weights, backends, the state of n_seq_max sequence slots and the step that
// runs the graph. The one-sequence calls (eval, verify, keep, checkpoint) act on the slot chosen
// with use_slot (0 unless changed); decode() runs rows of several slots in one graph.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "graph_qwen35.h"
#include "hparams.h"
#include "rows.h"
#include "state.h"
#include "weights.h"

namespace deltaspec {

// What a step returns: no logits, the last row's, every row's, or the argmax (on the device, so
// that 4 bytes cross over instead of a vocabulary of floats) of the last row or of every row.
enum class LogitsWanted { none, last, all, argmax, argmax_all };

struct EngineOptions {
    int64_t n_ctx = 4096;
    int64_t n_ubatch = 512;       // largest micro-batch one graph processes
    int n_threads = 1;
    std::string device = "cpu";   // "cpu" or "cuda"
    ggml_type type_k = GGML_TYPE_F16;  // KV cache types (Python maps llama.cpp's names to these)
    ggml_type type_v = GGML_TYPE_F16;
    int64_t n_slots = 0;          // the longest verify batch (0: no speculation)
    int64_t n_seq_max = 1;        // sequence slots
    LoadProgress progress;        // optional: hears (done_bytes, total_bytes) while weights upload
};

class Engine {
  public:
    Engine(const std::string & path, const HParams & hp, const EngineOptions & opts);
    ~Engine();
    Engine(const Engine &) = delete;
    Engine & operator=(const Engine &) = delete;

    // Appends tokens to the sequence in micro-batches. `logits` receives n_vocab floats per
    // returned row: every row for LogitsWanted::all, the last row for ::last, nothing for ::none.
    void eval(const int32_t * tokens, int64_t n_tokens, LogitsWanted wanted, float * logits);
    // Appends tokens and returns the argmax of the last row's logits (greedy decoding).
    int32_t eval_argmax(const int32_t * tokens, int64_t n_tokens);
    void reset();                 // start a new, empty sequence (in the current slot)

    // The slot the one-sequence calls act on (a pending verify batch of the old one is kept whole).
    void use_slot(int64_t slot);
    int64_t current_slot() const { return cur_; }
    int64_t n_seq_max() const { return pool_.n_seq; }
    int64_t slot_n_past(int64_t slot) const { return pool_.slots.at(slot).n_past; }
    // slot `to` <- slot `from`: its KV rows, recurrent state and length (a scheduler compacting
    // its sequences into the lowest slots); `from` keeps its copy.
    void move_slot(int64_t from, int64_t to);

    // One row per sequence, each continuing its slot's committed state (parent -1, position =
    // the slot's length), in consecutive slots rows.slot[0], rows.slot[0] + 1, ...: one graph for
    // all of them, each slot then one token longer. `out` receives, for the rows that want
    // logits and in row order, n_vocab floats each (LogitsWanted::all) or the argmax
    // (LogitsWanted::argmax_all, on the device).
    void decode(const RowBatch & rows, LogitsWanted wanted, void * out);
    // What decode() has run (tests assert that batches of several sequences happened).
    struct DecodeStats {
        int64_t calls = 0, rows = 0, max_rows = 0;
    };
    const DecodeStats & decode_stats() const { return decode_stats_; }

    // Speculative verification: append a batch of at most n_slots tokens and return logits for
    // every row, leaving what the recurrent state after each token needs (VerifyStates); then
    // `keep(n)` keeps only the batch's first n tokens (KV rows past them are dead; the mask hides
    // them). Anything else that reads or extends the sequence first keeps the whole batch.
    void eval_verify(const int32_t * tokens, int64_t n_tokens, float * logits);
    void eval_verify_argmax(const int32_t * tokens, int64_t n_tokens, int32_t * argmax);  // greedy
    void keep(int64_t n_keep);
    // Save the recurrent state now / restore it and the position saved (a drafter's checkpoint).
    void checkpoint();
    void restore_checkpoint();
    // Allow verify batches of at least n tokens (re-allocates the state, which empties the sequence).
    void ensure_slots(int64_t n);

    // Hidden states returned for the rows of the one-sequence steps (eval, eval_verify): Taps'
    // layer ids (graph_qwen35.h; n_layer = the final normed hidden). tapped() holds them for the
    // committed positions tapped_pos() .. tapped_pos() + n_tapped_rows() - 1, each row's taps side
    // by side (layers.size() * n_embd floats a row): rows accumulate over calls until the reader
    // calls clear_tapped(); keep(n) drops a verify batch's rows past its first n; reset() and
    // set_taps() clear them. Empty layers: no taps (the default).
    void set_taps(const std::vector<int> & layers);
    const std::vector<int> & taps() const { return taps_.layers; }
    const std::vector<float> & tapped() const { return tapped_; }
    int64_t tapped_pos() const { return tapped_pos_; }
    int64_t n_tapped_rows() const;
    void clear_tapped();  // the rows read: the next ones start at n_past()

    // What another graph over this model's weights needs (the MTP head, mtp_head.h).
    const ModelWeights & weights() const { return weights_; }
    ggml_backend_t backend() const { return backend_; }
    ggml_backend_t cpu_backend() const { return backend_cpu_; }

    const HParams & hparams() const { return hp_; }
    int64_t n_past() const { return pool_.slots[cur_].n_past; }
    int64_t n_ctx() const { return pool_.n_ctx; }
    const std::string & backend_name() const { return backend_name_; }
    const SequenceState & state() {  // the current slot's live state (a pending verify batch kept whole first)
        settle_verify();
        return seq();
    }
    // The state's tensors as allocated, every slot: KV cache types and bytes per attention layer,
    // recurrent state.
    std::vector<StateTensorInfo> state_info() const { return state_tensor_info(pool_); }
    std::vector<std::string> weight_buffer_types() const { return deltaspec::weight_buffer_types(weights_); }
    std::vector<std::vector<std::string>> weight_stacks() const { return deltaspec::weight_stacks(weights_); }
    // Weight bytes one decode step reads (every matrix; one embedding row): what a step costs
    // where decoding is bound by memory bandwidth.
    size_t step_weight_bytes() const;

  private:
    void verify(const int32_t * tokens, int64_t n_tokens, LogitsWanted wanted, void * out);
    void eval_all(const int32_t * tokens, int64_t n_tokens, LogitsWanted wanted, void * out);
    void eval_ubatch(const int32_t * tokens, int64_t n_tokens, LogitsWanted wanted, void * out,
                     bool keep_states = false);
    // verify_rollback.cpp: the recurrent state after the first n tokens of the last verify batch,
    // from the one before it (conv windows copied, DeltaNet recurrences replayed; for all T
    // tokens the states after the batch copied), and the same for all of them when the batch is
    // followed by anything but keep()
    void advance_verify_state(int64_t n);
    bool copy_conv_windows_cuda(int64_t n);  // one CUDA launch; false: not done
    bool copy_last_states_cuda();            // n = T: the same
    bool replay_deltanet_cuda(int64_t n);    // n < T: the same
    void advance_verify_state_graph(int64_t n, bool conv, bool deltanet);  // a ggml graph, any backend
    void settle_verify();
    void append_taps(int64_t n_rows);  // the step's tapped rows -> tapped_

    // The last graph built stays allocated: a step of the same shape (every decode step until the
    // visible KV length grows by kv_pad) only sets its inputs and computes, no rebuild, no
    // re-allocation, and the CUDA backend can replay it as a CUDA graph.
    struct StepGraph {
        ggml_context * ctx = nullptr;
        ggml_cgraph * gf = nullptr;
        StepInputs in;
        ggml_tensor * out = nullptr;
        int64_t n_tokens = -1, n_kv = -1;
        LogitsWanted wanted = LogitsWanted::none;
        bool keep_states = false;
        int64_t n_seqs = 0, first_slot = 0, slot = -1;  // rows of several slots, or the one slot
        VerifyStates verify;  // keep_states: where each token's recurrent state is
    };
    StepGraph & step_graph(int64_t n_tokens, int64_t n_kv, LogitsWanted wanted, bool keep_states,
                           int64_t n_seqs = 0, int64_t first_slot = 0);
    void compute(StepGraph & g);
    SequenceState & seq() { return pool_.slots[cur_]; }
    const SequenceState & seq() const { return pool_.slots[cur_]; }
    void check_batch(const int32_t * tokens, int64_t n_tokens) const;  // fits the context, ids in range
    void make_scheduler();  // sizes the graph scratch; (re)creates sched_
    void drop_step_graph();

    HParams hp_;
    EngineOptions opts_;
    ggml_backend_t backend_ = nullptr;      // holds weights and state
    ggml_backend_t backend_cpu_ = nullptr;  // the scheduler's mandatory CPU fallback
    ggml_backend_sched_t sched_ = nullptr;
    std::string backend_name_;
    bool fold_inputs_ = false;  // norms and SwiGLUs offered to our CUDA kernels (cuda_kernels.h)
    ModelWeights weights_;
    StatePool pool_;
    int64_t cur_ = 0;  // the slot of the one-sequence calls
    DecodeStats decode_stats_;
    std::vector<uint8_t> graph_meta_;       // scratch for graph/tensor descriptors
    size_t graph_size_ = 0;
    StepGraph step_;
    int64_t verify_p0_ = -1, verify_T_ = 0;  // the last verify batch, for keep()
    int64_t checkpoint_n_past_ = -1;
    Taps taps_;                  // the layers asked for; their graph outputs in the step graph
    std::vector<float> tapped_;  // rows of positions tapped_pos_ .. (set_taps)
    int64_t tapped_pos_ = 0;
};


}  // namespace deltaspec
