#include "mtp_drafter.h"

#include <algorithm>
#include <stdexcept>

namespace deltaspec {

MtpDrafter::MtpDrafter(Engine & target, const SamplingParams & sampling)
    : target_(target), old_taps_(target.taps()), head_(target, target.n_ctx()), sampler_(sampling),
      zeros_(target.hparams().n_embd, 0.0f) {
    target_.set_taps({(int)target.hparams().n_layer});
    step_cost_ = (double)head_.step_weight_bytes() / (double)target.step_weight_bytes();
}

MtpDrafter::~MtpDrafter() {
    try {
        target_.set_taps(old_taps_);
    } catch (...) {
    }
}

const float * MtpDrafter::target_hidden(int64_t p) const {
    const int64_t E = target_.hparams().n_embd;
    const int64_t row = p - target_.tapped_pos();
    if (row >= 0 && row < target_.n_tapped_rows()) return target_.tapped().data() + row * E;
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

Draft MtpDrafter::propose(const std::vector<int32_t> & committed, int64_t n_max) {
    const int64_t E = target_.hparams().n_embd, V = target_.hparams().n_vocab;
    const int64_t n_past = target_.n_past();  // committed[n_past] (if any) is the target's next input
    if ((int64_t)committed.size() < n_past || n_past < synced_) {
        throw std::logic_error("MtpDrafter: committed tokens and the target's state disagree");
    }
    // Catch up: a row for every position from synced_ up to the newest one (draft 1's input).
    const int64_t last = std::min<int64_t>(n_past, (int64_t)committed.size() - 1);
    const bool drafting = n_max > 0 && last == n_past;
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
    target_.clear_tapped();

    Draft d;
    if (batch_tokens_.empty()) return d;
    head_.set_n_past(synced_);
    const bool device_argmax = sampler_.params().argmax_only();
    const bool greedy = sampler_.params().greedy();
    h_.resize(E);
    logits_.resize(V);
    std::vector<int32_t> history = committed;
    Distribution q;
    const LogitsWanted wanted = !drafting ? LogitsWanted::none : device_argmax ? LogitsWanted::argmax : LogitsWanted::last;
    int32_t argmax = -1;
    head_.eval(batch_tokens_.data(), batch_hidden_.data(), (int64_t)batch_tokens_.size(), wanted,
               device_argmax ? (void *)&argmax : (void *)logits_.data(), h_.data());
    n_head_steps_++;
    synced_ = last + 1;  // every row so far paired a committed token with the target's hidden state
    if (!drafting) return d;

    for (int64_t i = 0; i < n_max; ++i) {
        int32_t token = argmax;
        if (!device_argmax) {
            sampler_.distribution(logits_.data(), V, history, q);
            token = sampler_.draw(q);
            if (!greedy) d.dists.push_back(q);
        }
        d.tokens.push_back(token);
        history.push_back(token);
        if (i + 1 == n_max || head_.n_past() >= head_.n_ctx()) break;
        // the next draft: this token with the head's own hidden state for it
        head_.eval(&token, h_.data(), 1, device_argmax ? LogitsWanted::argmax : LogitsWanted::last,
                   device_argmax ? (void *)&argmax : (void *)logits_.data(), h_.data());
        n_head_steps_++;
    }
    // the drafted rows are not the pairs the head is trained on: they are rewritten next round
    head_.set_n_past(synced_);
    d.cost = step_cost_ * (double)d.tokens.size();
    return d;
}

}  // namespace deltaspec
