// Constrained decoding (grammars, JSON schemas): a rule that says which tokens may come next.
//
// The decode loops use it in three places, a few lines each:
//   - before a token is sampled, its logit row is masked (forbidden tokens get -inf, so greedy,
//     top-k/p, min-p and the penalties only ever see allowed tokens)        -> mask_row
//     or, where the row is reduced on the device (plain decoding's argmax or top candidates), the
//     mask goes with it and the device applies it                           -> fill_allowed
//   - every committed token advances the rule (the Emitter does it)         -> commit
//   - speculative decoding cuts a draft after its longest allowed prefix before verification
//     (cut_draft), and masks each verify row with the rule's state after the drafts before that
//     row (mask_verify_rows), so that accepting and the correction / bonus token see exactly what
//     plain constrained decoding would see at that position. A draft tree is pruned the same way
//     (prune_tree) and each of its rows masked with the state after its node's path (mask_tree_rows).
//   - a draft model or the MTP head drafts within the rule: each of its rows masked with the state
//     after the tokens it drafted before (mask_draft_row), so that what it proposes is allowed
//     (drafters.h, mtp_drafter.h); DFlash keeps the candidates of its block slots that the rule
//     allows there (filter_draft_row, dflash_drafter.h).
//
// The rule itself is implemented in Python (deltaspec.constraint, around llguidance's matcher)
// through the pybind11 trampoline of constraint_bindings.cpp; C++ only asks it for bitmasks.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace deltaspec {

struct Distribution;
struct Draft;
struct DraftTree;

// Test only: constraint-path bugs planted so that tests/test_structured.py can show it catches
// them. Read from DELTASPEC_TEST_GRAMMAR_BUG when a constraint is made: unset or empty (every real
// use) is no bug; "verify_unmasked" leaves verify rows unmasked; "no_cut" verifies drafts the
// rule forbids; "drop_rejected" cuts a sampled draft before (not after) its first forbidden token,
// which biases sampled output (see cut_draft; in a tree: removes a forbidden sampled child instead
// of keeping it for rejection); "tree_row_unmasked" leaves one row of a draft tree's verify batch
// (node 0's, the top-1 chain's first) unmasked; "draft_unmasked" leaves a drafter's rows
// unmasked (it drafts as if unconstrained, its forbidden proposals cut as before); "draft_q_unmasked"
// has a sampling drafter's chain draw from its masked row but report the unmasked row's
// distribution as q, which biases sampled output; in a DFlash tree, a node's children drawn from
// its depth's top K cut to the allowed ones but q reported as the uncut top K. (A draft
// model's or the MTP head's tree children are drawn from the very distribution they report, so
// those trees have no such mismatch to plant.) "pause_blocks_forced": while speculation pauses
// the drafter, the grammar's forced tokens are not drafted either (one pass per forced token).
// "device_unmasked": a row whose mask the device applies (fill_allowed) gets every token allowed, as
// if the mask never reached the device. Any other value is an error.
enum class GrammarBug {
    none, verify_unmasked, no_cut, drop_rejected, tree_row_unmasked, draft_unmasked, draft_q_unmasked, pause_blocks_forced,
    device_unmasked
};
GrammarBug grammar_bug();

class TokenConstraint;

// The constraint a draft model, the MTP head or DFlash drafts within (DraftJob::constraint, MtpDrafter::constrain, DFlashDrafter::constrain): the request's, unless
// DELTASPEC_DRAFT_IN_GRAMMAR=0 (A/B runs, and the tests of cutting forbidden proposals), which
// leaves the drafter unconstrained and its drafts cut.
TokenConstraint * drafting_constraint(TokenConstraint * request_constraint);

// A draft model's logit row masked within `constraint` (nullptr: left as it is) after `path`, the
// tokens drafted before it (TokenConstraint::mask_draft_row); false when the rule allows nothing
// there. q_logits (a chain's drafter; nullptr for trees, whose children are drawn from the very
// distribution they report): emptied, or, under the planted bug draft_q_unmasked, the unmasked
// row, which the drafter then reports its q from.
bool mask_draft_within(TokenConstraint * constraint, const std::vector<int32_t> & path, float * logits,
                       int64_t n_vocab, std::vector<float> * q_logits = nullptr);

// A block drafter's candidates for one draft row (DFlash: a block slot's top K, best first) cut to
// those `constraint` (nullptr: all kept) allows after `path`, the tokens drafted before that row
// (TokenConstraint::filter_draft_row); false when none is left.
bool filter_draft_within(TokenConstraint * constraint, const std::vector<int32_t> & path, Distribution & candidates,
                         int64_t n_vocab);

class TokenConstraint {
  public:
    TokenConstraint() : bug(grammar_bug()) {}
    virtual ~TokenConstraint() = default;

    // Bitmasks of allowed tokens, one row of n_words = ceil(n_vocab / 32) words per position:
    // token t is allowed when bit (t % 32) of row[t / 32] is set. Row i (0 <= i <= drafts.size())
    // is the set allowed after the committed tokens and drafts[0 .. i); rows after a draft token
    // that the rule forbids are unspecified. Commits nothing.
    virtual void fill_masks(uint32_t * masks, int64_t n_words, const std::vector<int32_t> & drafts) = 0;
    // Appends a token to the committed ones (one that the last mask allowed).
    virtual void commit(int32_t token) = 0;
    // How many of `tokens`, from the first, the rule allows after the committed tokens. Commits nothing.
    virtual int64_t check_draft(const std::vector<int32_t> & tokens) = 0;
    // Tokens the rule forces after the committed ones (the only way on), drafted first (grammar_drafter.h); may be empty.
    virtual std::vector<int32_t> forced_tokens() { return {}; }
    // Whether every token is allowed at every row after the committed tokens followed by a prefix of
    // any path through `along` (empty: the next row alone; a chain's drafts; a draft tree's nodes,
    // which a rule may judge as a set): a reasoning budget that has not run out, a lazy grammar before
    // its trigger. Such rows are as free as an unconstrained request's, so they may take the
    // device's argmax or top rows instead of crossing over whole to be masked. False when unsure.
    virtual bool allows_every_token(const std::vector<int32_t> & along) { (void)along; return false; }

    // The tokens allowed after the committed ones and `path` (tokens the rule allows: what a draft
    // model drafted so far), as one row of fill_masks. Commits nothing. The base class asks
    // fill_masks for every row up to it; a subclass may follow the path incrementally instead.
    virtual void fill_mask_after(uint32_t * mask, int64_t n_words, const std::vector<int32_t> & path);

    // Masks one row of logits with the tokens allowed after the committed ones.
    void mask_row(float * logits, int64_t n_vocab);
    // The same row's mask as bits (one row of fill_masks), for a pass that applies it on the device
    // (Engine's `allowed`: the argmax or top candidates of the masked row, not the row itself, cross
    // to the host); counted as a masked row; throws where the rule allows no token, as mask_row does.
    void fill_allowed(uint32_t * mask, int64_t n_vocab);
    // Masks a draft model's logit row after the committed tokens and `path` (fill_mask_after), so
    // that it drafts within the rule (BatchModelDrafter); false when the rule allows
    // nothing there (the text is complete): the draft ends before that row.
    bool mask_draft_row(const std::vector<int32_t> & path, float * logits, int64_t n_vocab);
    // The same for a drafter that proposes from a few candidates, not a whole row (DFlash's top K):
    // keeps those allowed after the committed tokens and `path`, in their order; false when none is.
    bool filter_draft_row(const std::vector<int32_t> & path, Distribution & candidates, int64_t n_vocab);
    // Cuts a draft to what verification needs (see the .cpp), counting the tokens cut.
    void cut_draft(Draft & draft);
    // Masks the verify rows of [last committed, drafts...]: row i with the state after drafts[0 .. i).
    void mask_verify_rows(const Draft & draft, float * rows, int64_t n_vocab);
    // The same rows' masks as bits (draft.tokens.size() + 1 rows of ceil(n_vocab / 32) words), for a
    // verify that applies them on the device; the rows mask_verify_rows leaves as they are allow
    // every token. Counted as masked rows.
    void fill_verify_allowed(const Draft & draft, uint32_t * allowed, int64_t n_vocab);
    // Prunes a draft tree (draft_tree.h) before verification: a node the rule forbids after its
    // path goes, with everything below it; except that a node drawn from a q (its parent's
    // children_q) stays, as a leaf, for the rejection rule to reject (what cut_draft does with a
    // sampled chain's first forbidden token; removing it would draw its parent row's token from p
    // instead of the residual). Counts the nodes cut.
    void prune_tree(DraftTree & tree);
    // Masks the verify rows of [last committed, node 0, node 1, ...]: row 0 with the state after the
    // committed tokens, row 1 + i with the state after node i's path. A forbidden node's row (the
    // sampled leaves prune_tree keeps) is left as it is: no walk reaches a node its parent's masked
    // row gives probability 0.
    void mask_tree_rows(const DraftTree & tree, float * rows, int64_t n_vocab);
    // The same rows' masks as bits (tree.size() + 1 rows), for a verify that applies them on the
    // device; a row mask_tree_rows leaves as it is allows every token. Counted as masked rows.
    void fill_tree_allowed(const DraftTree & tree, uint32_t * allowed, int64_t n_vocab);

    // What the constraint did, for stats and for tests that the path ran.
    int64_t n_masked_rows = 0;  // logit rows masked
    int64_t n_cut_tokens = 0;   // draft tokens cut before verification
    int64_t n_forced_tokens = 0;  // forced tokens proposed as drafts (take_forced)
    int64_t n_draft_rows = 0;     // drafter rows masked (mask_draft_row, filter_draft_row)
    const GrammarBug bug;

  private:
    void apply(const uint32_t * mask, float * logits, int64_t n_vocab);
    // `mask` as a row of a device's allowed tokens (fill_allowed, fill_verify_allowed): copied, or
    // every token under the planted bug device_unmasked; throws where it allows nothing, as apply()
    void put_allowed(const uint32_t * mask, uint32_t * allowed, int64_t n_vocab);
    // put(row, mask) for each verify row of [last committed, drafts...] that mask_verify_rows masks
    using RowMask = std::function<void(int64_t row, const uint32_t * mask)>;
    void each_verify_row_mask(const Draft & draft, int64_t n_vocab, const RowMask & put);
    // the same for the rows of a draft tree that mask_tree_rows masks
    void each_tree_row_mask(const DraftTree & tree, int64_t n_vocab, const RowMask & put);
    // the tokens allowed after the committed ones and `path` (fill_mask_after into masks_), counted
    // as a drafter row; valid until the next call
    const uint32_t * draft_row_mask(const std::vector<int32_t> & path, int64_t n_vocab);
    // sets the logits of the tokens `mask` forbids to -inf; whether it allows any
    static bool apply_bits(const uint32_t * mask, float * logits, int64_t n_vocab);
    // per node of the tree: whether the rule allows its path after the committed tokens
    std::vector<uint8_t> allowed_nodes(const DraftTree & tree);
    std::vector<uint32_t> masks_;
};

}  // namespace deltaspec
