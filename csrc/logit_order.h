// The candidate order every sampler chain starts from: token ids by logit, largest first, ties to
// the lower id. A comparison sort of the whole vocabulary (248320 ids for Qwen3.5) costs ~50 ms
// per row as a heap (partial_sort to the end) and still ~15 ms as introsort; the sampled verify
// ranks several rows per round, so that cost was most of a sampled round. That order is a strict
// total order on (logit, id), so any correct sort yields the same permutation; a stable radix sort
// on the logits' bits yields it in linear time (~1-2 ms), and every sum and draw that follows in
// this order stays bit for bit what it was.
#pragma once

#include <cstdint>
#include <vector>

namespace deltaspec {

// ids := 0 .. n-1 ordered by logit descending, ties by ascending id (-0.0 equals +0.0, as the
// comparison does). NaN logits have no place in that order; they end up first or last.
// `sorted`, when given, receives logits[ids[i]] at i (with -0.0 read as +0.0, the value the order
// gives it): the sort has those values in hand, and what follows (the softmax) then reads the row
// in order instead of gathering 248320 scattered logits.
void order_by_logit(const float * logits, int64_t n, std::vector<int32_t> & ids, std::vector<float> * sorted = nullptr);

}  // namespace deltaspec
