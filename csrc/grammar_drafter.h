// Drafts what a grammar forces: where the committed text leaves the grammar a single way on (a
// JSON key after its opening quote, a literal), those tokens are proposed as the draft, and only
// otherwise the request's drafter proposes (scheduler_spec.cpp). The target verifies them as any draft, so output is
// unchanged; forced tokens are accepted (the masked target gives them probability 1, and the
// accept rule then draws no random number, so sampling consumes its stream as plain decoding at
// those positions does), which saves a target pass per forced token but the last.
#pragma once

#include <vector>

#include "drafters.h"
#include "token_constraint.h"

namespace deltaspec {

// The tokens the grammar forces next (where it leaves one way on), at most n_max, counted as
// forced: the draft of a constrained request, deterministic (no q) and free to propose. Empty when
// it forces nothing (nothing counted).
std::vector<int32_t> take_forced(TokenConstraint & constraint, int64_t n_max);

// take_forced as a round's draft: with a tree budget (> 0), a chain tree of at most
// min(budget, n_max) nodes in `tree`, else at most n_max tokens in `draft`. False when the grammar
// forces nothing. What a constrained sequence drafts first, also while a pause stops its drafter.
bool draft_forced(TokenConstraint & constraint, int64_t budget, int64_t n_max, Draft & draft, DraftTree & tree);

}  // namespace deltaspec
