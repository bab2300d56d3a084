// Drafters propose continuations of the committed tokens; the target verifies them in one pass.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "draft_tree.h"
#include "engine.h"
#include "sampler.h"

namespace deltaspec {

class TokenConstraint;

// The distribution greedy draft trees rank a node's candidates by: the drafter's softmax at T = 1,
// top 32, with the request's penalties, not the one-hot greedy distribution, which would leave
// nothing to branch to. (Sampled trees draw from the request's own distribution instead.)
SamplingParams tree_ranking(SamplingParams p);

struct Draft {
    std::vector<int32_t> tokens;
    // q: the distribution each token was drawn from (empty = deterministic, i.e. one-hot)
    std::vector<Distribution> dists;
    // what proposing it cost, in target decode steps (an estimate that does not depend on timing,
    // so the drafting schedule, and with it sampled output, is the same on every run)
    double cost = 0.0;
};

class Drafter {
  public:
    virtual ~Drafter() = default;
    // A new sequence starts with `prompt` (the MTP head or a DFlash drafter reads it here).
    virtual void begin(const std::vector<int32_t> & prompt) {}
    // Propose up to n_max tokens that follow `committed` (prompt + generated so far).
    virtual Draft propose(const std::vector<int32_t> & committed, int64_t n_max) = 0;
    // Propose a tree of at most `budget` nodes no deeper than `max_depth` after `committed`
    // (draft_tree.h). A drafter that cannot branch proposes its chain.
    virtual DraftTree propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth);
    // True when a tree costs the drafter the same at any depth (one DFlash block pass): the loop
    // then asks for trees as deep as the room allows (draft_n_max), the budget alone bounding the
    // verify, as DDTree does; otherwise no deeper than the adaptive draft length.
    virtual bool tree_depth_is_free() const { return false; }
};

// Prompt lookup: the longest suffix (up to max_ngram tokens) of the committed text that occurred
// before; propose what followed its most recent earlier occurrence. Pure CPU, deterministic.
class NgramDrafter : public Drafter {
  public:
    explicit NgramDrafter(int64_t max_ngram = 3, int64_t min_ngram = 1) : max_ngram_(max_ngram), min_ngram_(min_ngram) {}
    Draft propose(const std::vector<int32_t> & committed, int64_t n_max) override;
    // The continuations of every earlier occurrence of the longest matched suffix, merged where
    // they agree: the tree branches where the history went on differently after the same words.
    // The most recent occurrence's continuation (propose()'s chain) comes first, then the others,
    // most recent first, until the budget is spent.
    DraftTree propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth) override;

  private:
    int64_t max_ngram_, min_ngram_;
};

}  // namespace deltaspec
