// Hyper-parameters of a qwen35 model, read from the GGUF's metadata and validated once, here
// (read_hparams); Python gets this struct from the engine's module, it keeps no copy of its own.
// Key names and defaults follow llama.cpp's qwen35 loader in the pinned tree
// (llama_model_base::load_hparams, llama_model_qwen35::load_arch_hparams).
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace deltaspec {

struct HParams {
    int64_t n_vocab = 0;
    int64_t n_embd = 0;          // E
    int64_t n_layer = 0;         // trunk layers (block_count - nextn_predict_layers)
    int64_t n_layer_nextn = 0;   // MTP layers stored after the trunk (not run yet)
    int64_t n_ctx_train = 0;
    float rms_eps = 1e-6f;
    bool tied_output = false;    // no output.weight: the head reuses token_embd

    // gated full attention
    int64_t n_head = 0;          // H
    int64_t n_head_kv = 0;       // Hkv
    int64_t head_dim = 0;        // D (key_length == value_length)
    int64_t n_rot = 0;           // rotary dims (64 for Qwen3.5)
    float rope_freq_base = 10000.0f;
    std::array<int, 4> rope_sections = {0, 0, 0, 0};
    // RoPE scaling in ggml_rope_multi's terms (which takes floats), derived from rope.scaling.* as
    // llama.cpp derives it for qwen35 where llama.cpp and transformers agree; the defaults are
    // plain RoPE.
    std::string rope_scaling_type = "none";  // none, linear or yarn
    double rope_scaling_factor = 1.0;        // context extension factor
    double rope_freq_scale = 1.0;    // 1 / factor for linear and YaRN scaling
    double rope_ext_factor = 0.0;    // YaRN's extrapolation mix: 1 for YaRN, 0 otherwise
    double rope_attn_factor = 1.0;   // cos/sin scale (ggml multiplies YaRN's 1 + 0.1 ln(factor) into it)
    double rope_beta_fast = 32.0;    // YaRN correction range, in rotations
    double rope_beta_slow = 1.0;
    int64_t rope_n_ctx_orig = 0;     // YaRN's pre-training context (sets the correction range)

    // Gated DeltaNet
    int64_t ssm_conv_kernel = 0; // Kc
    int64_t ssm_state_size = 0;  // S (key and value head dim)
    int64_t ssm_n_k_heads = 0;   // Hk
    int64_t ssm_n_v_heads = 0;   // Hv

    std::vector<bool> recurrent; // per trunk layer: true = Gated DeltaNet, false = full attention

    int64_t conv_channels() const { return (2 * ssm_n_k_heads + ssm_n_v_heads) * ssm_state_size; }
    int64_t n_attention_layers() const;
    // F32 DeltaNet states plus conv windows of every recurrent layer, for one sequence
    int64_t recurrent_state_bytes() const;
};

// Why a file's hyper-parameters cannot be used; `kind` picks the Python exception
// (deltaspec.errors: MissingMetadataError, HyperParameterError, UnsupportedArchitectureError,
// MissingTensorError). The message starts with the file's path.
struct HParamsError : std::runtime_error {
    enum Kind { missing_metadata, hyper_parameter, unsupported_architecture, missing_tensor };
    HParamsError(Kind k, const std::string & message) : std::runtime_error(message), kind(k) {}
    Kind kind;
};

// Reads and checks the hyper-parameters of the qwen35 GGUF at `path` (its metadata only).
HParams read_hparams(const std::string & path);

// The M-RoPE sections (4 entries) that give every one of n_pairs rotary pairs a section under
// interleaved M-RoPE: [11, 11, 10, 0] for Qwen3.5's 32 pairs.
std::array<int, 4> mrope_sections(int n_pairs);
// What is wrong with M-RoPE `sections` over n_rot rotary dims, or "" (see hparams.cpp).
std::string rope_sections_problem(const std::vector<int64_t> & sections, int64_t n_rot);

}  // namespace deltaspec
