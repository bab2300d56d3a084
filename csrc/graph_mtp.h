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

}  // namespace deltaspec
