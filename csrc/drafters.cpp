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

}  // namespace deltaspec
