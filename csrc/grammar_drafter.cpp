#include "grammar_drafter.h"

#include <algorithm>

namespace deltaspec {

std::vector<int32_t> take_forced(TokenConstraint & constraint, int64_t n_max) {
    std::vector<int32_t> forced = constraint.forced_tokens();
    if ((int64_t)forced.size() > n_max) forced.resize(std::max<int64_t>(0, n_max));
    constraint.n_forced_tokens += (int64_t)forced.size();
    return forced;
}

bool draft_forced(TokenConstraint & constraint, int64_t budget, int64_t n_max, Draft & draft, DraftTree & tree) {
    if (budget > 0) {
        tree = chain_tree(take_forced(constraint, std::min(budget, n_max)));
        return !tree.empty();
    }
    draft.tokens = take_forced(constraint, n_max);  // deterministic (no q) and free to propose (cost 0)
    return !draft.tokens.empty();
}

}  // namespace deltaspec
