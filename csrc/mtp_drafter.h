// Drafting with the target's own MTP head (Qwen3.5 checkpoints ship one): draft 1 reads the last
// committed token with the target's final hidden state before it; draft i+1 reads draft i with the
// head's own output hidden for it (as llama.cpp's draft-mtp drives it). The head's KV cache holds
// one row per committed position p, made from (token p, the target's hidden state at p - 1), so
// after each round it catches up on the positions the target committed, from the hidden states
// the target's verify (or plain decode) steps tapped for their kept rows.
#pragma once

#include <vector>

#include "drafters.h"
#include "mtp_head.h"

namespace deltaspec {

class MtpDrafter : public Drafter {
  public:
    // Sets the target's taps to its final hidden state for as long as the drafter lives.
    MtpDrafter(Engine & target, const SamplingParams & sampling);
    ~MtpDrafter() override;
    void begin(const std::vector<int32_t> & prompt) override;
    Draft propose(const std::vector<int32_t> & committed, int64_t n_max) override;

    int64_t n_head_steps() const { return n_head_steps_; }  // head graphs run (tests assert drafting ran)

  private:
    // The target's hidden state at position p (p >= 0): a tapped row, or the one kept from before.
    const float * target_hidden(int64_t p) const;

    Engine & target_;
    std::vector<int> old_taps_;
    MtpHead head_;
    Sampler sampler_;
    double step_cost_;
    int64_t synced_ = 0;          // the head's KV rows hold positions 0 .. synced_ - 1
    std::vector<float> h_last_;   // the target's hidden state at position h_last_pos_
    int64_t h_last_pos_ = -1;
    std::vector<float> zeros_;    // the hidden state before position 0
    std::vector<int32_t> batch_tokens_;
    std::vector<float> batch_hidden_, logits_, h_;
    int64_t n_head_steps_ = 0;
};

}  // namespace deltaspec
