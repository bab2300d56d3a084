// Walking a verified draft tree: which path the target accepts and which token it adds after it.
// The target has scored the rows [root, node 0, node 1, ...] (root = the last committed token),
// each row predicting the token after its node: row 0 continues the slot's committed state, row
// n + 1 has parent row tree.parent[n] + 1 and position committed + tree.depth[n]. After the walk
// the slot keeps rows 0 and path[i] + 1, and tree.token[path[i]] then `next` are emitted.
//
// Which rule: rejection. On chosen children (no q) it has the same law as match; on children
// drawn from q it accepts more (bench/tree_acceptance.py). Match is the fallback that needs no q.
#pragma once

#include <cstdint>
#include <vector>

#include "draft_tree.h"
#include "sampler.h"

namespace deltaspec {

enum class TreeRule {
    // Per-node target sampling and matching (DDTree's walk): draw y from the target's p at the
    // node, move to the child whose token is y, else stop and emit y. Exact for any tree; q unused.
    match,
    // Multi-draft rejection sampling (SpecInfer; recursive for children drawn without
    // replacement): the children are tried in order, child c accepted with min(1, p(c)/q(c)); a
    // rejection replaces p with norm(max(0, p - q)) (and, without replacement, removes c from q);
    // when all are rejected the residual p gives the token. Deterministic children count as
    // one-hot q. Exact when the children were drawn as DraftTree::child_q / draw say.
    rejection,
};

// With greedy sampling parameters p is one-hot on the (penalized) argmax, so both rules follow the
// target's argmax.

struct TreeWalk {
    std::vector<int32_t> path;  // accepted nodes, root's child first
    int32_t next = -1;          // the target's token after the path (correction or bonus)
};

// Test only: a wrong rule, planted so that the exact-marginal tests (tests/test_tree_walk.py) can
// show they reject it. Read from DELTASPEC_TEST_WRONG_TREE_RULE by tree_rule_bug(): unset or empty
// (every real use) is right; "fresh_next" (match) draws the token after a miss anew from p instead
// of keeping the y that missed; "no_residual" (rejection) keeps p after a rejected child instead of
// norm(max(0, p - q)); "no_q_update" (rejection) leaves q whole after a rejected child that was
// drawn without replacement. Anything else throws std::invalid_argument. (Treating drawn children
// as one-hot would not be a wrong rule: that is matching, exact for any tree, only accepting less.)
enum class TreeRuleBug { none, fresh_next, no_residual, no_q_update };
TreeRuleBug tree_rule_bug();

// rows: (1 + tree.size()) x n_vocab target logits, row 0 the root's. The sampler's chain turns
// each row into p with `history` (prompt + committed tokens, the root's token last); the accepted
// tokens are appended to `history`, `next` is not.
TreeWalk walk_tree(const DraftTree & tree, const float * rows, int64_t n_vocab, Sampler & sampler,
                   std::vector<int32_t> & history, TreeRule rule, TreeRuleBug bug = TreeRuleBug::none);
// The same walk with row r's p read through `p_of` (sampler.h: row 0 the root's, row 1 + i node i's).
TreeWalk walk_tree(const DraftTree & tree, const RowDistribution & p_of, int64_t n_vocab, Sampler & sampler,
                   std::vector<int32_t> & history, TreeRule rule, TreeRuleBug bug = TreeRuleBug::none);

// Greedy without penalties from the device's argmax of every row (1 + tree.size() ids): follow the
// child whose token is the argmax.
TreeWalk walk_tree_argmax(const DraftTree & tree, const int32_t * argmax, std::vector<int32_t> & history);

}  // namespace deltaspec
