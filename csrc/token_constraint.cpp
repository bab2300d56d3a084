#include "token_constraint.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "drafters.h"

namespace deltaspec {

GrammarBug grammar_bug() {
    const char * env = std::getenv("DELTASPEC_TEST_GRAMMAR_BUG");
    const std::string v = env ? env : "";
    if (v.empty()) return GrammarBug::none;
    if (v == "verify_unmasked") return GrammarBug::verify_unmasked;
    if (v == "no_cut") return GrammarBug::no_cut;
    if (v == "drop_rejected") return GrammarBug::drop_rejected;
    throw std::invalid_argument("DELTASPEC_TEST_GRAMMAR_BUG (test only) must be unset, 'verify_unmasked', 'no_cut' or "
                                "'drop_rejected', not '" + v + "'");
}

namespace {

bool allows(const uint32_t * mask, int32_t token) { return (mask[token / 32] >> (token % 32)) & 1u; }

}  // namespace

void TokenConstraint::apply(const uint32_t * mask, float * logits, int64_t n_vocab) {
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
    // the Python side raises with the grammar's own message first; this guards the samplers,
    // which need at least one finite logit
    if (!any) throw std::runtime_error("the grammar allows no token at this point");
    ++n_masked_rows;
}

void TokenConstraint::mask_row(float * logits, int64_t n_vocab) {
    const int64_t n_words = (n_vocab + 31) / 32;
    masks_.assign(n_words, 0u);
    fill_masks(masks_.data(), n_words, {});
    apply(masks_.data(), logits, n_vocab);
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

void TokenConstraint::mask_verify_rows(const Draft & draft, float * rows, int64_t n_vocab) {
    if (bug == GrammarBug::verify_unmasked) return;
    const int64_t k = (int64_t)draft.tokens.size();
    const int64_t n_words = (n_vocab + 31) / 32;
    masks_.assign((k + 1) * n_words, 0u);
    fill_masks(masks_.data(), n_words, draft.tokens);
    for (int64_t i = 0; i <= k; ++i) {
        const uint32_t * mask = masks_.data() + i * n_words;
        apply(mask, rows + i * n_vocab, n_vocab);
        // a forbidden draft (kept for rejection sampling, see cut_draft) is rejected at its row,
        // so no row after it is read: the rule has no state there
        if (i < k && !allows(mask, draft.tokens[i])) break;
    }
}

}  // namespace deltaspec
