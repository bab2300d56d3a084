#include "dflash_drafter.h"

#include "token_constraint.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace deltaspec {

std::vector<int> dflash_taps(const DFlashHParams & hp) {
    std::vector<int> taps;
    for (int32_t L : hp.target_layers) {
        if (L < 1) throw std::invalid_argument("DFlash target layer 0 (the embedding output) cannot be tapped");
        taps.push_back(L - 1);
    }
    return taps;
}

DFlashDrafter::DFlashDrafter(DFlashModel & model, Engine & target, double pass_cost, const SamplingParams & sampling,
                             int64_t slot)
    : model_(model), target_(target), pass_cost_(pass_cost), slot_(slot), sampler_(sampling),
      top1_(model.hparams().block_size - 1) {
    if (slot_ < 0) throw std::invalid_argument("DFlashDrafter: slot " + std::to_string(slot_) + " is not a slot");
}

void DFlashDrafter::inject_tapped() {
    model_.use_slot(slot_);
    const int64_t n = target_.n_tapped_rows(slot_);
    if (n > 0) model_.inject(target_.tapped(slot_).data(), n, target_.tapped_pos(slot_));
    target_.clear_tapped(slot_);
}

void DFlashDrafter::begin(const std::vector<int32_t> & prompt) {
    model_.use_slot(slot_);
    // the target has just read the prompt, or (a sequence resuming a kept slot) its part after
    // what the slot held, whose context the model's slot still holds
    const int64_t from = target_.tapped_pos(slot_);
    if (from > model_.n_cached()) {
        throw std::logic_error("DFlash drafter: slot " + std::to_string(slot_) + "'s tapped rows start at position " +
                               std::to_string(from) + " but its context holds " + std::to_string(model_.n_cached()) + " rows");
    }
    model_.truncate(from);
    inject_tapped();
}

bool DFlashDrafter::ready(const std::vector<int32_t> & committed) {
    inject_tapped();
    // the anchor (the last committed token, not yet read by the target) sits right after the context
    const int64_t anchor_pos = (int64_t)committed.size() - 1;
    if (model_.n_cached() != anchor_pos) {
        throw std::logic_error("DFlash drafter: context of " + std::to_string(model_.n_cached()) +
                               " rows before an anchor at position " + std::to_string(anchor_pos));
    }
    return anchor_pos + model_.hparams().block_size <= model_.n_ctx();  // else no room for a block
}

bool DFlashDrafter::plan(const std::vector<int32_t> & committed, int64_t budget, DFlashModel::BlockJob & job) {
    if (!ready(committed)) return false;
    job = DFlashModel::BlockJob{};
    job.slot = model_.current_slot();
    job.anchor = committed.back();
    planned_k_ = 0;
    if (budget <= 0 && constraint_ == nullptr) {
        job.top1 = top1_.data();
        return true;
    }
    // a tree: every slot's top-K tokens, K = min(budget, n_vocab), the most ranks a budget-node tree
    // can use at one depth; a constrained chain: enough candidates that one is mostly allowed
    const int64_t n_slots = model_.hparams().block_size - 1;
    const bool sampled = !sampler_.params().greedy() && budget > 0;
    job.top_k = std::min<int64_t>(budget > 0 ? budget : kConstrainedChainCandidates, model_.n_vocab());
    job.temperature = sampled ? sampler_.params().temperature : 1.0f;
    top_ids_.resize(n_slots * job.top_k);
    top_probs_.resize(n_slots * job.top_k);
    job.top_ids = top_ids_.data();
    job.top_probs = top_probs_.data();
    planned_k_ = job.top_k;
    return true;
}

Distribution DFlashDrafter::slot_candidates(int64_t slot) const {
    Distribution m;
    m.ids.assign(top_ids_.begin() + slot * planned_k_, top_ids_.begin() + (slot + 1) * planned_k_);
    m.probs.assign(top_probs_.begin() + slot * planned_k_, top_probs_.begin() + (slot + 1) * planned_k_);
    return m;
}

namespace {

// The candidate of highest probability (ties: the lower id, as the device's argmax takes the
// first); the device's top K come in no particular order.
int32_t most_probable(const Distribution & c) {
    size_t best = 0;
    for (size_t i = 1; i < c.ids.size(); ++i) {
        if (c.probs[i] > c.probs[best] || (c.probs[i] == c.probs[best] && c.ids[i] < c.ids[best])) best = i;
    }
    return c.ids[best];
}

}  // namespace

Draft DFlashDrafter::chain(int64_t n_max) {
    n_passes_++;
    Draft d;
    d.cost = pass_cost_;
    const int64_t n = std::min<int64_t>(n_max, (int64_t)top1_.size());
    if (planned_k_ == 0) {
        d.tokens.assign(top1_.begin(), top1_.begin() + n);
        return d;
    }
    // constrained: each slot's most probable candidate the grammar allows after the chain before it.
    // The chain goes on past a slot whose own best was forbidden, although the slots after it were
    // predicted without knowing: on the testbed (bench/grammar_draft_bench.py) that drafted more
    // per pass than ending the chain there (greedy 3.42 vs 3.04 tokens per pass, sampled 2.60 vs 2.67).
    for (int64_t slot = 0; slot < n; ++slot) {
        Distribution c = slot_candidates(slot);
        if (!filter_draft_within(constraint_, d.tokens, c, model_.n_vocab())) break;
        d.tokens.push_back(most_probable(c));
    }
    return d;
}

namespace {

void renormalize(Distribution & m) {
    double sum = 0.0;
    for (float p : m.probs) sum += p;
    if (sum > 0.0) {
        for (float & p : m.probs) p = (float)(p / sum);
    }
}

}  // namespace

DraftTree DFlashDrafter::tree(int64_t budget, int64_t max_depth) {
    n_passes_++;
    const int64_t depth = std::min(max_depth, model_.hparams().block_size - 1);
    const bool sampled = !sampler_.params().greedy();
    std::vector<Distribution> marginals(depth);
    for (int64_t d = 0; d < depth; ++d) {
        marginals[d] = slot_candidates(d);
        if (sampled) renormalize(marginals[d]);  // q must sum to 1: the draws come from these K tokens only
    }
    BestFirstOptions o;
    o.budget = budget;
    o.max_depth = depth;
    o.seed_chain = false;
    if (sampled) o.uniform = [this] { return sampler_.uniform(); };
    DraftTree t;
    if (constraint_ == nullptr) {
        t = build_from_marginals(marginals, o);
    } else {
        // each node's own candidates: its depth's, cut to what the rule allows after its path
        const int64_t n_vocab = model_.n_vocab();
        t = build_best_first(
            [&](const DraftTree & tree, int32_t node, Distribution & out) {
                out = marginals[node < 0 ? 0 : tree.depth[node]];
                if (filter_draft_within(constraint_, tree.path_tokens(node), out, n_vocab)) {
                    renormalize(out);
                } else {
                    out = Distribution{};  // nothing allowed among the candidates: a leaf
                }
            },
            o);
        if (constraint_->bug == GrammarBug::draft_q_unmasked && sampled) {
            // planted: the children were drawn from the allowed candidates, q reported uncut
            if (t.root_child_q >= 0) t.dists[t.root_child_q] = marginals[0];
            for (int32_t n = 0; n < (int32_t)t.size(); ++n) {
                if (t.child_q[n] >= 0) t.dists[t.child_q[n]] = marginals[t.depth[n]];
            }
        }
    }
    t.cost = pass_cost_;
    return t;
}

Draft DFlashDrafter::propose(const std::vector<int32_t> & committed, int64_t n_max) {
    DFlashModel::BlockJob job;
    if (!plan(committed, 0, job)) return Draft{};
    model_.blocks({job});
    return chain(n_max);
}

DraftTree DFlashDrafter::propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth) {
    const int64_t depth = std::min(max_depth, model_.hparams().block_size - 1);
    if (budget < 1 || depth < 1) return DraftTree{};
    DFlashModel::BlockJob job;
    if (!plan(committed, budget, job)) return DraftTree{};
    model_.blocks({job});
    return tree(budget, depth);
}

}  // namespace deltaspec
