// Token sampling with llama.cpp's default chain: penalties -> top-k -> top-p -> min-p ->
// temperature -> draw. The chain is split in two so speculative decoding can reuse the exact
// distribution: `distribution` turns logits into the final probabilities, `draw` picks from them.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <utility>
#include <vector>

namespace deltaspec {

struct SamplingParams {
    float temperature = 0.8f;     // <= 0: greedy (argmax after penalties)
    int32_t top_k = 40;           // <= 0: off
    float top_p = 0.95f;          // >= 1: off
    float min_p = 0.05f;          // <= 0: off
    float repeat_penalty = 1.0f;  // 1: off
    float presence_penalty = 0.0f;
    float frequency_penalty = 0.0f;
    int32_t penalty_last_n = 64;  // how many recent tokens the penalties look at (-1: all)
    uint64_t seed = 0;
    // (token, value) added to its logit after the penalties; -inf bans the token (ignore_eos)
    std::vector<std::pair<int32_t, float>> logit_bias;

    bool greedy() const { return temperature <= 0.0f; }
    // greedy on the raw logits (no penalty or bias reshapes them): the device's argmax is the token
    bool argmax_only() const {
        return greedy() && repeat_penalty == 1.0f && presence_penalty == 0.0f && frequency_penalty == 0.0f &&
               logit_bias.empty();
    }
    // Whether a row's k largest logits (in order, ties by lower id: ggml/deltaspec_top.h) decide the
    // distribution exactly: no penalty or bias (they could lift a token from below the k into it),
    // and greedy or a chain that starts with top_k <= k.
    bool top_serves(int64_t k) const {
        const bool reshaped = repeat_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f ||
                              !logit_bias.empty();
        return !reshaped && (greedy() || (top_k > 0 && top_k <= k));
    }
};

// Candidate tokens with their probabilities (sums to 1), most probable first.
struct Distribution {
    std::vector<int32_t> ids;
    std::vector<float> probs;
};

// Row i's target distribution p (the sampler's chain with `history`), from whichever form a verify
// batch returned its rows in: whole logits rows or top rows (top_rows.h).
using RowDistribution = std::function<void(int64_t row, const std::vector<int32_t> & history, Distribution & p)>;

class Sampler {
  public:
    explicit Sampler(const SamplingParams & params);

    // The distribution the next token is drawn from; `history` holds prompt + generated tokens.
    // For greedy params it is one-hot on the argmax.
    void distribution(const float * logits, int64_t n_vocab, const std::vector<int32_t> & history,
                      Distribution & out);
    int32_t draw(const Distribution & d);
    double uniform();  // a draw from U[0, 1) of this sampler's stream (rejection sampling)
    int32_t sample(const float * logits, int64_t n_vocab, const std::vector<int32_t> & history);
    // distribution() from those k candidates (logits[i] of token ids[i]), when params().top_serves(k): the
    // same logits in the same order reach the same arithmetic, so the result is distribution()'s
    // over the whole row, bit for bit.
    void distribution_top(const float * logits, const int32_t * ids, int64_t k, Distribution & out);
    int32_t sample_top(const float * logits, const int32_t * ids, int64_t k);

    const SamplingParams & params() const { return params_; }

    // How distribution() ordered its candidates, counted since construction: whole-row radix
    // orders (logit_order.h) and comparison sorts keeping more than kRadixFrom candidates (the
    // slow path a top_k = 0 sampler must not take: tests/test_sampler_order.py).
    // in_order: radix-ordered rows whose softmax read the sorted logits the order came with (the
    // fast path; tests/test_sampler_fast_path.py).
    struct SortCounts {
        int64_t radix = 0;
        int64_t comparison = 0;
        int64_t in_order = 0;
    };
    const SortCounts & sort_counts() const { return sorts_; }
    // top_k above this: one linear radix order of the row beats a partial sort's heap
    static constexpr int64_t kRadixFrom = 256;

  private:
    void apply_penalties(std::vector<float> & logits, const std::vector<int32_t> & history) const;
    // top-p, min-p and temperature over out.ids (indices into `logits`, sorted by logit descending)
    // sorted: logits[out.ids[i]] at i, or null (then gathered through out.ids)
    void shape(const float * logits, const float * sorted, Distribution & out) const;

    SamplingParams params_;
    std::mt19937_64 rng_;
    std::vector<float> scratch_;
    Distribution dist_;
    SortCounts sorts_;
    std::vector<float> sorted_;  // the row's logits in the radix order (logit_order.h)
    // Test only, from DELTASPEC_TEST_SAMPLER_SORT: the straightforward paths the fast ones must
    // match token for token, so that their tests can be seen to fail.
  public:
    enum class Reference {
        none,
        comparison_sort,  // "comparison": every row ordered by the comparison sort (the same order, the old cost)
        gathering,        // "reference": the radix order, a softmax gathering logits[ids[i]], and the tree
                          // walk drawing its residual through a copied Distribution
    };
    Reference reference() const { return reference_; }

  private:
    Reference reference_ = Reference::none;
};

}  // namespace deltaspec
