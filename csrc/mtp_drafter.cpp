#include "mtp_drafter.h"

#include "token_constraint.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace deltaspec {

MtpDrafter::MtpDrafter(Engine & target, const SamplingParams & sampling, int64_t slot)
    : target_(target), slot_(slot), head_(target, target.n_ctx()), sampler_(sampling),
      ranker_(tree_ranking(sampling)), zeros_(target.hparams().n_embd, 0.0f) {
    if (slot_ < 0) throw std::invalid_argument("MtpDrafter: slot " + std::to_string(slot_) + " is not a slot");
    step_cost_ = (double)head_.step_weight_bytes() / (double)target.step_weight_bytes();
}

const float * MtpDrafter::target_hidden(int64_t p) const {
    const int64_t E = target_.hparams().n_embd;
    const int64_t ts = slot_;
    const int64_t row = p - target_.tapped_pos(ts);
    if (row >= 0 && row < target_.n_tapped_rows(ts)) return target_.tapped(ts).data() + row * E;
    if (p == h_last_pos_) return h_last_.data();
    throw std::logic_error("MtpDrafter: the target's hidden state at position " + std::to_string(p) +
                           " was not tapped (was the target run without the drafter knowing?)");
}

void MtpDrafter::begin(const std::vector<int32_t> & prompt) {
    // the target has just read the prompt (its rows are tapped); the head reads it too
    head_.set_n_past(0);
    synced_ = 0;
    h_last_pos_ = -1;
    propose(prompt, 0);
}

bool MtpDrafter::catch_up_rows(const std::vector<int32_t> & committed, bool want_draft, int64_t & last) {
    const int64_t E = target_.hparams().n_embd;
    const int64_t n_past = target_.slot_n_past(slot_);  // committed[n_past] (if any) is the target's next input
    if ((int64_t)committed.size() < n_past || n_past < synced_) {
        throw std::logic_error("MtpDrafter: committed tokens and the target's state disagree");
    }
    // Catch up: a row for every position from synced_ up to the newest one (draft 1's input).
    last = std::min<int64_t>(n_past, (int64_t)committed.size() - 1);
    const bool drafting = want_draft && last == n_past;
    batch_tokens_.clear();
    batch_hidden_.clear();
    for (int64_t p = synced_; p <= last; ++p) {
        batch_tokens_.push_back(committed[p]);
        const float * h = p == 0 ? zeros_.data() : target_hidden(p - 1);
        batch_hidden_.insert(batch_hidden_.end(), h, h + E);
    }
    // keep the newest target hidden state: the next round's first row reads it
    if (n_past > 0) {
        const float * h = target_hidden(n_past - 1);
        h_last_.assign(h, h + E);
        h_last_pos_ = n_past - 1;
    }
    target_.clear_tapped(slot_);
    if (!batch_tokens_.empty()) head_.set_n_past(synced_);
    return drafting;
}

bool MtpDrafter::catch_up(const std::vector<int32_t> & committed, bool want_draft, LogitsWanted wanted,
                          int32_t * argmax) {
    const int64_t E = target_.hparams().n_embd, V = target_.hparams().n_vocab;
    int64_t last = 0;
    const bool drafting = catch_up_rows(committed, want_draft, last);
    if (batch_tokens_.empty()) return false;
    h_.resize(E);
    logits_.resize(V);
    if (!drafting) wanted = LogitsWanted::none;
    head_.eval(batch_tokens_.data(), batch_hidden_.data(), (int64_t)batch_tokens_.size(), wanted,
               wanted == LogitsWanted::argmax ? (void *)argmax : (void *)logits_.data(), h_.data());
    n_head_steps_++;
    synced_ = last + 1;  // every row so far paired a committed token with the target's hidden state
    return drafting;
}

void MtpDrafter::chain_row(MtpHead::RowsJob & job, const int32_t * tokens, int64_t n, const float * hidden, bool drafting) {
    const int64_t E = target_.hparams().n_embd;
    const bool argmax = device_argmax();
    job.head = &head_;
    job.tokens.assign(tokens, tokens + n);
    job.hidden.assign(hidden, hidden + n * E);
    job.wanted = !drafting ? LogitsWanted::none : argmax ? LogitsWanted::argmax : LogitsWanted::last;
    job.out = argmax ? (void *)&chain_argmax_ : (void *)logits_.data();
    job.hidden_out = h_.data();
}

bool MtpDrafter::begin_chain(const std::vector<int32_t> & committed, int64_t n_max, MtpHead::RowsJob & job) {
    chain_ = Draft{};
    chain_history_ = committed;
    chain_n_max_ = n_max;
    chain_evals_ = 0;
    h_.resize(target_.hparams().n_embd);
    logits_.resize(target_.hparams().n_vocab);
    int64_t last = 0;
    chain_drafting_ = catch_up_rows(committed, n_max > 0, last);
    if (batch_tokens_.empty()) return false;  // as propose(): nothing caught up, no draft
    chain_synced_ = last + 1;
    chain_caught_up_ = false;
    chain_row(job, batch_tokens_.data(), (int64_t)batch_tokens_.size(), batch_hidden_.data(), chain_drafting_);
    return true;
}

bool MtpDrafter::end_chain() {
    // the drafted rows are not the pairs the head is trained on: they are rewritten next round
    head_.set_n_past(synced_);
    chain_.cost = step_cost_ * (double)chain_evals_;
    return false;
}

bool MtpDrafter::next_chain(MtpHead::RowsJob & job) {
    n_head_steps_++;
    chain_evals_++;
    if (!chain_caught_up_) {
        chain_caught_up_ = true;
        synced_ = chain_synced_;
        if (!chain_drafting_) return false;
    }
    const int64_t V = target_.hparams().n_vocab;
    int32_t token = chain_argmax_;
    if (!device_argmax()) {
        if (!mask_draft_within(constraint_, chain_.tokens, logits_.data(), V, &q_logits_)) return end_chain();
        Distribution q;
        sampler_.distribution(logits_.data(), V, chain_history_, q);
        token = sampler_.draw(q);
        if (!sampler_.params().greedy()) {
            if (!q_logits_.empty()) sampler_.distribution(q_logits_.data(), V, chain_history_, q);
            chain_.dists.push_back(q);
        }
    }
    chain_.tokens.push_back(token);
    chain_history_.push_back(token);
    if ((int64_t)chain_.tokens.size() == chain_n_max_ || head_.n_past() >= head_.n_ctx()) return end_chain();
    // the next draft: this token with the head's own hidden state for it
    const std::vector<float> h = h_;
    chain_row(job, &token, 1, h.data(), true);
    return true;
}

Draft MtpDrafter::propose(const std::vector<int32_t> & committed, int64_t n_max) {
    // the scheduler's lockstep chain, each step on this head's own graphs
    MtpHead::RowsJob job;
    if (!begin_chain(committed, n_max, job)) return Draft{};
    do {
        head_.eval(job.tokens.data(), job.hidden.data(), (int64_t)job.tokens.size(), job.wanted, job.out, job.hidden_out);
    } while (next_chain(job));
    return take_chain();
}

DraftTree MtpDrafter::propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth) {
    const int64_t V = target_.hparams().n_vocab;
    const bool greedy = sampler_.params().greedy();
    if (!catch_up(committed, budget > 0 && max_depth > 0, LogitsWanted::last, nullptr)) return DraftTree{};

    int64_t n_steps = 1;  // head steps: the catch-up, then one per chain node expanded
    std::vector<int32_t> history;
    // The head's distribution after `node`'s path, for the root and the top-1 chain only: while
    // build_best_first seeds the chain the tree is one chain, and every node it adds then is the
    // next chain node, read by one head step (its token with the head's hidden for its parent's
    // row, at the next position: exactly a chain draft step). Other nodes stay leaves.
    auto dist = [&](const DraftTree & t, int32_t node, Distribution & out) {
        if (node >= 0) {
            if (t.chain_length() != t.size() || head_.n_past() >= head_.n_ctx()) return;  // a leaf
            head_.eval(&t.token[node], h_.data(), 1, LogitsWanted::last, logits_.data(), h_.data());
            n_head_steps_++;
            n_steps++;
        }
        const std::vector<int32_t> path(t.token.begin(), t.token.begin() + (node + 1));  // the chain: nodes 0 .. node
        if (!mask_draft_within(constraint_, path, logits_.data(), V)) return;  // the grammar is complete here: a leaf
        history = committed;
        history.insert(history.end(), path.begin(), path.end());
        (greedy ? ranker_ : sampler_).distribution(logits_.data(), V, history, out);
    };
    BestFirstOptions opts;
    opts.budget = budget;
    opts.max_depth = max_depth;
    if (!greedy) opts.uniform = [this] { return sampler_.uniform(); };
    DraftTree t = build_best_first(dist, opts);
    head_.set_n_past(synced_);  // the drafted rows are rewritten next round
    t.cost = step_cost_ * (double)n_steps;
    return t;
}

}  // namespace deltaspec
