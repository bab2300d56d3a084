#include "dflash_drafter.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace deltaspec {

std::vector<int> dflash_taps(const DFlashHParams & hp) {
    std::vector<int> taps;
    for (int32_t L : hp.target_layers) {
        if (L < 1) throw std::invalid_argument("DFlash target layer 0 (the embedding output) cannot be tapped");
        taps.push_back(L - 1);
    }
    return taps;
}

DFlashDrafter::DFlashDrafter(DFlashModel & model, Engine & target, double pass_cost)
    : model_(model), target_(target), pass_cost_(pass_cost), top1_(model.hparams().block_size - 1) {
    target_.set_taps(dflash_taps(model.hparams()));
}

DFlashDrafter::~DFlashDrafter() {
    try {
        target_.set_taps({});  // plain steps stop paying for the copies
    } catch (...) {
    }
}

void DFlashDrafter::inject_tapped() {
    const int64_t n = target_.n_tapped_rows();
    if (n > 0) model_.inject(target_.tapped().data(), n, target_.tapped_pos());
    target_.clear_tapped();
}

void DFlashDrafter::begin(const std::vector<int32_t> & prompt) {
    model_.truncate(0);
    inject_tapped();  // the prompt's rows: the target has just read it
}

Draft DFlashDrafter::propose(const std::vector<int32_t> & committed, int64_t n_max) {
    Draft d;
    inject_tapped();
    // the anchor (the last committed token, not yet read by the target) sits right after the context
    const int64_t anchor_pos = (int64_t)committed.size() - 1;
    if (model_.n_cached() != anchor_pos) {
        throw std::logic_error("DFlash drafter: context of " + std::to_string(model_.n_cached()) +
                               " rows before an anchor at position " + std::to_string(anchor_pos));
    }
    if (anchor_pos + model_.hparams().block_size > model_.n_ctx()) return d;  // no room for a block
    model_.block(committed.back(), nullptr, top1_.data());
    n_passes_++;
    const int64_t n = std::min<int64_t>(n_max, (int64_t)top1_.size());
    d.tokens.assign(top1_.begin(), top1_.begin() + n);
    d.cost = pass_cost_;
    return d;
}

}  // namespace deltaspec
