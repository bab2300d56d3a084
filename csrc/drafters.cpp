#include "drafters.h"

#include <algorithm>

namespace deltaspec {

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

ModelDrafter::ModelDrafter(Engine & draft, const SamplingParams & sampling)
    : draft_(draft), sampler_(sampling), logits_(draft.hparams().n_vocab) {
    draft_.reset();
}

void ModelDrafter::catch_up(const std::vector<int32_t> & committed) {
    // the draft holds committed[0 .. n_synced_); evaluate the rest in one batch
    const int64_t n = (int64_t)committed.size();
    draft_.eval(committed.data() + n_synced_, n - n_synced_, LogitsWanted::last, logits_.data());
    n_synced_ = n;
}

Draft ModelDrafter::propose(const std::vector<int32_t> & committed, int64_t n_max) {
    Draft d;
    if (n_synced_ > 0) draft_.restore_checkpoint();  // forget the previous round's drafted tokens
    if ((int64_t)committed.size() > n_synced_) catch_up(committed);
    draft_.checkpoint();
    const bool greedy = sampler_.params().greedy();
    std::vector<int32_t> history = committed;
    Distribution q;
    for (int64_t i = 0; i < n_max && draft_.n_past() < draft_.n_ctx(); ++i) {
        sampler_.distribution(logits_.data(), (int64_t)logits_.size(), history, q);
        const int32_t token = sampler_.draw(q);
        d.tokens.push_back(token);
        if (!greedy) d.dists.push_back(q);
        history.push_back(token);
        if (i + 1 < n_max) draft_.eval(&token, 1, LogitsWanted::last, logits_.data());
    }
    return d;
}

}  // namespace deltaspec
