// One request: prefill a prompt, then sample token after token until a stop condition, all in
// C++ (the scheduler of scheduler.h with one sequence). Python only hears about tokens when it
// passes a callback (streaming).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine.h"
#include "sampler.h"
#include "token_constraint.h"

namespace deltaspec {

struct GenerateRequest {
    std::vector<int32_t> prompt;
    int32_t max_tokens = 16;              // generate at most this many (the context may stop it first)
    SamplingParams sampling;
    std::vector<int32_t> eog_ids;         // end-of-generation tokens: stop after emitting one
    std::vector<std::string> stop;        // stop strings, as UTF-8 bytes of the generated text
    TokenConstraint * constraint = nullptr;  // a grammar on the output (not owned), or none
    // The first n_cached prompt tokens are already in the sequence's state (a resumed chat, a
    // loaded state): only the rest is evaluated. 0: start from an empty sequence.
    int64_t n_cached = 0;
    // -1: none; k >= 0: the log-probability of each generated token under the model's raw logits
    // (log_softmax, before penalties and temperature) and the k most probable tokens' ones.
    int32_t n_logprobs = -1;
    // With n_logprobs >= 0 (the scheduler's requests): also each prompt token's log-probability given
    // the tokens before it, and the k most probable tokens' there (a completion's echo with logprobs;
    // the whole prompt is evaluated, none of it resumed from a kept state). max_tokens may then be
    // 0: the prompt scored alone, finishing with `length` and no token.
    bool prompt_logprobs = false;
    // The scheduler's embeddings: the prompt evaluated whole (max_tokens 0, nothing generated), every
    // row's final hidden state (after the output norm) in GenerateResult::hidden.
    bool hidden_states = false;
};

enum class FinishReason { stop, length, cancelled };

// Log-probability entries of some tokens: each token's, and n_logprobs most probable ones' per token.
struct LogprobEntries {
    std::vector<float> logprobs;
    std::vector<int32_t> top_ids;
    std::vector<float> top_logprobs;
};

struct GenerateResult {
    std::vector<int32_t> tokens;          // every sampled token, including an EOG or stop-completing one
    FinishReason finish = FinishReason::length;
    int64_t stop_offset = -1;             // byte offset of the stop string in the generated text, or -1
    double prefill_seconds = 0.0;
    double decode_seconds = 0.0;
    int64_t n_prefilled = 0;              // prompt tokens evaluated (the prompt less n_cached)
    std::vector<float> logprobs;          // n_logprobs >= 0: one per generated token
    std::vector<int32_t> top_ids;         // n_logprobs per generated token, most probable first
    std::vector<float> top_logprobs;      // their log-probabilities
    // prompt_logprobs: the same for prompt tokens 1 .. n-1 (the first has no context), once the whole
    // prompt was evaluated (a request cancelled before has none)
    std::optional<LogprobEntries> prompt;
    std::vector<float> hidden;            // hidden_states: n_embd floats per prompt token
};

// Called after each sampled token with the result so far (its tokens end with it; with
// n_logprobs >= 0 so do its logprobs, and its top lists by n_logprobs); returning false cancels
// generation.
using TokenCallback = std::function<bool(int32_t token, const GenerateResult & res)>;

// Token id -> the bytes it adds to the text (the detokenizer's piece table), for stop strings.
using PieceTable = std::vector<std::string>;

GenerateResult generate(Engine & engine, const PieceTable & pieces, const GenerateRequest & req,
                        const std::atomic<bool> & cancel, const TokenCallback & on_token);

// Commits generated tokens to a result and decides when generation ends: an end-of-generation
// token, a stop string, max_tokens, or the callback asking to cancel. Shared by every decode loop.
class Emitter {
  public:
    Emitter(const PieceTable & pieces, const GenerateRequest & req, const TokenCallback & on_token,
            GenerateResult & res)
        : pieces_(pieces), req_(req), on_token_(on_token), res_(res) {}
    // Returns false when generation must end after this token (res.finish is then set).
    bool emit(int32_t token);

  private:
    const PieceTable & pieces_;
    const GenerateRequest & req_;
    const TokenCallback & on_token_;
    GenerateResult & res_;
    std::string text_;
};

}  // namespace deltaspec
