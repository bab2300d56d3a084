// Follows llama.cpp's graph_mtp for qwen35 (src/models/qwen35.cpp of the pinned tree) on the
// tensors its converter writes (blk.{n_layer}.nextn.*, norms stored as 1+w).
#include "graph_mtp.h"

namespace deltaspec {

namespace {

ggml_tensor * norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * weight, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), weight);
}

}  // namespace

MtpGraphOutputs build_mtp(ggml_context * ctx, ggml_cgraph * gf, const HParams & hp, const MtpWeights & w,
                          ggml_tensor * k_cache, ggml_tensor * v_cache, int64_t n_ctx, const StepInputs & in,
                          ggml_tensor * hidden, int64_t n_logit_rows) {
    const float eps = hp.rms_eps;
    const int64_t T = in.n_tokens;
    const LayerWeights & l = w.block;

    ggml_tensor * e = norm(ctx, ggml_get_rows(ctx, w.embed, in.tokens), w.enorm, eps);  // {E, T}
    ggml_tensor * h = norm(ctx, hidden, w.hnorm, eps);
    ggml_tensor * c = ggml_mul_mat(ctx, w.eh_proj, ggml_concat(ctx, e, h, 0));  // embedding first, as trained

    c = ggml_add(ctx, c, gated_attention(ctx, gf, hp, l, k_cache, v_cache, n_ctx, norm(ctx, c, l.attn_norm, eps), in));
    c = ggml_add(ctx, c, swiglu_ffn(ctx, gf, l, norm(ctx, c, l.post_norm, eps), FoldInput()));

    MtpGraphOutputs out;
    out.hidden = norm(ctx, c, w.head_norm, eps);
    ggml_set_output(out.hidden);
    ggml_build_forward_expand(gf, out.hidden);
    if (n_logit_rows > 0) {
        ggml_tensor * x = out.hidden;
        if (n_logit_rows < T) x = ggml_view_2d(ctx, x, x->ne[0], n_logit_rows, x->nb[1], (T - n_logit_rows) * x->nb[1]);
        out.logits = ggml_mul_mat(ctx, w.head, x);
        ggml_set_output(out.logits);
        ggml_build_forward_expand(gf, out.logits);
    }
    return out;
}

MtpGraphOutputs build_mtp_groups(ggml_context * ctx, ggml_cgraph * gf, const HParams & hp, const MtpWeights & w,
                                 const std::vector<MtpHeadCache> & caches, const std::vector<StepInputs> & in,
                                 ggml_tensor * tokens, ggml_tensor * hidden, ggml_tensor * logit_rows) {
    const float eps = hp.rms_eps;
    const LayerWeights & l = w.block;
    ggml_tensor * e = norm(ctx, ggml_get_rows(ctx, w.embed, tokens), w.enorm, eps);  // {E, T}
    ggml_tensor * h = norm(ctx, hidden, w.hnorm, eps);
    ggml_tensor * c = ggml_mul_mat(ctx, w.eh_proj, ggml_concat(ctx, e, h, 0));  // embedding first, as trained

    ggml_tensor * a = norm(ctx, c, l.attn_norm, eps);
    ggml_tensor * attn = nullptr;
    int64_t row = 0;
    for (size_t j = 0; j < caches.size(); ++j) {
        const int64_t n = in[j].n_tokens;
        ggml_tensor * aj = ggml_view_2d(ctx, a, a->ne[0], n, a->nb[1], row * a->nb[1]);
        ggml_tensor * oj = gated_attention(ctx, gf, hp, l, caches[j].k, caches[j].v, caches[j].n_ctx, aj, in[j]);
        attn = attn ? ggml_concat(ctx, attn, oj, 1) : oj;
        row += n;
    }
    c = ggml_add(ctx, c, attn);
    c = ggml_add(ctx, c, swiglu_ffn(ctx, gf, l, norm(ctx, c, l.post_norm, eps), FoldInput()));

    MtpGraphOutputs out;
    out.hidden = norm(ctx, c, w.head_norm, eps);
    ggml_set_output(out.hidden);
    ggml_build_forward_expand(gf, out.hidden);
    out.logits = ggml_mul_mat(ctx, w.head, ggml_get_rows(ctx, out.hidden, logit_rows));
    ggml_set_output(out.logits);
    ggml_build_forward_expand(gf, out.logits);
    return out;
}

}  // namespace deltaspec
