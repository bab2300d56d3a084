#include "grammar_drafter.h"

#include <algorithm>

namespace deltaspec {

void GrammarDrafter::begin(const std::vector<int32_t> & prompt) {
    if (inner_) inner_->begin(prompt);
}

std::vector<int32_t> take_forced(TokenConstraint & constraint, int64_t n_max) {
    std::vector<int32_t> forced = constraint.forced_tokens();
    if ((int64_t)forced.size() > n_max) forced.resize(std::max<int64_t>(0, n_max));
    constraint.n_forced_tokens += (int64_t)forced.size();
    return forced;
}

Draft GrammarDrafter::propose(const std::vector<int32_t> & committed, int64_t n_max) {
    Draft d;
    d.tokens = take_forced(constraint_, n_max);
    if (d.tokens.empty()) return inner_ ? inner_->propose(committed, n_max) : d;
    return d;
}

DraftTree GrammarDrafter::propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth) {
    const std::vector<int32_t> forced = take_forced(constraint_, std::min(budget, max_depth));
    if (forced.empty()) return inner_ ? inner_->propose_tree(committed, budget, max_depth) : DraftTree{};
    return chain_tree(forced);
}

}  // namespace deltaspec
