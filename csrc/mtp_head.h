// Qwen3.5's MTP head run beside its target: the target engine's weights and backend, a KV cache
// of its own (one attention layer, the target's KV types) and graphs of its own (graph_mtp.h).
#pragma once

#include <cstdint>
#include <vector>

#include "engine.h"
#include "graph_mtp.h"

namespace deltaspec {

class MtpHead {
  public:
    // Throws std::invalid_argument when the target's file has no MTP layer.
    MtpHead(const Engine & target, int64_t n_ctx, int64_t n_ubatch = 64);
    ~MtpHead();
    MtpHead(const MtpHead &) = delete;
    MtpHead & operator=(const MtpHead &) = delete;

    // Rows (tokens[t], hidden[t * E .. (t + 1) * E)) at positions n_past() .. n_past() + T - 1
    // (graph_mtp.h says what hidden is); their K/V rows are written and n_past() grows by T.
    // `out`: LogitsWanted::last: n_vocab floats of the last row; ::all: every row's; ::argmax: the
    // last row's argmax (int32, on the device). `hidden_out` (optional): the head's output hidden
    // of the same rows (n_embd floats each).
    void eval(const int32_t * tokens, const float * hidden, int64_t T, LogitsWanted wanted, void * out,
              float * hidden_out = nullptr);
    // Forget the rows at positions >= n (later rows overwrite theirs; the mask hides them until then).
    void set_n_past(int64_t n);
    int64_t n_past() const { return n_past_; }
    int64_t n_ctx() const { return n_ctx_; }
    // Weight bytes one one-row step reads (the block, eh_proj, the head; one embedding row).
    size_t step_weight_bytes() const;

    // Several heads' rows in one graph (eh_proj, FFN and LM head read once for all; attention per
    // head in its own cache): job j's rows continue job j's head as eval() would, each job's last
    // row's logits (LogitsWanted::last) or argmax (::argmax) to `out` (or nothing: ::none) and its
    // output hidden state to hidden_out (optional). The heads are distinct and of one target; the
    // graph and its scheduler are built per call, except for one job, which eval() runs on the
    // head's own kept graphs.
    struct RowsJob {
        MtpHead * head = nullptr;
        std::vector<int32_t> tokens;
        std::vector<float> hidden;  // tokens.size() * n_embd
        LogitsWanted wanted = LogitsWanted::none;
        void * out = nullptr;
        float * hidden_out = nullptr;
    };
    static void eval_groups(std::vector<RowsJob> & jobs);
    // What eval_groups has run (tests assert that several heads shared a graph).
    struct GroupStats {
        int64_t calls = 0, max_heads = 0;
    };
    static GroupStats group_stats();

  private:
    void eval_ubatch(const int32_t * tokens, const float * hidden, int64_t T, LogitsWanted wanted, void * out,
                     float * hidden_out);
    void drop_graph(int which);

    const Engine & target_;
    const HParams & hp_;
    int64_t n_ctx_ = 0, n_ubatch_ = 0, n_past_ = 0;
    ggml_context * cache_ctx_ = nullptr;
    ggml_backend_buffer_t cache_buf_ = nullptr;
    ggml_tensor * k_ = nullptr;  // {Hkv*D, n_ctx}
    ggml_tensor * v_ = nullptr;
    size_t graph_size_ = 0;

    // Two graphs stay allocated, each with a scheduler of its own: the last one-row step (a draft)
    // and the last step of more rows (a catch-up), which alternate every round; a step of the
    // same shape only sets its inputs.
    struct Graph {
        ggml_context * ctx = nullptr;
        ggml_cgraph * gf = nullptr;
        StepInputs in;
        ggml_tensor * hidden_in = nullptr;
        MtpGraphOutputs out;
        ggml_tensor * result = nullptr;  // logits or argmax
        int64_t n_tokens = -1, n_kv = -1;
        LogitsWanted wanted = LogitsWanted::none;
        ggml_backend_sched_t sched = nullptr;
        std::vector<uint8_t> meta;  // the graph's tensor and node descriptors
    } g_[2];
};

}  // namespace deltaspec
