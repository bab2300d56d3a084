#include "tree_round.h"

#include "top_rows.h"

namespace deltaspec {

bool is_chain(const DraftTree & tree) { return tree.chain_length() == tree.size(); }

RowBatch tree_rows(const Engine & target, const DraftTree & tree, int32_t root) {
    RowBatch rows;
    const int32_t p0 = (int32_t)target.n_past(), slot = (int32_t)target.current_slot();
    rows.add(root, p0, slot, -1);
    for (int64_t i = 0; i < tree.size(); ++i) rows.add(tree.token[i], p0 + tree.depth[i], slot, tree.parent[i] + 1);
    return rows;
}

TreeWalk verify_and_walk_tree(Engine & target, const DraftTree & tree, int32_t root, VerifyRead read,
                              Sampler & sampler, std::vector<int32_t> & history, TreeRule rule, TreeRuleBug bug,
                              std::vector<float> & logits, std::vector<int32_t> & words,
                              TokenConstraint * constraint, std::vector<float> * unmasked) {
    const RowBatch rows = tree_rows(target, tree, root);
    const int64_t T = rows.size(), n_vocab = target.hparams().n_vocab;
    // rows reduced on the device take the grammar's masks with them
    std::vector<uint32_t> allowed;
    if (constraint && read != VerifyRead::logits) {
        allowed.resize(T * target.allowed_words());
        constraint->fill_tree_allowed(tree, allowed.data(), n_vocab);
    }
    const uint32_t * masks = allowed.empty() ? nullptr : allowed.data();
    // the rows in the same order either way: row 0 the root, row 1 + i node i
    if (read == VerifyRead::argmax) {
        words.resize(T);
        if (is_chain(tree)) {
            target.eval_verify_argmax(rows.token.data(), T, words.data(), masks);
        } else {
            target.verify_tree(rows, LogitsWanted::argmax_all, words.data(), masks);
        }
        return walk_tree_argmax(tree, words.data(), history);
    }
    if (read == VerifyRead::top) {
        const int64_t W = target.top_row_words();
        words.resize(T * W);
        if (is_chain(tree)) {
            target.eval_verify_top(rows.token.data(), T, words.data(), masks);
        } else {
            target.verify_tree(rows, LogitsWanted::top_all, words.data(), masks);
        }
        const RowDistribution p_of = [&](int64_t r, const std::vector<int32_t> &, Distribution & p) {
            const TopRow top = top_row(words.data() + r * W, target.top_k());
            sampler.distribution_top(top.logit, top.id, top.k, p);
        };
        return walk_tree(tree, p_of, n_vocab, sampler, history, rule, bug);
    }
    logits.resize(T * n_vocab);
    if (is_chain(tree)) {
        target.eval_verify(rows.token.data(), T, logits.data());
    } else {
        target.verify_tree(rows, LogitsWanted::all, logits.data());
    }
    if (constraint) {
        if (unmasked) unmasked->assign(logits.begin(), logits.end());
        constraint->mask_tree_rows(tree, logits.data(), n_vocab);
    }
    return walk_tree(tree, logits.data(), n_vocab, sampler, history, rule, bug);
}

void keep_walk(Engine & target, const DraftTree & tree, const TreeWalk & walk) {
    if (is_chain(tree)) {  // the accepted path is the batch's first rows
        target.keep(1 + (int64_t)walk.path.size());
        return;
    }
    std::vector<int32_t> kept = {0};  // the root row, then the accepted nodes' rows
    for (int32_t node : walk.path) kept.push_back(node + 1);
    target.keep_path(kept.data(), (int64_t)kept.size());
}

}  // namespace deltaspec
