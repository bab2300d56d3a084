// DFlash as a Drafter of the speculative loop: one block pass per round proposes the top-1 token of
// every block slot (a chain), or a DDTree tree over the slots' distributions (propose_tree). Its
// context is the target's tapped features of the committed tokens (Engine::set_taps with the
// drafter's layers), injected before each block; after a tree round the target keeps the taps of
// the accepted path only (Engine::keep_path), so the context never holds a rejected branch.
#pragma once

#include <vector>

#include "dflash_model.h"
#include "drafters.h"
#include "sampler.h"

namespace deltaspec {

// The target taps (ids of Engine::set_taps) that give the drafter's features: GGUF
// dflash.target_layers holds layer-input indices L (HF target_layer_ids + 1), the residual stream
// entering layer L, which is layer L-1's output, tap L-1.
std::vector<int> dflash_taps(const DFlashHParams & hp);

class DFlashDrafter : public Drafter {
  public:
    // `pass_cost` is one block pass in target decode steps (an estimate from weight bytes, which
    // keeps the loop's drafting schedule independent of timing). `sampling`: the request's (its
    // temperature and a seed of the drafter's own) for trees. `slot`: the scheduler's sequence
    // slot, drafting in that model slot from that target slot's taps (the scheduler sets the
    // target's taps and calls set_slot when it moves the sequence).
    DFlashDrafter(DFlashModel & model, Engine & target, double pass_cost, const SamplingParams & sampling,
                  int64_t slot);
    void begin(const std::vector<int32_t> & prompt) override;
    Draft propose(const std::vector<int32_t> & committed, int64_t n_max) override;
    // DDTree (Ringel & Romano; draft_tree.h build_from_marginals with seed_chain false, the paper's
    // pure best-first rule, which bench/testbed/ddtree.py follows): one block pass gives every
    // slot's top-K tokens, K = min(budget, n_vocab), the most ranks a budget-node tree can use at
    // one depth; slot d's are the candidates of every node of depth d + 1. Greedy: children
    // ranked by softmax(logits), chosen deterministically (no q). Sampling: q_d = softmax(logits /
    // temperature) over slot d's top K, renormalized (what the children really are drawn from,
    // so the rejection walk is exact for it), children drawn without replacement (Gumbel top-k).
    // Cost over the chain: the top-K (on the device) and (B-1) x K ids and probabilities read
    // back instead of B-1 argmax ids, then a heap of O(budget) items on the host.
    DraftTree propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth) override;
    bool tree_depth_is_free() const override { return true; }
    void set_slot(int64_t slot) { slot_ = slot; }
    // Drafts within `constraint` (the request's grammar; nullptr: none), as a draft model does (DraftJob::constraint),
    // from the block's top K per slot: a chain takes at each slot the most probable candidate the
    // rule allows after the chain before it (the block pass then returns each slot's top
    // kConstrainedChainCandidates instead of its argmax) and ends at a slot with none; a tree's
    // node gets as children only its depth's candidates the rule allows after its path, their
    // probabilities renormalized over those (sampled children are drawn from, and report, that q),
    // a node with none left a leaf.
    void constrain(TokenConstraint * constraint) { constraint_ = constraint; }
    static constexpr int64_t kConstrainedChainCandidates = 16;

    // propose() / propose_tree() in two halves, so that a scheduler runs the blocks of all its
    // sequences in one DFlashModel::blocks pass: plan() injects the new context rows and fills
    // `job` with this sequence's block (false: none can run, the drafter proposes nothing); after
    // the pass, chain() / tree() build what propose() / propose_tree() would from its outputs.
    // budget 0: a chain.
    bool plan(const std::vector<int32_t> & committed, int64_t budget, DFlashModel::BlockJob & job);
    Draft chain(int64_t n_max);
    DraftTree tree(int64_t budget, int64_t max_depth);

    int64_t n_passes() const { return n_passes_; }

  private:
    void inject_tapped();  // the target's new rows -> the drafter's context
    bool ready(const std::vector<int32_t> & committed);  // the context ends before the anchor; room for a block

    DFlashModel & model_;
    Engine & target_;
    double pass_cost_;
    int64_t slot_;
    Sampler sampler_;  // uniforms of the Gumbel draws (sampled trees)
    int64_t n_passes_ = 0;
    std::vector<int32_t> top1_;
    std::vector<int32_t> top_ids_;
    std::vector<float> top_probs_;
    int64_t planned_k_ = 0;  // the planned block's candidates per slot (0: a chain of argmaxes)
    TokenConstraint * constraint_ = nullptr;
    Distribution slot_candidates(int64_t slot) const;  // slot's planned top K, best first
};

}  // namespace deltaspec
