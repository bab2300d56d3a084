#include "batch_draft.h"

#include "token_constraint.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace deltaspec {

void BatchModelDrafter::clear_slot(int64_t slot) {
    draft_.use_slot(slot);
    draft_.reset();
}

void BatchModelDrafter::begin(int64_t slot, DraftSlotState & st, const std::vector<int32_t> & prompt) {
    clear_slot(slot);
    // the prompt read in full (its logits are not needed: the first round catches up on the first
    // generated token)
    draft_.eval(prompt.data(), (int64_t)prompt.size(), LogitsWanted::none, nullptr);
    st.n_synced = (int64_t)prompt.size();
    st.last_drafted = 0;
}

void BatchModelDrafter::run(const std::vector<DraftJob *> & jobs, const std::vector<std::vector<int32_t>> & chains,
                            bool commit) {
    const int64_t n_vocab = draft_.hparams().n_vocab;
    std::vector<size_t> order(jobs.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return jobs[a]->slot < jobs[b]->slot; });
    last_.assign(jobs.size(), {});
    for (size_t g = 0; g < order.size();) {
        // a group of jobs in slots [first, last] whose padded pass fits n_ubatch
        const int64_t first = jobs[order[g]]->slot;
        size_t e = g;
        int64_t longest = 0;
        while (e < order.size()) {
            const int64_t len = std::max<int64_t>(longest, (int64_t)chains[order[e]].size());
            if (e > g && (jobs[order[e]]->slot - first + 1) * len > draft_.n_ubatch()) break;
            longest = len;
            ++e;
        }
        const int64_t last = jobs[order[e - 1]]->slot;
        rows_.clear();
        std::vector<std::vector<int32_t>> paths;
        size_t next = g;
        for (int64_t s = first; s <= last; ++s) {
            const int32_t p0 = (int32_t)draft_.slot_n_past(s);
            paths.emplace_back();
            if (next < e && jobs[order[next]]->slot == s) {
                const std::vector<int32_t> & chain = chains[order[next]];
                const int32_t r0 = (int32_t)rows_.size();
                for (size_t t = 0; t < chain.size(); ++t) {
                    rows_.add(chain[t], p0 + (int32_t)t, (int32_t)s, t == 0 ? -1 : r0 + (int32_t)t - 1, t + 1 == chain.size());
                    paths.back().push_back(r0 + (int32_t)t);
                }
                ++next;
            } else {
                rows_.add(0, p0, (int32_t)s, -1, false);  // a slot between drafting ones: computed, never kept
            }
        }
        out_.resize((size_t)(e - g) * n_vocab);
        draft_.verify_rows(rows_, LogitsWanted::all, out_.data());
        for (size_t k = g; k < e; ++k) {
            const float * row = out_.data() + (k - g) * n_vocab;
            last_[order[k]].assign(row, row + n_vocab);
        }
        if (commit) {
            draft_.keep_paths(paths);
        }
        g = e;
    }
}

void BatchModelDrafter::propose(std::vector<DraftJob> & all) {
    std::vector<DraftJob *> jobs;
    for (DraftJob & j : all) {
        if (j.n_max > 0) jobs.push_back(&j);
    }
    if (jobs.empty()) return;
    if (rows_bug() == RowsBug::draft_slot_swap && jobs.size() > 1) {  // each job drafts in the next job's slot
        const int64_t first_slot = jobs[0]->slot;
        for (size_t k = 0; k + 1 < jobs.size(); ++k) jobs[k]->slot = jobs[k + 1]->slot;
        jobs.back()->slot = first_slot;
    }
    const int64_t n_vocab = draft_.hparams().n_vocab;
    std::vector<int64_t> n_forward(jobs.size(), 0);

    // catch up: the committed tokens each slot lacks, kept
    std::vector<std::vector<int32_t>> chains(jobs.size());
    for (size_t k = 0; k < jobs.size(); ++k) {
        DraftJob & j = *jobs[k];
        DraftSlotState & st = *j.state;
        const std::vector<int32_t> & committed = *j.committed;
        const int64_t n = (int64_t)committed.size();
        if (n <= st.n_synced) throw std::logic_error("BatchModelDrafter: a round with nothing committed since the last one");
        const int64_t paused_steps = n - st.n_synced - (st.last_drafted + 1);
        if (st.n_synced > 0 && paused_steps > max_catch_up_) {
            clear_slot(j.slot);
            st.n_synced = n - max_catch_up_;
        }
        chains[k].assign(committed.begin() + st.n_synced, committed.end());
        n_forward[k] = n - st.n_synced;
        st.n_synced = n;
        j.draft = Draft{};
    }
    run(jobs, chains, /*commit =*/true);

    // trees, one job after another; the chains below
    std::vector<std::vector<float>> roots = last_;
    for (size_t k = 0; k < jobs.size(); ++k) {
        if (jobs[k]->tree_budget > 0) n_forward[k] += grow_tree(*jobs[k], roots[k]);
    }
    last_ = std::move(roots);

    // the drafts, token by token, each pass over every chain still growing
    std::vector<std::vector<int32_t>> history(jobs.size());
    std::vector<int64_t> base(jobs.size());
    for (size_t k = 0; k < jobs.size(); ++k) {
        history[k] = *jobs[k]->committed;
        base[k] = draft_.slot_n_past(jobs[k]->slot);
    }
    std::vector<std::vector<float>> logits = last_;
    Distribution q;
    std::vector<float> q_logits;  // a planted bug's unmasked row (mask_draft_within)
    for (int64_t i = 0;; ++i) {
        std::vector<DraftJob *> growing;
        std::vector<std::vector<int32_t>> grow_chains;
        std::vector<size_t> grow_index;
        for (size_t k = 0; k < jobs.size(); ++k) {
            DraftJob & j = *jobs[k];
            if (j.tree_budget > 0 || i >= j.n_max || base[k] + i >= draft_.n_ctx() || (int64_t)j.draft.tokens.size() < i) {
                continue;
            }
            const bool greedy = j.state->sampler.params().greedy();
            if (!mask_draft_within(j.constraint, j.draft.tokens, logits[k].data(), n_vocab, &q_logits)) continue;
            j.state->sampler.distribution(logits[k].data(), n_vocab, history[k], q);
            const int32_t token = j.state->sampler.draw(q);
            j.draft.tokens.push_back(token);
            if (!greedy && !q_logits.empty()) j.state->sampler.distribution(q_logits.data(), n_vocab, history[k], q);
            if (!greedy) j.draft.dists.push_back(q);
            history[k].push_back(token);
            if (i + 1 < j.n_max) {
                growing.push_back(&j);
                grow_chains.push_back(j.draft.tokens);
                grow_index.push_back(k);
                n_forward[k] += 1;
            }
        }
        if (growing.empty()) break;
        run(growing, grow_chains, /*commit =*/false);
        for (size_t m = 0; m < growing.size(); ++m) logits[grow_index[m]] = std::move(last_[m]);
    }
    for (size_t k = 0; k < jobs.size(); ++k) {
        DraftJob & j = *jobs[k];
        j.state->last_drafted = j.tree_budget > 0 ? j.tree.max_depth() : (int64_t)j.draft.tokens.size();
        (j.tree_budget > 0 ? j.tree.cost : j.draft.cost) = step_cost_ * (double)n_forward[k];
    }
}

int64_t BatchModelDrafter::grow_tree(DraftJob & job, const std::vector<float> & root) {
    const int64_t n_vocab = draft_.hparams().n_vocab, base = draft_.slot_n_past(job.slot);
    DraftSlotState & st = *job.state;
    const bool greedy = st.sampler.params().greedy();
    int64_t n_forward = 0;
    std::vector<int32_t> history;
    std::vector<float> logits;
    auto dist = [&](const DraftTree & t, int32_t node, Distribution & out) {
        const std::vector<int32_t> path = t.path_tokens(node);
        if (node >= 0) {
            if (base + (int64_t)path.size() > draft_.n_ctx()) return;  // no room: a leaf
            run({&job}, {path}, /*commit =*/false);
            logits = std::move(last_[0]);
            n_forward += 1;
        }
        history = *job.committed;
        history.insert(history.end(), path.begin(), path.end());
        const float * row = node < 0 ? root.data() : logits.data();
        if (job.constraint != nullptr) {  // masked in place; the root row (the caller's) in a copy
            if (node < 0) logits = root;
            if (!mask_draft_within(job.constraint, path, logits.data(), n_vocab)) return;  // complete: a leaf
            row = logits.data();
        }
        (greedy ? st.ranker : st.sampler).distribution(row, n_vocab, history, out);
    };
    BestFirstOptions opts;
    opts.budget = job.tree_budget;
    opts.max_depth = job.n_max;
    if (!greedy) opts.uniform = [&st] { return st.sampler.uniform(); };
    job.tree = build_best_first(dist, opts);
    return n_forward;
}

}  // namespace deltaspec
