// Drafting with the target's own MTP head (Qwen3.5 checkpoints ship one): draft 1 reads the last
// committed token with the target's final hidden state before it; draft i+1 reads draft i with the
// head's own output hidden for it (as llama.cpp's draft-mtp drives it). The head's KV cache holds
// one row per committed position p, made from (token p, the target's hidden state at p - 1), so
// after each round it catches up on the positions the target committed, from the hidden states
// the target's verify (or plain decode) steps tapped for their kept rows.
//
// Trees (propose_tree): the head drafts its top-1 chain as above, and at each depth of it the
// head's next-best tokens become extra children, leaves (draft_tree.h build_best_first with only
// the chain's nodes expanded). Every distribution a tree reads is one the chain computes anyway,
// so a tree costs the head exactly the steps of its chain. Expanding a side node would cost one
// more head step each, of the price of a chain step (a head step reads its whole block), and would
// need per-row masks in the head's cache; the leaves catch most of what a tree adds, the first
// alternatives at each depth. After a tree round the head catches up on the committed path from
// the target's hidden states of the accepted rows (the verify's taps, compacted by keep_path).
#pragma once

#include <vector>

#include "drafters.h"
#include "mtp_head.h"

namespace deltaspec {

class MtpDrafter : public Drafter {
  public:
    // `slot`: the scheduler's sequence slot, reading that target slot's taps (the scheduler sets the
    // taps and calls set_slot when it moves the sequence). Each drafter has a head (and its KV cache)
    // of its own.
    MtpDrafter(Engine & target, const SamplingParams & sampling, int64_t slot);
    // Drafts within `constraint` (the request's grammar; nullptr: none), as a draft model does (DraftJob::constraint):
    // each head row masked with the rule's state after the tokens drafted before it, so a chain
    // proposes the head's best allowed (or, sampling, draws from the masked row and reports its q)
    // and a tree's children are allowed tokens; a row where the rule allows nothing ends the chain
    // (a tree: makes its node a leaf). Masking needs the whole row on the host, so a constrained
    // greedy chain reads logits back instead of the device's argmax.
    void constrain(TokenConstraint * constraint) { constraint_ = constraint; }
    void begin(const std::vector<int32_t> & prompt) override;
    Draft propose(const std::vector<int32_t> & committed, int64_t n_max) override;
    // Greedy: children ranked by the head's softmax (temperature 1, top 32, the request's
    // penalties), no q recorded; sampled: drawn without replacement from the request's sampling
    // chain and q recorded (rejection sampling is exact).
    DraftTree propose_tree(const std::vector<int32_t> & committed, int64_t budget, int64_t max_depth) override;

    int64_t n_head_steps() const { return n_head_steps_; }  // head graphs run (tests assert drafting ran)
    void set_slot(int64_t slot) { slot_ = slot; }

    // propose() a head step at a time, so that a scheduler runs several sequences' head steps in one
    // graph (MtpHead::eval_groups; propose() runs each on the head's own graphs): begin_chain()
    // readies the catch-up rows as `job` (false: nothing to run, no draft); after each evaluation
    // of the job, next_chain() draws the next draft token and readies the row that continues the
    // chain (false: the chain is complete). take_chain() returns the draft with its cost.
    bool begin_chain(const std::vector<int32_t> & committed, int64_t n_max, MtpHead::RowsJob & job);
    bool next_chain(MtpHead::RowsJob & job);
    Draft take_chain() { return std::move(chain_); }

  private:
    // The head reads the committed positions it has not seen (each with the target's hidden state
    // before it). Returns whether a draft can follow: the newest committed token is the target's
    // next input. Then, with `wanted`, logits_ (or argmax) and h_ hold the head's output for it.
    bool catch_up(const std::vector<int32_t> & committed, bool want_draft, LogitsWanted wanted, int32_t * argmax);
    // catch_up's rows (batch_tokens_, batch_hidden_) without evaluating them; whether a draft can
    // follow; `last` the newest position they cover
    bool catch_up_rows(const std::vector<int32_t> & committed, bool want_draft, int64_t & last);
    // The target's hidden state at position p (p >= 0): a tapped row, or the one kept from before.
    const float * target_hidden(int64_t p) const;
    // whether a chain's next token is the device's argmax (greedy, unconstrained) or drawn here
    bool device_argmax() const { return sampler_.params().argmax_only() && constraint_ == nullptr; }
    bool end_chain();  // the chain is complete: its rows are forgotten, its cost set; false

    Engine & target_;
    TokenConstraint * constraint_ = nullptr;
    int64_t slot_;
    MtpHead head_;
    Sampler sampler_;
    Sampler ranker_;  // greedy trees: the candidates' ranking distribution
    double step_cost_;
    int64_t synced_ = 0;          // the head's KV rows hold positions 0 .. synced_ - 1
    std::vector<float> h_last_;   // the target's hidden state at position h_last_pos_
    int64_t h_last_pos_ = -1;
    std::vector<float> zeros_;    // the hidden state before position 0
    std::vector<int32_t> batch_tokens_;
    std::vector<float> batch_hidden_, logits_, h_;
    int64_t n_head_steps_ = 0;
    // begin_chain / next_chain's chain in progress
    Draft chain_;
    std::vector<int32_t> chain_history_;
    int64_t chain_n_max_ = 0, chain_synced_ = 0, chain_evals_ = 0;
    std::vector<float> q_logits_;  // a planted bug's unmasked row (mask_draft_within)
    bool chain_caught_up_ = false, chain_drafting_ = false;
    int32_t chain_argmax_ = -1;
    void chain_row(MtpHead::RowsJob & job, const int32_t * tokens, int64_t n, const float * hidden, bool drafting);
};

}  // namespace deltaspec
