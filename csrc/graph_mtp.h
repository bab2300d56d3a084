// The graph of Qwen3.5's MTP (NextN) head: from a token and a hidden state, the next token's
// logits and the head's own hidden state (which feeds its next step when it drafts further).
#pragma once

#include "graph_qwen35.h"

namespace deltaspec {

struct MtpGraphOutputs {
    ggml_tensor * hidden = nullptr;  // {E, T}: the head's normed output, every row
    ggml_tensor * logits = nullptr;  // {n_vocab, n_logit_rows}: the last n_logit_rows rows
};

// Row t pairs in.tokens[t] (at position p0 + t) with hidden[:, t], the hidden state of the token
// before it: the target's final normed hidden state (Taps' id n_layer) or, while drafting, the
// head's own output for that token. Per row:
//   c = eh_proj * [enorm * rmsnorm(embed(token)) | hnorm * rmsnorm(hidden)]
//   c = c + attention(attn_norm * rmsnorm(c))       (the head's own KV cache k_cache / v_cache)
//   c = c + ffn(post_norm * rmsnorm(c))
//   hidden_out = head_norm * rmsnorm(c);  logits = head * hidden_out
// `in` is a one-sequence StepInputs (make_step_inputs) over the head's cache of n_ctx rows.
MtpGraphOutputs build_mtp(ggml_context * ctx, ggml_cgraph * gf, const HParams & hp, const MtpWeights & w,
                          ggml_tensor * k_cache, ggml_tensor * v_cache, int64_t n_ctx, const StepInputs & in,
                          ggml_tensor * hidden, int64_t n_logit_rows);

// Rows of several heads in one graph (several sequences' MTP heads drafting in lockstep): group j
// is rows[j] .. rows[j] + in[j].n_tokens - 1 of tokens / hidden ({T} / {E, T}), at its head's
// positions (in[j], a one-sequence StepInputs whose tokens are not read) with its head's KV cache
// (caches[j]: K, V, n_ctx). eh_proj, the FFN and the LM head run over every group's rows at once;
// attention per group. Logits for the rows `logit_rows` ({n_logit}, I32) picks.
struct MtpHeadCache {
    ggml_tensor * k;
    ggml_tensor * v;
    int64_t n_ctx;
};
MtpGraphOutputs build_mtp_groups(ggml_context * ctx, ggml_cgraph * gf, const HParams & hp, const MtpWeights & w,
                                 const std::vector<MtpHeadCache> & caches, const std::vector<StepInputs> & in,
                                 ggml_tensor * tokens, ggml_tensor * hidden, ggml_tensor * logit_rows);

}  // namespace deltaspec
