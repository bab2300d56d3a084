#include "grammar_drafter.h"

#include <algorithm>

namespace deltaspec {

void GrammarDrafter::begin(const std::vector<int32_t> & prompt) {
    if (inner_) inner_->begin(prompt);
}

Draft GrammarDrafter::propose(const std::vector<int32_t> & committed, int64_t n_max) {
    Draft d;
    d.tokens = constraint_.forced_tokens();
    if (d.tokens.empty()) return inner_ ? inner_->propose(committed, n_max) : d;
    if ((int64_t)d.tokens.size() > n_max) d.tokens.resize(n_max);
    constraint_.n_forced_tokens += (int64_t)d.tokens.size();
    return d;  // deterministic (no q) and free to propose (cost 0)
}

DraftTree GrammarDrafter::propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth) {
    std::vector<int32_t> forced = constraint_.forced_tokens();
    if (forced.empty()) return inner_ ? inner_->propose_tree(committed, budget, max_depth) : DraftTree{};
    if ((int64_t)forced.size() > std::min(budget, max_depth)) forced.resize(std::min(budget, max_depth));
    constraint_.n_forced_tokens += (int64_t)forced.size();
    return chain_tree(forced);  // deterministic and free, as propose()'s
}

}  // namespace deltaspec
