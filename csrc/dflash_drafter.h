// DFlash as a Drafter of the speculative loop: one block pass per round proposes the top-1 token of
// every block slot (a chain). Its context is the target's tapped features of the committed tokens
// (Engine::set_taps with the drafter's layers), injected before each block.
#pragma once

#include <vector>

#include "dflash_model.h"
#include "drafters.h"

namespace deltaspec {

// The target taps (ids of Engine::set_taps) that give the drafter's features: GGUF
// dflash.target_layers holds layer-input indices L (HF target_layer_ids + 1), the residual stream
// entering layer L, which is layer L-1's output, tap L-1.
std::vector<int> dflash_taps(const DFlashHParams & hp);

class DFlashDrafter : public Drafter {
  public:
    // Sets the target's taps; `pass_cost` is one block pass in target decode steps (an estimate
    // from weight bytes, which keeps the loop's drafting schedule independent of timing).
    DFlashDrafter(DFlashModel & model, Engine & target, double pass_cost);
    ~DFlashDrafter() override;
    void begin(const std::vector<int32_t> & prompt) override;
    Draft propose(const std::vector<int32_t> & committed, int64_t n_max) override;

    int64_t n_passes() const { return n_passes_; }

  private:
    void inject_tapped();  // the target's new rows -> the drafter's context

    DFlashModel & model_;
    Engine & target_;
    double pass_cost_;
    int64_t n_passes_ = 0;
    std::vector<int32_t> top1_;
};

}  // namespace deltaspec
