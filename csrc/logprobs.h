// generate(logprobs=k): each generated token's log-probability under the raw logits of the row that
// predicted it (log_softmax in double, rounded to float once; before any grammar mask, penalty or
// bias, as llama-cpp-python reports them) and the k most probable tokens' ones, appended to the
// result in the order the tokens are committed. Plain steps record the row they sample from; a
// speculative round records, for each token it commits, the verify row of its parent (the pending
// token's row for the first, the previous accepted node's after that), so speculation reports what
// plain decoding reports for the same tokens.
#pragma once

#include <cstdint>

#include "generate.h"
#include "top_rows.h"

namespace deltaspec {

// From a whole row of n_vocab logits.
void record_logprobs(const GenerateRequest & req, const float * row, int64_t n_vocab, int32_t token, GenerateResult & res);

// prompt_logprobs: the entry of prompt token `token` from the row of the token before it.
void record_prompt_logprobs(const GenerateRequest & req, const float * row, int64_t n_vocab, int32_t token,
                            LogprobEntries & entries);

// From a row's top candidates (top_rows.h); `token` must be one of them (a sampler that the top
// rows serve only draws those).
void record_top_logprobs(const GenerateRequest & req, const TopRow & row, int32_t token, GenerateResult & res);

// A planted bug for the tests (DELTASPEC_TEST_WRONG_LOGPROB_ROW=next_row): a speculative round
// records each committed token from the row after its parent's (its own row), so the reported
// log-probabilities are those of the token after it.
// prompt_own_row: a prompt token's entry is that of the token before it (its own row's token).
enum class LogprobBug { none, next_row, prompt_own_row };
LogprobBug logprob_bug();

}  // namespace deltaspec
