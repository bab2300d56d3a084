#include "slot_history.h"
#include "env.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace deltaspec {

namespace {

// Bugs the tests plant (DELTASPEC_TEST_SLOT_BUG) to see each of their claims fail once; unset,
// nothing changes. length_only: a history "matches" any prompt at least one token longer (another
// client's conversation resumes in this one); no_copy: the matching history is not copied into the
// slot that runs the request (it resumes from whatever that slot held); no_forget: a one-sequence
// call's change of slot 0 is not heard of (a later request resumes from a history no longer there).
enum class SlotBug { none, length_only, no_copy, no_forget };

SlotBug slot_bug() {
    return static_cast<SlotBug>(planted_choice("DELTASPEC_TEST_SLOT_BUG", {"length_only", "no_copy", "no_forget"}));
}

bool is_proper_prefix(const std::vector<int32_t> & head, const std::vector<int32_t> & prompt) {
    if (head.empty() || head.size() >= prompt.size()) return false;
    return slot_bug() == SlotBug::length_only || std::equal(head.begin(), head.end(), prompt.begin());
}

}  // namespace

SlotHistories::SlotHistories(Engine & engine) : engine_(engine), held_((size_t)engine.n_seq_max()) {
    slot_bug();  // a malformed switch fails the first request, not a later step
}

int64_t SlotHistories::place_for(int64_t first, int64_t spare, uint64_t stamp) const {
    int64_t best = -1;
    for (int64_t s = first; s < (int64_t)held_.size(); ++s) {
        if (s == spare) continue;
        if (held_[s].tokens.empty()) return s;
        if (held_[s].stamp < stamp && (best < 0 || held_[s].stamp < held_[best].stamp)) best = s;
    }
    return best;
}

void SlotHistories::move_state(int64_t from, int64_t to) {
    engine_.move_slot(from, to);
    if (on_move_) on_move_(from, to);
}

void SlotHistories::copy(int64_t from, int64_t to) {
    move_state(from, to);
    held_[to] = held_[from];
}

int64_t SlotHistories::take(int64_t slot, const std::vector<int32_t> & prompt) {
    int64_t match = -1;
    for (int64_t s = slot; s < (int64_t)held_.size(); ++s) {
        const Held & h = held_[s];
        // the record and the state agree on the length, or the record is stale and not trusted
        if (is_proper_prefix(h.tokens, prompt) && engine_.slot_n_past(s) == (int64_t)h.tokens.size() &&
            (match < 0 || h.tokens.size() > held_[match].tokens.size())) {
            match = s;
        }
    }
    if (match != slot && !held_[slot].tokens.empty()) {  // keep what this slot held, if there is room
        const int64_t aside = place_for(slot + 1, match, held_[slot].stamp);
        if (aside >= 0) copy(slot, aside);
    }
    int64_t n = 0;
    if (match >= 0) {
        n = (int64_t)held_[match].tokens.size();
        // the match keeps its copy: another request may branch from the same history
        if (match != slot && slot_bug() != SlotBug::no_copy) move_state(match, slot);
        ++n_resumed_;
        n_resumed_tokens_ += n;
    }
    held_[slot] = Held{};  // running: its record starts when it finishes
    return n;
}

void SlotHistories::finished(int64_t slot, int64_t last, std::vector<int32_t> tokens) {
    // records of running slots are empty (take() cleared them), so `slot` and `last` have none
    if (engine_.slot_n_past(slot) != (int64_t)tokens.size()) return;  // not exactly these tokens: not kept
    Held h{std::move(tokens), ++clock_};
    const int64_t keep = slot == last ? slot : place_for(last + 1, -1, h.stamp);
    if (keep < 0) return;
    if (keep != slot) move_state(slot, keep);
    held_[keep] = std::move(h);
}

void SlotHistories::forget() {
    if (slot_bug() == SlotBug::no_forget) return;
    for (Held & h : held_) h = Held{};
}

}  // namespace deltaspec
