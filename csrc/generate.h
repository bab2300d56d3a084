// One request: prefill a prompt, then sample token after token until a stop condition, all in
// C++ (the scheduler of scheduler.h with one sequence). Python only hears about tokens when it
// passes a callback (streaming).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
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
};

enum class FinishReason { stop, length, cancelled };

struct GenerateResult {
    std::vector<int32_t> tokens;          // every sampled token, including an EOG or stop-completing one
    FinishReason finish = FinishReason::length;
    int64_t stop_offset = -1;             // byte offset of the stop string in the generated text, or -1
    double prefill_seconds = 0.0;
    double decode_seconds = 0.0;
};

// Called after each sampled token; returning false cancels generation.
using TokenCallback = std::function<bool(int32_t)>;

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
