// A draft model: a second qwen35 model with the target's vocabulary, kept in step with each
// sequence's committed tokens, drafting for one sequence or several at once: a second Engine with
// at least the scheduler's slots (a sequence in target slot i drafts in draft slot i), whose passes
// hold every drafting sequence's rows (Engine::verify_rows). Each sequence's drafts depend on its
// own tokens and draws only, so a batch drafts what each sequence would alone.
//
// Per round: one pass evaluates every drafting sequence's catch-up (the committed tokens its slot
// lacks: after a round, the accepted drafts and the bonus token) and commits it (keep_paths); a
// backlog longer than max_catch_up (drafting was paused: the draft kept failing) restarts the slot
// from the last max_catch_up committed tokens instead, which bounds what a useless draft costs.
// Then pass j (1 .. n_max - 1) evaluates each chain of drafts d_1 .. d_j from the slot's committed
// state without committing it, its last row giving d_{j+1} (greedy, or drawn with the request's
// sampling chain and q reported). The drafts are never committed, so nothing needs a checkpoint to
// roll back; a pass of a small draft model reads its weights once whatever its rows, so the
// re-evaluated chains cost little. A job that asks for a tree (tree_budget > 0) then grows it
// best-first (draft_tree.h build_best_first) from the draft's distribution after each node's path,
// each node's path evaluated from the slot's committed state in a pass of its own. Greedy: children
// are the draft's most probable tokens (ranked by its softmax, penalties applied), no q recorded;
// sampling: children drawn without replacement from the request's sampling chain with q recorded,
// so that rejection sampling (tree_walk.h TreeRule::rejection) is exact.
//
// Cost (Draft::cost, in target decode steps): a draft forward costs step_cost (the caller's estimate
// from the weight bytes both models read per step); catch-up tokens count one forward each, as do a
// chain's draft steps and a tree's nodes (a node's path evaluated in one batch reads the weights
// once: counting its tokens would overstate a tree several times on a GPU and make the scheduler
// pause drafting that pays). Draft quality only changes acceptance, never the output.
#pragma once

#include <cstdint>
#include <vector>

#include "drafters.h"
#include "engine.h"
#include "sampler.h"

namespace deltaspec {

// One sequence's draft-model state.
struct DraftSlotState {
    explicit DraftSlotState(const SamplingParams & sampling) : sampler(sampling), ranker(tree_ranking(sampling)) {}
    Sampler sampler;            // the draft's draws (a seed of its own: the caller's rule)
    Sampler ranker;             // greedy trees: the candidates' ranking distribution
    int64_t n_synced = 0;       // the slot holds committed[start .. n_synced) for some start
    int64_t last_drafted = 0;   // tokens the previous round drafted
};

// What one sequence asks for in a round (n_max 0: nothing) and gets.
struct DraftJob {
    int64_t slot = -1;
    DraftSlotState * state = nullptr;
    const std::vector<int32_t> * committed = nullptr;  // prompt + committed tokens
    int64_t n_max = 0;          // a chain's length, or a tree's depth
    int64_t tree_budget = 0;    // > 0: a tree of at most this many nodes instead of a chain
    // drafts within it (the request's grammar), if any: each draft row masked with the rule's state
    // after the tokens drafted before it (TokenConstraint::mask_draft_row), so greedy drafts are
    // the draft's best allowed tokens and sampled ones are drawn, q reported, from the masked row;
    // a row where the rule allows nothing ends the chain (a tree: makes its node a leaf)
    TokenConstraint * constraint = nullptr;
    Draft draft;
    DraftTree tree;
};

class BatchModelDrafter {
  public:
    BatchModelDrafter(Engine & draft, double step_cost, int64_t max_catch_up = 16)
        : draft_(draft), step_cost_(step_cost), max_catch_up_(max_catch_up) {}

    // A sequence admitted into `slot`: the slot reads its prompt.
    void begin(int64_t slot, DraftSlotState & st, const std::vector<int32_t> & prompt);
    // Drafts for every job with n_max > 0 (jobs in any order, distinct slots).
    void propose(std::vector<DraftJob> & jobs);
    Engine & engine() { return draft_; }

  private:
    // Evaluates chains[k] (non-empty) after the committed state of jobs[k]'s slot, in passes of
    // consecutive slots that fit n_ubatch (a slot between them without a chain gets a dummy row,
    // never kept); the logits of each chain's last row land in last_[k]; `commit` keeps the chains.
    void run(const std::vector<DraftJob *> & jobs, const std::vector<std::vector<int32_t>> & chains, bool commit);
    // a tree job's tree after its catch-up (root: the logits after the committed tokens); returns
    // the draft forwards it took
    int64_t grow_tree(DraftJob & job, const std::vector<float> & root);

    Engine & draft_;
    double step_cost_;
    int64_t max_catch_up_;
    RowBatch rows_;
    std::vector<float> out_;
    std::vector<std::vector<float>> last_;
  public:
    // A slot whose sequence does not draft with the model: emptied, so that a pass's dummy row fits it.
    void clear_slot(int64_t slot);
};

}  // namespace deltaspec
