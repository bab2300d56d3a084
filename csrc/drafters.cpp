#include "drafters.h"

#include "token_constraint.h"

#include <algorithm>

namespace deltaspec {

SamplingParams tree_ranking(SamplingParams p) {
    p.temperature = 1.0f;
    p.top_k = 32;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    return p;
}

Draft NgramDrafter::propose(const std::vector<int32_t> & committed, int64_t n_max) {
    Draft d;
    const int64_t n = (int64_t)committed.size();
    for (int64_t len = std::min(max_ngram_, n - 1); len >= min_ngram_ && d.tokens.empty(); --len) {
        const int32_t * suffix = committed.data() + n - len;
        // most recent earlier occurrence whose continuation exists
        for (int64_t start = n - len - 1; start >= 0; --start) {
            if (std::equal(suffix, suffix + len, committed.data() + start)) {
                for (int64_t i = start + len; i < n && (int64_t)d.tokens.size() < n_max; ++i) {
                    d.tokens.push_back(committed[i]);
                }
                break;
            }
        }
    }
    return d;
}

DraftTree Drafter::propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth) {
    Draft d = propose(committed, std::min(budget, max_depth));
    DraftTree t = chain_tree(d.tokens, d.dists);
    t.cost = d.cost;
    return t;
}

DraftTree NgramDrafter::propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth) {
    DraftTree t;
    const int64_t n = (int64_t)committed.size();
    auto insert = [&](int64_t from) {  // the continuation committed[from ..) into the trie
        int32_t node = -1;
        for (int64_t i = from; i < n && i - from < max_depth; ++i) {
            int32_t child = -1;
            for (int32_t c : t.children(node)) {
                if (t.token[c] == committed[i]) child = c;
            }
            if (child < 0) {
                if (t.size() >= budget) return;
                child = t.add(committed[i], node);
            }
            node = child;
        }
    };
    for (int64_t len = std::min(max_ngram_, n - 1); len >= min_ngram_ && t.empty(); --len) {
        const int32_t * suffix = committed.data() + n - len;
        for (int64_t start = n - len - 1; start >= 0 && t.size() < budget; --start) {
            if (std::equal(suffix, suffix + len, committed.data() + start)) insert(start + len);
        }
    }
    return t;
}

ModelDrafter::ModelDrafter(Engine & draft, const SamplingParams & sampling, double step_cost, int64_t max_catch_up)
    : draft_(draft), sampler_(sampling), ranker_(tree_ranking(sampling)), logits_(draft.hparams().n_vocab),
      step_cost_(step_cost), max_catch_up_(max_catch_up) {}

void ModelDrafter::begin(const std::vector<int32_t> & prompt) {
    draft_.reset();
    n_synced_ = last_drafted_ = 0;
    catch_up(prompt);
    draft_.checkpoint();  // what the next catch_up restores: nothing drafted yet
}

int64_t ModelDrafter::catch_up(const std::vector<int32_t> & committed) {
    // evaluate committed[n_synced_ ..) in one batch; the prompt (n_synced_ = 0) is read in full,
    // but a backlog left by paused steps restarts the draft from the last max_catch_up_ tokens
    const int64_t n = (int64_t)committed.size();
    const int64_t paused_steps = n - n_synced_ - (last_drafted_ + 1);
    if (n_synced_ > 0 && paused_steps > max_catch_up_) {
        draft_.reset();
        n_synced_ = n - max_catch_up_;
    } else if (n_synced_ > 0) {
        draft_.restore_checkpoint();  // forget the previous round's drafted tokens
    }
    const int64_t n_new = n - n_synced_;
    draft_.eval(committed.data() + n_synced_, n_new, LogitsWanted::last, logits_.data());
    root_logits_ = logits_;
    n_synced_ = n;
    return n_new;
}

Draft ModelDrafter::propose(const std::vector<int32_t> & committed, int64_t n_max) {
    Draft d;
    int64_t n_forward = 0;  // draft tokens evaluated
    if ((int64_t)committed.size() > n_synced_) {
        n_forward += catch_up(committed);
    } else {
        draft_.restore_checkpoint();  // nothing new committed: forget the drafted tokens only
    }
    draft_.checkpoint();
    const bool greedy = sampler_.params().greedy();
    std::vector<int32_t> history = committed;
    Distribution q;
    std::vector<float> q_logits;  // a planted bug's unmasked row (mask_draft_within)
    for (int64_t i = 0; i < n_max && draft_.n_past() < draft_.n_ctx(); ++i) {
        if (!mask_draft_within(constraint_, d.tokens, logits_.data(), (int64_t)logits_.size(), &q_logits)) {
            break;  // the grammar is complete here
        }
        sampler_.distribution(logits_.data(), (int64_t)logits_.size(), history, q);
        const int32_t token = sampler_.draw(q);
        d.tokens.push_back(token);
        if (!greedy && !q_logits.empty()) sampler_.distribution(q_logits.data(), (int64_t)q_logits.size(), history, q);
        if (!greedy) d.dists.push_back(q);
        history.push_back(token);
        if (i + 1 < n_max) {
            draft_.eval(&token, 1, LogitsWanted::last, logits_.data());
            n_forward++;
        }
    }
    last_drafted_ = (int64_t)d.tokens.size();
    d.cost = step_cost_ * (double)n_forward;  // a catch-up batch counted as dear as single steps
    return d;
}

DraftTree ModelDrafter::propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth) {
    int64_t n_forward = 0;  // draft steps: catch-up tokens, then one per node evaluated
    if ((int64_t)committed.size() > n_synced_) {
        n_forward += catch_up(committed);
    } else {
        draft_.restore_checkpoint();  // nothing new committed: forget the drafted tokens only
    }
    draft_.checkpoint();
    const int64_t base = draft_.n_past();
    const bool greedy = sampler_.params().greedy();
    int32_t at = -1;  // the node whose path the draft's state ends with (-1: the committed tokens)
    std::vector<int32_t> history;
    auto dist = [&](const DraftTree & t, int32_t node, Distribution & out) {
        const std::vector<int32_t> path = t.path_tokens(node);
        if (node >= 0) {
            if (base + (int64_t)path.size() > draft_.n_ctx()) return;  // no room: a leaf
            if (t.parent[node] == at) {
                draft_.eval(&t.token[node], 1, LogitsWanted::last, logits_.data());
            } else {
                draft_.restore_checkpoint();
                draft_.eval(path.data(), (int64_t)path.size(), LogitsWanted::last, logits_.data());
            }
            n_forward += 1;
            at = node;
        }
        history = committed;
        history.insert(history.end(), path.begin(), path.end());
        const float * logits = node < 0 ? root_logits_.data() : logits_.data();
        if (constraint_ != nullptr) {  // masked in place; the root row in a copy, unmasked for the next tree
            if (node < 0) row_ = root_logits_;
            float * row = node < 0 ? row_.data() : logits_.data();
            if (!mask_draft_within(constraint_, path, row, (int64_t)logits_.size())) return;  // complete: a leaf
            logits = row;
        }
        (greedy ? ranker_ : sampler_).distribution(logits, (int64_t)logits_.size(), history, out);
    };
    BestFirstOptions opts;
    opts.budget = budget;
    opts.max_depth = max_depth;
    if (!greedy) opts.uniform = [this] { return sampler_.uniform(); };
    DraftTree t = build_best_first(dist, opts);
    last_drafted_ = t.max_depth();
    t.cost = step_cost_ * (double)n_forward;
    return t;
}

}  // namespace deltaspec
