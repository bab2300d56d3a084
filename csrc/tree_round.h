// One round of tree speculation on the target: verify a draft tree in one pass (Engine::verify_tree),
// walk it (tree_walk.h), keep the accepted path (Engine::keep_path). The speculative loop
// (speculative.cpp) runs it when asked for trees. A tree that is one chain (a drafter that did not
// branch, or a budget no larger than the seeded chain) takes the chain verify instead
// (Engine::eval_verify / keep): on CUDA our chain kernel runs a chain ~30% faster per layer than
// the rows op, and keeping a prefix moves no KV rows.
#pragma once

#include <cstdint>
#include <vector>

#include "draft_tree.h"
#include "engine.h"
#include "sampler.h"
#include "token_constraint.h"
#include "tree_walk.h"

namespace deltaspec {

// Rows of the verify batch: row 0 the root (`root`, the last committed token not yet in the
// target's state), row 1 + i the tree's node i, its parent row 1 + parent (0 for the root's children).
RowBatch tree_rows(const Engine & target, const DraftTree & tree, int32_t root);

// What a verify pass hands to the host per row: the argmax id (greedy without penalties), the top
// candidates (a sampler that they decide, no grammar: top_rows.h), or the whole row of logits.
enum class VerifyRead { argmax, top, logits };

// Verifies `tree` after `root` in one target pass and walks it, each row read as `read` says (the
// argmax ids into `words`, top rows into `words` at Engine::top_row_words() per row, logits into
// `logits`: row 0 the root, row 1 + i node i), through the sampler and `rule` unless greedy.
// `history` (prompt + committed tokens, root last) gets the accepted tokens; the walk's `next` is
// the target's token after them. The target then holds the verify batch: keep_walk commits root +
// the accepted path. A grammar (`constraint`, optional) masks each row with its state after the
// row's path: whole rows (read = logits) on the host before the walk (TokenConstraint::mask_tree_rows;
// `unmasked`, when given, gets the rows as they were before: the raw logits that log-probabilities
// report), rows reduced on the device (argmax, top) there, their masks sent with them
// (TokenConstraint::fill_tree_allowed).
TreeWalk verify_and_walk_tree(Engine & target, const DraftTree & tree, int32_t root, VerifyRead read,
                              Sampler & sampler, std::vector<int32_t> & history, TreeRule rule, TreeRuleBug bug,
                              std::vector<float> & logits, std::vector<int32_t> & words,
                              TokenConstraint * constraint = nullptr, std::vector<float> * unmasked = nullptr);
void keep_walk(Engine & target, const DraftTree & tree, const TreeWalk & walk);

// Whether node i of the tree is the child of node i - 1 for every i (the chain verify serves it).
bool is_chain(const DraftTree & tree);

}  // namespace deltaspec
