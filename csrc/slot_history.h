// Prompt-prefix reuse across requests (a chat's next turn: the previous prompt and reply, then the
// new message): a slot whose sequence has finished keeps its state, and this table remembers which
// tokens that state holds. A later request whose prompt begins with all of them resumes from that
// state and prefills only its new tokens.
//
// Only a slot's WHOLE history qualifies: a Gated DeltaNet layer's state folds every token into one
// matrix and cannot be cut back to a shorter prefix the way a KV cache can (see session_state.py).
//
// The scheduler keeps running sequences in slots 0 .. R-1 (Engine::decode wants consecutive slots),
// so the idle slots R .. n-1 are where finished histories wait. Moving one into the slot a new
// request takes, and keeping a finished one when another sequence is moved into its slot, are
// device copies (Engine::move_slot): a slot's KV rows and recurrent state, far cheaper than a prefill.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine.h"

namespace deltaspec {

class SlotHistories {
  public:
    explicit SlotHistories(Engine & engine);

    // Slot `slot` (the next running one: every slot above it is idle) is about to take a sequence
    // with `prompt`. The idle slot whose history is the longest proper prefix of `prompt` (one new
    // token at least: its logits come from the prefill) is copied into `slot`; a history `slot`
    // itself held is first copied aside into an idle slot holding an older one (or none). Returns
    // how many prompt tokens `slot` then holds: 0 means none, and the caller starts it empty.
    int64_t take(int64_t slot, const std::vector<int32_t> & prompt);

    // The sequence in `slot` finished; its state holds `tokens`. `last` (>= slot) is the highest
    // running slot, whose sequence the scheduler then moves into `slot`. The finished history is
    // kept: in place when slot == last, otherwise copied first into the idle slot above `last`
    // that holds the oldest history (or none); lost only when every slot is running. A state that
    // does not hold exactly `tokens` is not kept.
    void finished(int64_t slot, int64_t last, std::vector<int32_t> tokens);

    // Also hears every move of a slot's state (what else follows the slot: a drafter's context).
    void set_on_move(std::function<void(int64_t, int64_t)> on_move) { on_move_ = std::move(on_move); }

    // The slots' states were changed by something else (a one-sequence call, a failed step):
    // nothing they hold is known any more.
    void forget();

    // Requests that resumed from a kept history, and the prompt tokens they did not prefill.
    int64_t n_resumed() const { return n_resumed_; }
    int64_t n_resumed_tokens() const { return n_resumed_tokens_; }

  private:
    // An idle slot at or after `first`, other than `spare`, to copy a history of age `stamp` into:
    // an empty one, else the one with the oldest history if that is older than `stamp`; -1: none.
    int64_t place_for(int64_t first, int64_t spare, uint64_t stamp) const;
    void copy(int64_t from, int64_t to);  // the state and its record
    void move_state(int64_t from, int64_t to);  // the state (Engine::move_slot, on_move_)

    struct Held {
        std::vector<int32_t> tokens;  // what the slot's state holds (empty: nothing known)
        uint64_t stamp = 0;           // when it was kept (larger: newer)
    };
    Engine & engine_;
    std::function<void(int64_t, int64_t)> on_move_;
    std::vector<Held> held_;  // by slot; meaningful for idle slots only
    uint64_t clock_ = 0;
    int64_t n_resumed_ = 0, n_resumed_tokens_ = 0;
};

}  // namespace deltaspec
