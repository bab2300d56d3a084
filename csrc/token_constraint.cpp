#include "token_constraint.h"
#include "env.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "draft_tree.h"
#include "drafters.h"
#include "sampler.h"

namespace deltaspec {

GrammarBug grammar_bug() {
    return static_cast<GrammarBug>(planted_choice("DELTASPEC_TEST_GRAMMAR_BUG",
                                                  {"verify_unmasked", "no_cut", "drop_rejected", "tree_row_unmasked",
                                                   "draft_unmasked", "draft_q_unmasked", "pause_blocks_forced",
                                                   "device_unmasked"}));
}

TokenConstraint * drafting_constraint(TokenConstraint * request_constraint) {
    return env_on("DELTASPEC_DRAFT_IN_GRAMMAR") ? request_constraint : nullptr;
}

bool mask_draft_within(TokenConstraint * constraint, const std::vector<int32_t> & path, float * logits,
                       int64_t n_vocab, std::vector<float> * q_logits) {
    if (q_logits != nullptr) q_logits->clear();
    if (constraint == nullptr) return true;
    if (q_logits != nullptr && constraint->bug == GrammarBug::draft_q_unmasked) q_logits->assign(logits, logits + n_vocab);
    return constraint->mask_draft_row(path, logits, n_vocab);
}

bool filter_draft_within(TokenConstraint * constraint, const std::vector<int32_t> & path, Distribution & candidates,
                         int64_t n_vocab) {
    return constraint == nullptr || constraint->filter_draft_row(path, candidates, n_vocab);
}

namespace {

bool allows(const uint32_t * mask, int32_t token) { return (mask[token / 32] >> (token % 32)) & 1u; }

}  // namespace

bool TokenConstraint::apply_bits(const uint32_t * mask, float * logits, int64_t n_vocab) {
    bool any = false;
    for (int64_t w = 0; w * 32 < n_vocab; ++w) {
        const uint32_t bits = mask[w];
        any = any || bits != 0;
        if (bits == ~0u) continue;
        const int64_t end = std::min<int64_t>(32, n_vocab - w * 32);
        for (int64_t b = 0; b < end; ++b) {
            if (!((bits >> b) & 1u)) logits[w * 32 + b] = -INFINITY;
        }
    }
    return any;
}

void TokenConstraint::apply(const uint32_t * mask, float * logits, int64_t n_vocab) {
    // the Python side raises with the grammar's own message first; this guards the samplers,
    // which need at least one finite logit
    if (!apply_bits(mask, logits, n_vocab)) throw std::runtime_error("the grammar allows no token at this point");
    ++n_masked_rows;
}

void TokenConstraint::mask_row(float * logits, int64_t n_vocab) {
    const int64_t n_words = (n_vocab + 31) / 32;
    masks_.assign(n_words, 0u);
    fill_masks(masks_.data(), n_words, {});
    apply(masks_.data(), logits, n_vocab);
}

void TokenConstraint::fill_allowed(uint32_t * allowed, int64_t n_vocab) {
    const int64_t n_words = (n_vocab + 31) / 32;
    masks_.assign(n_words, 0u);
    fill_masks(masks_.data(), n_words, {});
    put_allowed(masks_.data(), allowed, n_vocab);
}

void TokenConstraint::fill_mask_after(uint32_t * mask, int64_t n_words, const std::vector<int32_t> & path) {
    std::vector<uint32_t> rows((path.size() + 1) * (size_t)n_words, 0u);
    fill_masks(rows.data(), n_words, path);
    std::copy(rows.end() - n_words, rows.end(), mask);
}

const uint32_t * TokenConstraint::draft_row_mask(const std::vector<int32_t> & path, int64_t n_vocab) {
    const int64_t n_words = (n_vocab + 31) / 32;
    masks_.assign(n_words, 0u);
    fill_mask_after(masks_.data(), n_words, path);
    ++n_draft_rows;
    return masks_.data();
}

bool TokenConstraint::mask_draft_row(const std::vector<int32_t> & path, float * logits, int64_t n_vocab) {
    if (bug == GrammarBug::draft_unmasked) return true;
    return apply_bits(draft_row_mask(path, n_vocab), logits, n_vocab);
}

bool TokenConstraint::filter_draft_row(const std::vector<int32_t> & path, Distribution & candidates, int64_t n_vocab) {
    if (bug == GrammarBug::draft_unmasked) return !candidates.ids.empty();
    const uint32_t * mask = draft_row_mask(path, n_vocab);
    size_t kept = 0;
    for (size_t i = 0; i < candidates.ids.size(); ++i) {
        if (!allows(mask, candidates.ids[i])) continue;
        candidates.ids[kept] = candidates.ids[i];
        if (i < candidates.probs.size()) candidates.probs[kept] = candidates.probs[i];
        ++kept;
    }
    candidates.ids.resize(kept);
    if (candidates.probs.size() > kept) candidates.probs.resize(kept);
    return kept > 0;
}

void TokenConstraint::cut_draft(Draft & draft) {
    const int64_t k = (int64_t)draft.tokens.size();
    if (k == 0 || bug == GrammarBug::no_cut) return;
    int64_t keep = check_draft(draft.tokens);
    // A forbidden token that was drawn from a distribution q (draft.dists non-empty) stays, as the
    // draft's last: verification rejects it (its masked probability is 0) and draws its row's
    // token from norm(max(0, p - q)), as rejection sampling must for output distributed as plain
    // constrained sampling. Cutting it would draw that token from p instead, over-weighting what q
    // under-proposes. A deterministic draft (q one-hot on the token) loses nothing by the cut: the
    // residual of p against a token p forbids is p itself.
    if (keep < k && !draft.dists.empty() && bug != GrammarBug::drop_rejected) ++keep;
    n_cut_tokens += k - keep;
    draft.tokens.resize(keep);
    if (!draft.dists.empty()) draft.dists.resize(keep);
}

void TokenConstraint::each_verify_row_mask(const Draft & draft, int64_t n_vocab, const RowMask & put) {
    if (bug == GrammarBug::verify_unmasked) return;
    const int64_t k = (int64_t)draft.tokens.size();
    const int64_t n_words = (n_vocab + 31) / 32;
    masks_.assign((k + 1) * n_words, 0u);
    fill_masks(masks_.data(), n_words, draft.tokens);
    for (int64_t i = 0; i <= k; ++i) {
        const uint32_t * mask = masks_.data() + i * n_words;
        put(i, mask);
        // a forbidden draft (kept for rejection sampling, see cut_draft) is rejected at its row,
        // so no row after it is read: the rule has no state there
        if (i < k && !allows(mask, draft.tokens[i])) break;
    }
}

void TokenConstraint::mask_verify_rows(const Draft & draft, float * rows, int64_t n_vocab) {
    each_verify_row_mask(draft, n_vocab, [&](int64_t row, const uint32_t * mask) { apply(mask, rows + row * n_vocab, n_vocab); });
}

void TokenConstraint::fill_verify_allowed(const Draft & draft, uint32_t * allowed, int64_t n_vocab) {
    const int64_t n_words = (n_vocab + 31) / 32;
    std::fill(allowed, allowed + (draft.tokens.size() + 1) * n_words, ~0u);  // rows no walk reads stay free
    each_verify_row_mask(draft, n_vocab, [&](int64_t row, const uint32_t * mask) { put_allowed(mask, allowed + row * n_words, n_vocab); });
}

void TokenConstraint::put_allowed(const uint32_t * mask, uint32_t * allowed, int64_t n_vocab) {
    const int64_t n_words = (n_vocab + 31) / 32;
    if (std::all_of(mask, mask + n_words, [](uint32_t w) { return w == 0; })) {
        throw std::runtime_error("the grammar allows no token at this point");  // as apply() says it
    }
    if (bug == GrammarBug::device_unmasked) {
        std::fill(allowed, allowed + n_words, ~0u);
    } else {
        std::copy(mask, mask + n_words, allowed);
    }
    ++n_masked_rows;
}

std::vector<uint8_t> TokenConstraint::allowed_nodes(const DraftTree & tree) {
    std::vector<uint8_t> allowed(tree.size(), 0);
    for (int32_t i = 0; i < (int32_t)tree.size(); ++i) {
        const int32_t par = tree.parent[i];
        if (par >= 0 && !allowed[par]) continue;  // below a forbidden node
        const std::vector<int32_t> path = tree.path_tokens(i);
        allowed[i] = check_draft(path) == (int64_t)path.size();
    }
    return allowed;
}

void TokenConstraint::prune_tree(DraftTree & tree) {
    const int64_t n = tree.size();
    if (n == 0 || bug == GrammarBug::no_cut) return;
    const std::vector<uint8_t> allowed = allowed_nodes(tree);
    DraftTree out;
    out.dists = tree.dists;
    out.root_child_q = tree.root_child_q;
    out.draw = tree.draw;
    out.cost = tree.cost;
    std::vector<int32_t> index(n, -1);  // node -> its index in `out`, -1 when cut
    for (int32_t i = 0; i < (int32_t)n; ++i) {
        const int32_t par = tree.parent[i];
        if (par >= 0 && (index[par] < 0 || !allowed[par])) continue;  // under a cut node or a kept forbidden leaf
        const bool drawn = tree.children_q(par) >= 0;
        if (!allowed[i] && !(drawn && bug != GrammarBug::drop_rejected)) continue;
        index[i] = out.add(tree.token[i], par < 0 ? -1 : index[par], allowed[i] ? tree.child_q[i] : -1);
    }
    n_cut_tokens += n - out.size();
    tree = std::move(out);
}

void TokenConstraint::each_tree_row_mask(const DraftTree & tree, int64_t n_vocab, const RowMask & put) {
    if (bug == GrammarBug::verify_unmasked) return;
    const int64_t n = tree.size();
    const int64_t n_words = (n_vocab + 31) / 32;
    const std::vector<uint8_t> allowed = allowed_nodes(tree);
    std::vector<uint8_t> masked(n + 1, 0);  // by row: 0 the committed state's, 1 + i node i's
    auto mask = [&](int64_t row, const uint32_t * m) {
        masked[row] = 1;
        if (row == 1 && bug == GrammarBug::tree_row_unmasked) return;
        put(row, m);
    };
    // deepest nodes first: the masks along one node's path serve its ancestors' rows too
    for (int32_t i = (int32_t)n - 1; i >= 0; --i) {
        if (!allowed[i] || masked[i + 1]) continue;
        const std::vector<int32_t> path = tree.path_tokens(i);
        const int64_t d = (int64_t)path.size();
        masks_.assign((d + 1) * n_words, 0u);
        fill_masks(masks_.data(), n_words, path);
        int32_t node = i;
        for (int64_t j = d; j >= 0; --j) {  // mask row j is the state after path[0 .. j): node's ancestor at depth j
            const int64_t row = node + 1;
            if (!masked[row]) mask(row, masks_.data() + j * n_words);
            node = j > 0 ? tree.parent[node] : -1;
        }
    }
    if (!masked[0]) {  // no node allowed: the committed state's row alone
        masks_.assign(n_words, 0u);
        fill_masks(masks_.data(), n_words, {});
        mask(0, masks_.data());
    }
}

void TokenConstraint::mask_tree_rows(const DraftTree & tree, float * rows, int64_t n_vocab) {
    each_tree_row_mask(tree, n_vocab, [&](int64_t row, const uint32_t * mask) { apply(mask, rows + row * n_vocab, n_vocab); });
}

void TokenConstraint::fill_tree_allowed(const DraftTree & tree, uint32_t * allowed, int64_t n_vocab) {
    const int64_t n_words = (n_vocab + 31) / 32;
    std::fill(allowed, allowed + (tree.size() + 1) * n_words, ~0u);  // a forbidden node's row stays free
    each_tree_row_mask(tree, n_vocab, [&](int64_t row, const uint32_t * mask) { put_allowed(mask, allowed + row * n_words, n_vocab); });
}

}  // namespace deltaspec
