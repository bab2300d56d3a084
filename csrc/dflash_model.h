// A DFlash block drafter (z-lab DFlashDraftModel, GGUF arch `dflash` as llama.cpp's converter
// writes it): a few Qwen3-style layers that predict a whole block of tokens in one pass from the
// target's hidden features. It runs on the target engine's backend and borrows the target's token
// embedding and LM head (not copied). Its own state is a KV cache of projected target features,
// one row per committed position, per sequence slot: the scheduler's sequences draft each in the
// slot of the same index as its target slot (use_slot), allocated when first used.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine.h"
#include "ggml-backend.h"
#include "ggml.h"

namespace deltaspec {

// Read and checked against the target in Python (deltaspec/dflash.py), which names the key at fault.
struct DFlashHParams {
    int64_t n_embd = 0;        // E, equal to the target's
    int64_t n_layer = 0;
    int64_t n_head = 0;        // H
    int64_t n_head_kv = 0;     // Hkv
    int64_t head_dim = 0;      // D
    int64_t n_ff = 0;
    int64_t n_rot = 0;         // NeoX RoPE over the first n_rot dims of a head
    float rope_freq_base = 10000.0f;
    float rms_eps = 1e-6f;
    int64_t block_size = 16;   // anchor + block_size - 1 predicted tokens
    int32_t mask_token = -1;
    bool causal = false;       // block-internal causality (dflash.attention.causal)
    std::vector<int32_t> target_layers;  // target layer-input indices whose residual stream feeds fc
};

struct DFlashLayer {
    ggml_tensor *attn_norm, *wq, *wk, *wv, *wo, *q_norm, *k_norm, *ffn_norm, *ffn_gate, *ffn_up, *ffn_down;
};

class DFlashModel {
  public:
    // `target` must outlive this object; its backend holds our weights and cache too. Slots 0 ..
    // n_slots - 1 (slot 0 allocated now, the others by their first use_slot or move_slot).
    DFlashModel(const std::string & path, const DFlashHParams & hp, Engine & target, int64_t n_ctx, int64_t n_slots = 1);
    ~DFlashModel();
    DFlashModel(const DFlashModel &) = delete;
    DFlashModel & operator=(const DFlashModel &) = delete;

    // Context rows: features {n_rows, n_feat} (row-major, n_feat = len(target_layers) * E) of the
    // target positions pos0 .. pos0+n_rows-1 become every layer's K/V rows there. pos0 must not be
    // past n_cached(); rows at or after pos0 are replaced and the cache then ends at pos0+n_rows.
    void inject(const float * features, int64_t n_rows, int64_t pos0);
    // One block per job in ONE pass (graph_dflash.h build_dflash_blocks): job j's block
    // [anchor, mask x (block_size-1)] at positions n_cached() .. of its slot, the non-causal pass
    // over every cached context row of that slot and the block. Writes the logits of the
    // block_size-1 predicted slots ({block_size-1, n_vocab} row-major) to `logits`, their argmax
    // to `top1`, and / or (when top_k > 0) each slot's top_k tokens to `top_ids` with their
    // probabilities under softmax(logits / temperature) to `top_probs` ({block_size-1, top_k}
    // each, a slot's tokens in no particular order), all computed on the device; any output may
    // be null. Leaves every cache as it was. Slots distinct.
    struct BlockJob {
        int64_t slot = 0;
        int32_t anchor = 0;
        float * logits = nullptr;
        int32_t * top1 = nullptr;
        int64_t top_k = 0;
        float temperature = 1.0f;
        int32_t * top_ids = nullptr;
        float * top_probs = nullptr;
    };
    void blocks(const std::vector<BlockJob> & jobs);
    // What blocks() has run (tests assert that passes of several sequences' blocks happened).
    struct BlockStats {
        int64_t passes = 0, blocks = 0, max_blocks = 0;
    };
    const BlockStats & block_stats() const { return block_stats_; }
    void truncate(int64_t n) { slots_[cur_].n_cached = std::min(slots_[cur_].n_cached, n); }  // forget context rows >= n

    // The slot inject, block, truncate and n_cached act on (0 unless changed).
    void use_slot(int64_t slot);
    int64_t current_slot() const { return cur_; }
    int64_t n_slots() const { return (int64_t)slots_.size(); }
    int64_t n_cached_of(int64_t slot) const;  // 0 for a slot never used
    // slot `to` <- slot `from`'s context (the target's Engine::move_slot, for the drafter's slots)
    void move_slot(int64_t from, int64_t to);

    const DFlashHParams & hparams() const { return hp_; }
    Engine & target() { return target_; }
    int64_t n_cached() const { return slots_[cur_].n_cached; }
    int64_t n_ctx() const { return n_ctx_; }
    int64_t n_feat() const { return (int64_t)hp_.target_layers.size() * hp_.n_embd; }
    int64_t n_vocab() const { return target_.hparams().n_vocab; }
    size_t weight_bytes() const;  // what one pass reads of our own weights (the head comes on top)

  private:
    void run(ggml_cgraph * gf);
    struct Slot {
        std::vector<ggml_tensor *> k, v;  // per layer {Hkv*D, n_ctx} F32
        ggml_context * ctx = nullptr;
        ggml_backend_buffer_t buf = nullptr;
        int64_t n_cached = 0;
    };
    void allocate_slot(Slot & slot);

    DFlashHParams hp_;
    Engine & target_;
    int64_t n_ctx_;
    ggml_tensor *fc_ = nullptr, *hidden_norm_ = nullptr, *output_norm_ = nullptr;
    std::vector<DFlashLayer> layers_;
    std::vector<Slot> slots_;  // the unused ones unallocated
    int64_t cur_ = 0;
    BlockStats block_stats_;
    ggml_context * wctx_ = nullptr;
    ggml_backend_buffer_t wbuf_ = nullptr;
    ggml_backend_sched_t sched_ = nullptr;
    std::vector<uint8_t> meta_;
    size_t graph_size_ = 0;
};

}  // namespace deltaspec
