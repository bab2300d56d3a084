// A step is a batch of rows: the one contract between whoever decides what to compute (the
// scheduler) and the graph. Decode of N sequences is one row per sequence; prefill chunks, chain
// verify (parent = the previous row) and tree verify (any parent) are rows too.
#pragma once

#include <cstdint>
#include <vector>

namespace deltaspec {

// Struct of arrays, one entry per row.
struct RowBatch {
    std::vector<int32_t> token;
    std::vector<int32_t> pos;      // position in its sequence
    std::vector<int32_t> slot;     // the sequence slot it belongs to
    std::vector<int32_t> parent;   // the row whose state it continues; -1: its slot's committed state
    std::vector<uint8_t> wants_logits;

    void add(int32_t t, int32_t p, int32_t s, int32_t par = -1, bool logits = true) {
        token.push_back(t);
        pos.push_back(p);
        slot.push_back(s);
        parent.push_back(par);
        wants_logits.push_back(logits ? 1 : 0);
    }
    int64_t size() const { return (int64_t)token.size(); }
    void clear() {
        for (auto * v : {&token, &pos, &slot, &parent}) v->clear();
        wants_logits.clear();
    }
};

// DELTASPEC_TEST_BATCH_BUG (test only) plants a bug, so that the tests of batched decoding
// (tests/test_batch.py) can show they notice it: "shared_slot" makes every row of a decode batch
// of 2+ start from the first row's recurrent state (copied over the others'), "position" shifts
// the position of every row after the first by one, "no_move" makes the scheduler forget to copy
// a sequence's state when it moves the sequence into a freed slot, "no_reset" makes it admit a
// sequence into a slot without emptying the slot. Read once per process. Unset or empty in every
// real use; anything else throws std::invalid_argument.
enum class BatchBug { none, shared_slot, position, no_move, no_reset };
BatchBug batch_bug();

// DELTASPEC_TEST_ROWS_BUG (test only) plants a bug so that the tests of speculation for several
// sequences at once (tests/test_batch_speculative.py) can show they notice it: "wrong_parent" makes
// the verify graph (Engine::verify_rows) run the second slot's last row from its grandparent (mask
// and recurrence) when that slot verifies 3+ rows, "swap_keep" makes the scheduler commit to each
// slot the accepted length of the next slot that drafted a chain (cut to the slot's own rows),
// "no_compaction" makes Engine::keep_paths leave a kept tree path's KV rows where the verify wrote
// them, "draft_slot_swap" makes the batched draft model (batch_draft.cpp) run each sequence's
// drafting in the next drafting sequence's draft slot, "taps_slot_swap" makes keep_paths tap the
// first two slots' paths each at the other slot's rows (what a DFlash drafter then reads,
// tests/test_batch_dflash.py). Read once per process; unset or empty in every real use, anything
// else throws std::invalid_argument.
enum class RowsBug { none, wrong_parent, swap_keep, no_compaction, draft_slot_swap, taps_slot_swap };
RowsBug rows_bug();

// DELTASPEC_TEST_PREFILL_BUG (test only) plants a bug so that the tests of prompt chunks of several
// sequences in one pass (tests/test_prefill_rows.py) can show they notice it: "position" gives the rows
// of every slot after the first of an Engine::prefill_rows pass the positions of the first slot's start
// (RoPE of another slot's length; KV rows and mask stay right), "shared_state" starts every slot after the first from the first slot's committed
// recurrent state (copied over its own). Read once per process; unset or empty in every real use,
// anything else throws std::invalid_argument.
enum class PrefillBug { none, position, shared_state };
PrefillBug prefill_bug();

// DELTASPEC_TEST_TREE_BUG (test only) plants a bug so that the tree tests (tests/test_tree_verify.py,
// and generate()'s trees: tests/test_speculative_tree.py ...) can show they notice it, in
// Engine::verify_tree / keep_path and in Engine::verify_rows / keep_paths alike: "sibling_visible"
// shows each row every earlier row of its slot (a causal mask, so siblings and cousins leak into
// each other), "row_position" gives a row the position length + its index instead of length + its
// depth, "no_compaction" leaves the kept KV rows where the verify wrote them, "parent_state" commits
// the recurrent state after the leaf's parent instead of after the leaf, "taps_uncompacted" keeps
// the tapped rows of the batch's first rows instead of the path's (the unaccepted rows' features),
// "stale_keep_graph" reuses the last commit graph when only its KV moves differ (the last path's
// moves done again). Read once per process; unset or empty in every real use, anything else throws
// std::invalid_argument.
enum class TreeBug { none, sibling_visible, row_position, no_compaction, parent_state, taps_uncompacted, stale_keep_graph };
TreeBug tree_bug();

}  // namespace deltaspec
