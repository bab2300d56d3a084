// Hyper-parameters of a qwen35 model, as parsed and validated by python/deltaspec/gguf_file.py.
// The C++ side trusts these (Python already checked them against the file's tensors).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace deltaspec {

struct HParams {
    int64_t n_vocab = 0;
    int64_t n_embd = 0;          // E
    int64_t n_layer = 0;         // trunk layers (block_count - nextn_predict_layers)
    int64_t n_ctx_train = 0;
    float rms_eps = 1e-6f;

    // gated full attention
    int64_t n_head = 0;          // H
    int64_t n_head_kv = 0;       // Hkv
    int64_t head_dim = 0;        // D (key_length == value_length)
    int64_t n_rot = 0;           // rotary dims (64 for Qwen3.5)
    float rope_freq_base = 10000.0f;
    std::array<int, 4> rope_sections = {0, 0, 0, 0};
    // RoPE scaling in ggml_rope_multi's terms, derived from rope.scaling.* by qwen35.py
    // (rope_scaling()); the defaults are plain RoPE.
    float rope_freq_scale = 1.0f;    // 1 / factor for linear and YaRN scaling
    float rope_ext_factor = 0.0f;    // YaRN's extrapolation mix: 1 for YaRN, 0 otherwise
    float rope_attn_factor = 1.0f;   // cos/sin scale (ggml multiplies YaRN's 1 + 0.1 ln(factor) into it)
    float rope_beta_fast = 32.0f;    // YaRN correction range, in rotations
    float rope_beta_slow = 1.0f;
    int64_t rope_n_ctx_orig = 0;     // YaRN's pre-training context (sets the correction range)

    // Gated DeltaNet
    int64_t ssm_conv_kernel = 0; // Kc
    int64_t ssm_state_size = 0;  // S (key and value head dim)
    int64_t ssm_n_k_heads = 0;   // Hk
    int64_t ssm_n_v_heads = 0;   // Hv

    std::vector<bool> recurrent; // per trunk layer: true = Gated DeltaNet, false = full attention

    int64_t conv_channels() const { return (2 * ssm_n_k_heads + ssm_n_v_heads) * ssm_state_size; }
};

}  // namespace deltaspec
