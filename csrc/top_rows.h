// A logits row reduced on the device to its top candidates (ggml/deltaspec_top.h, LogitsWanted::top
// and ::top_all): what a sequence's next token and its log-probabilities need when its sampler's
// chain starts with a small top-k, so that k + k + 1 words cross to the host instead of n_vocab floats
// and the host sorts k candidates instead of the vocabulary.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "generate.h"
#include "sampler.h"

namespace deltaspec {

// One row of Engine::top_row_words() int32 words: k logits (F32 bits, largest first, ties by lower
// id), their k token ids, the row's log-sum-exp (F32 bits).
struct TopRow {
    const float * logit = nullptr;
    const int32_t * id = nullptr;
    int64_t k = 0;
    float lse = 0.0f;
};

inline TopRow top_row(const int32_t * words, int64_t k) {
    TopRow r;
    r.logit = reinterpret_cast<const float *>(words);  // F32 bits, as the op wrote them
    r.id = words + k;
    r.k = k;
    std::memcpy(&r.lse, words + 2 * k, sizeof(float));
    return r;
}

// Whether a request's token and log-probabilities can come from top rows of k candidates: a row its
// constraint does not mask (`masked` false: no constraint, or one that allows every token there,
// TokenConstraint::allows_every_token; a mask needs every token's logit), a sampler they decide
// (SamplingParams::top_serves: no penalties or logit bias, greedy or top_k <= k), and at most k top
// log-probabilities.
bool top_rows_serve(const GenerateRequest & req, int64_t k, bool masked);

// Whether the request's constraint masks the rows of a pass: it has one, and that one does not allow
// every token at the rows after its committed tokens and a prefix of any path through `along` (a
// chain's drafts or a tree's nodes; none for the next row alone): TokenConstraint::allows_every_token.
bool masks_rows_along(const GenerateRequest & req, const std::vector<int32_t> & along);

// How a request's rows at one pass cross over to the host, decided once per pass (the scheduler's
// steps and verify passes): `masked` (masks_rows_along); `argmax`, the device's argmax is
// all it needs (greedy, no log-probabilities, rows not masked: a mask needs the logits); `top`, the
// rows' top candidates are (top_rows_serve), where the engine reduces rows on the device.
// `device_masks`: the caller can hand the rows' masks to the engine (Engine's `allowed`: fill_allowed
// for a step's row, fill_verify_allowed / fill_tree_allowed for a verify's): masked rows without
// log-probabilities (those are the raw rows', which the reduction to the allowed tokens loses) then
// take the argmax or top candidates of their allowed tokens (`device_mask`) instead of crossing whole.
struct RowNeeds {
    bool masked = false, argmax = false, top = false;
    bool device_mask = false;  // masked, and its argmax or top candidates come from the masked row on the device
};
RowNeeds row_needs(const GenerateRequest & req, const std::vector<int32_t> & along, bool top_rows_enabled, int64_t k,
                   bool device_masks = false);

// The sequence's next token from a top row (greedy: the first candidate, the row's first maximum;
// else drawn as Sampler::sample would draw it from the whole row) and, when the request asks for
// them, its log-probability and the n_logprobs best ones (logit - lse), appended to `res`.
int32_t choose_from_top(const GenerateRequest & req, Sampler & sampler, const TopRow & row, GenerateResult & res);

}  // namespace deltaspec
