// Drafters propose continuations of the committed tokens; the target verifies them in one pass.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine.h"
#include "sampler.h"

namespace deltaspec {

struct Draft {
    std::vector<int32_t> tokens;
    // q: the distribution each token was drawn from (empty = deterministic, i.e. one-hot)
    std::vector<Distribution> dists;
};

class Drafter {
  public:
    virtual ~Drafter() = default;
    // Propose up to n_max tokens that follow `committed` (prompt + generated so far).
    virtual Draft propose(const std::vector<int32_t> & committed, int64_t n_max) = 0;
    // The target accepted the first n_accepted drafted tokens and appended `bonus`.
    virtual void accept(const std::vector<int32_t> & committed_after) {}
};

// Prompt lookup: the longest suffix (up to max_ngram tokens) of the committed text that occurred
// before; propose what followed its most recent earlier occurrence. Pure CPU, deterministic.
class NgramDrafter : public Drafter {
  public:
    explicit NgramDrafter(int64_t max_ngram = 3, int64_t min_ngram = 1) : max_ngram_(max_ngram), min_ngram_(min_ngram) {}
    Draft propose(const std::vector<int32_t> & committed, int64_t n_max) override;

  private:
    int64_t max_ngram_, min_ngram_;
};

// A second qwen35 model with the same vocabulary, kept in step with the committed tokens. It
// drafts token by token (greedy, or sampled with the request's sampling chain and reporting q),
// then restores its checkpoint and catches up on what the target committed.
class ModelDrafter : public Drafter {
  public:
    ModelDrafter(Engine & draft, const SamplingParams & sampling);
    Draft propose(const std::vector<int32_t> & committed, int64_t n_max) override;

  private:
    void catch_up(const std::vector<int32_t> & committed);

    Engine & draft_;
    Sampler sampler_;
    std::vector<float> logits_;
    int64_t n_synced_ = 0;  // committed tokens the draft's state holds
};

}  // namespace deltaspec
