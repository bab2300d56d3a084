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
    // A new sequence starts with `prompt` (a draft model reads it here, timed as prefill).
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

// A second qwen35 model with the same vocabulary, kept in step with the committed tokens. It
// drafts token by token (greedy, or sampled with the request's sampling chain and reporting q),
// then restores its checkpoint and catches up on what the target committed.
//
// A draft forward costs `step_cost` target decode steps (the caller estimates it from the weight
// bytes both read per step). Catching up costs a draft forward per committed token: after a round,
// what waits is the accepted drafts and the bonus token; when drafting was paused for more than
// `max_catch_up` steps (the draft kept failing), the draft restarts from only the last
// `max_catch_up` committed tokens instead of reading everything it missed, which bounds what a
// useless draft costs. Draft quality only changes acceptance, never the output.
class ModelDrafter : public Drafter {
  public:
    ModelDrafter(Engine & draft, const SamplingParams & sampling, double step_cost, int64_t max_catch_up = 16);
    // Drafts within `constraint` (the request's grammar; nullptr: none): each draft row is masked
    // with the rule's state after the tokens drafted before it (TokenConstraint::mask_draft_row),
    // so greedy drafts are the draft's best allowed tokens and sampled ones are drawn, and their
    // q reported, from the masked row; a row where the rule allows nothing ends the draft (a tree:
    // makes its node a leaf). Without it, forbidden proposals are only cut before verification.
    void constrain(TokenConstraint * constraint) { constraint_ = constraint; }
    void begin(const std::vector<int32_t> & prompt) override;
    Draft propose(const std::vector<int32_t> & committed, int64_t n_max) override;
    // Best-first (draft_tree.h build_best_first) from the draft's distribution at each node. A
    // node's distribution needs the draft's state after its path: a child of the node evaluated
    // last costs one draft token, any other node restores the checkpoint (the committed tokens)
    // and evaluates its whole path in one batch. `cost` counts that batch (at most max_depth
    // tokens) as one draft step, as step_cost's bandwidth model has it (a forward of a few tokens
    // reads the weights once), and catch-up tokens one step each as propose() does: catch-up plus
    // at most one step per node. (Counting replayed tokens instead would overstate a tree several
    // times on a GPU and make the loop pause drafting that pays.)
    // Greedy: children are the draft's most probable tokens (ranked by its softmax, penalties
    // applied, normalized over the top 32), no q recorded. Sampling: children are drawn without
    // replacement from the request's sampling chain and q is recorded, so that rejection sampling
    // (tree_walk.h TreeRule::rejection) is exact.
    DraftTree propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth) override;

  private:
    int64_t catch_up(const std::vector<int32_t> & committed);  // returns the tokens evaluated

    Engine & draft_;
    TokenConstraint * constraint_ = nullptr;
    Sampler sampler_;
    Sampler ranker_;  // greedy trees: the candidates' ranking distribution
    std::vector<float> logits_;
    std::vector<float> root_logits_;  // the draft's logits after the committed tokens (catch_up)
    std::vector<float> row_;          // the root row, masked (propose_tree)
    double step_cost_;
    int64_t max_catch_up_;
    int64_t n_synced_ = 0;     // the draft's state holds committed[start .. n_synced_) for some start
    int64_t last_drafted_ = 0;  // tokens the previous round drafted
};

}  // namespace deltaspec
