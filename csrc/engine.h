// One qwen35 model with one sequence: weights, state, backends and the step that runs the graph.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "hparams.h"
#include "state.h"
#include "weights.h"

namespace deltaspec {

enum class LogitsWanted { none, last, all };

struct EngineOptions {
    int64_t n_ctx = 4096;
    int64_t n_ubatch = 512;       // largest micro-batch one graph processes
    int n_threads = 1;
    std::string device = "cpu";   // "cpu" or "cuda"
    std::string type_k = "f16";
    std::string type_v = "f16";
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
    void reset();                 // start a new, empty sequence

    const HParams & hparams() const { return hp_; }
    int64_t n_past() const { return state_.n_past; }
    int64_t n_ctx() const { return state_.n_ctx; }
    const std::string & backend_name() const { return backend_name_; }

  private:
    void eval_ubatch(const int32_t * tokens, int64_t n_tokens, LogitsWanted wanted, float * logits);

    HParams hp_;
    EngineOptions opts_;
    ggml_backend_t backend_ = nullptr;      // holds weights and state
    ggml_backend_t backend_cpu_ = nullptr;  // the scheduler's mandatory CPU fallback
    ggml_backend_sched_t sched_ = nullptr;
    std::string backend_name_;
    ModelWeights weights_;
    SequenceState state_;
    std::vector<uint8_t> graph_meta_;       // scratch for graph/tensor descriptors
    size_t graph_size_ = 0;
};

ggml_type parse_cache_type(const std::string & name);

}  // namespace deltaspec
