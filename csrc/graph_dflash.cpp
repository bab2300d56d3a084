// DFlash drafter graphs. The drafter's norms are plain RMSNorm weights (x * w, unlike the qwen35
// target's 1+w), its RoPE is NeoX over the first n_rot dims of a head (a Qwen3.5 target's M-RoPE
// sections degenerate to that for text), and attention is plain softmax(q k^T / sqrt(D)) v in F32,
// so that the drafter matches the torch reference to float rounding.
#include "graph_dflash.h"

#include <cmath>

namespace deltaspec {

namespace {

ggml_tensor * rms_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), w);
}

ggml_tensor * rope(ggml_context * ctx, ggml_tensor * x, ggml_tensor * pos, const DFlashHParams & hp) {
    return ggml_rope_ext(ctx, x, pos, nullptr, (int)hp.n_rot, GGML_ROPE_TYPE_NEOX, 0, hp.rope_freq_base, 1.0f, 0.0f,
                         1.0f, 32.0f, 1.0f);
}

// K {D, Hkv, n} (normed, roped) and V {Hkv*D, n} of n rows of h, written to layer il's cache rows.
void write_kv(ggml_context * ctx, ggml_cgraph * gf, const DFlashGraphWeights & w, int il, ggml_tensor * h,
              const DFlashInputs & in, int64_t n) {
    const DFlashHParams & hp = w.hp;
    const DFlashLayer & l = w.layers[il];
    ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wk, h), hp.head_dim, hp.n_head_kv, n);
    k = rope(ctx, rms_norm(ctx, k, l.k_norm, hp.rms_eps), in.pos, hp);
    ggml_tensor * v = ggml_mul_mat(ctx, l.wv, h);
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, w.k_cache[il], ggml_reshape_2d(ctx, k, hp.head_dim * hp.n_head_kv, n), in.rows));
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, w.v_cache[il], v, in.rows));
}

ggml_tensor * swiglu(ggml_context * ctx, const DFlashLayer & l, ggml_tensor * x) {
    return ggml_mul_mat(ctx, l.ffn_down, ggml_swiglu_split(ctx, ggml_mul_mat(ctx, l.ffn_gate, x), ggml_mul_mat(ctx, l.ffn_up, x)));
}

}  // namespace

void build_dflash_inject(ggml_context * ctx, ggml_cgraph * gf, const DFlashGraphWeights & w, DFlashInputs & in,
                         int64_t n) {
    in.features = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w.fc->ne[0], n);
    in.pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    in.rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
    for (ggml_tensor * t : {in.features, in.pos, in.rows}) ggml_set_input(t);
    ggml_tensor * g = rms_norm(ctx, ggml_mul_mat(ctx, w.fc, in.features), w.hidden_norm, w.hp.rms_eps);
    for (int il = 0; il < (int)w.layers.size(); ++il) write_kv(ctx, gf, w, il, g, in, n);
}

ggml_tensor * build_dflash_blocks(ggml_context * ctx, ggml_cgraph * gf, const DFlashGraphWeights & w,
                                  const std::vector<DFlashSlotCache> & caches, DFlashInputs & in,
                                  std::vector<ggml_tensor *> & masks, int64_t n, const std::vector<int64_t> & n_kv) {
    const DFlashHParams & hp = w.hp;
    const int64_t N = (int64_t)caches.size(), T = N * n, D = hp.head_dim, H = hp.n_head, Hkv = hp.n_head_kv;
    in.tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
    in.pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
    in.rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, T);
    for (ggml_tensor * t : {in.tokens, in.pos, in.rows}) ggml_set_input(t);
    masks.assign(N, nullptr);
    for (int64_t j = 0; hp.causal && j < N; ++j) {
        masks[j] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_kv[j], n);
        ggml_set_input(masks[j]);
    }
    ggml_tensor * x = ggml_get_rows(ctx, w.token_embd, in.tokens);  // {E, T}
    for (int il = 0; il < (int)w.layers.size(); ++il) {
        const DFlashLayer & l = w.layers[il];
        ggml_tensor * h = rms_norm(ctx, x, l.attn_norm, hp.rms_eps);
        ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wq, h), D, H, T);
        q = rope(ctx, rms_norm(ctx, q, l.q_norm, hp.rms_eps), in.pos, hp);
        ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, l.wk, h), D, Hkv, T);
        k = ggml_reshape_2d(ctx, rope(ctx, rms_norm(ctx, k, l.k_norm, hp.rms_eps), in.pos, hp), D * Hkv, T);
        ggml_tensor * v = ggml_mul_mat(ctx, l.wv, h);  // {Hkv*D, T}
        ggml_tensor * o = nullptr;
        for (int64_t j = 0; j < N; ++j) {
            // block j's K/V join its own slot's context rows, then its queries attend to all of them
            ggml_tensor * rows = ggml_view_1d(ctx, in.rows, n, j * n * in.rows->nb[0]);
            ggml_tensor * kc = caches[j].k[il];
            ggml_tensor * vc = caches[j].v[il];
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, kc, ggml_view_2d(ctx, k, k->ne[0], n, k->nb[1], j * n * k->nb[1]), rows));
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, vc, ggml_view_2d(ctx, v, v->ne[0], n, v->nb[1], j * n * v->nb[1]), rows));
            ggml_tensor * qj = ggml_view_3d(ctx, q, D, H, n, q->nb[1], q->nb[2], j * n * q->nb[2]);
            ggml_tensor * kj = ggml_view_3d(ctx, kc, D, Hkv, n_kv[j], ggml_row_size(kc->type, D), kc->nb[1], 0);
            ggml_tensor * vj = ggml_view_3d(ctx, vc, D, Hkv, n_kv[j], ggml_row_size(vc->type, D), vc->nb[1], 0);
            ggml_tensor * kq = ggml_mul_mat(ctx, ggml_permute(ctx, kj, 0, 2, 1, 3), ggml_permute(ctx, qj, 0, 2, 1, 3));
            ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
            kq = ggml_soft_max_ext(ctx, kq, masks[j], 1.0f / std::sqrt((float)D), 0.0f);
            ggml_tensor * vt = ggml_cont(ctx, ggml_permute(ctx, vj, 1, 2, 0, 3));  // {n_kv, D, Hkv}
            ggml_tensor * oj = ggml_cont(ctx, ggml_permute(ctx, ggml_mul_mat(ctx, vt, kq), 0, 2, 1, 3));  // {D, H, n}
            o = o ? ggml_concat(ctx, o, oj, 2) : oj;
        }
        x = ggml_add(ctx, x, ggml_mul_mat(ctx, l.wo, ggml_reshape_2d(ctx, o, H * D, T)));
        x = ggml_add(ctx, x, swiglu(ctx, l, rms_norm(ctx, x, l.ffn_norm, hp.rms_eps)));
    }
    // each block's anchor slot predicts nothing: the head runs on slots 1 .. n-1 of every block
    x = ggml_view_3d(ctx, x, x->ne[0], n - 1, N, x->nb[1], n * x->nb[1], x->nb[1]);
    x = ggml_reshape_2d(ctx, ggml_cont(ctx, x), x->ne[0], (n - 1) * N);
    ggml_tensor * logits = ggml_mul_mat(ctx, w.output, rms_norm(ctx, x, w.output_norm, hp.rms_eps));
    ggml_set_output(logits);
    ggml_build_forward_expand(gf, logits);
    return logits;
}

}  // namespace deltaspec
