// Mirrors the reference forward of HF transformers' Qwen3_5ForCausalLM on the weight layout that
// llama.cpp's converter writes (norms stored as 1+w, ssm_a = -exp(A_log), V heads tiled).
#include "graph_qwen35.h"

#include "deltaspec_tq.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "deltaspec_rows.h"

namespace deltaspec {

namespace {

// The four input tensors of in.n_tokens rows in n_streams sequences of equal length: the mask is
// {n_kv, T / n_streams, 1, n_streams}, which for one sequence is the 2-D {n_kv, T}.
void add_input_tensors(ggml_context * ctx, StepInputs & in, int64_t n_streams) {
    const int64_t T = in.n_tokens;
    in.tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
    in.pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 4 * T);
    in.kv_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, T);
    in.kq_mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, in.n_kv, T / n_streams, 1, n_streams);
    for (ggml_tensor * t : {in.tokens, in.pos, in.kv_rows, in.kq_mask}) ggml_set_input(t);
}

}  // namespace

StepInputs make_step_inputs(ggml_context * ctx, int64_t n_tokens, int64_t n_kv, bool keep_states) {
    StepInputs in;
    in.keep_states = keep_states;
    in.n_tokens = n_tokens;
    in.n_kv = n_kv;
    add_input_tensors(ctx, in, 1);
    return in;
}

StepInputs make_tree_inputs(ggml_context * ctx, int64_t n_tokens, int64_t n_kv, int64_t n_positions) {
    StepInputs in = make_step_inputs(ctx, n_tokens, n_kv, /*keep_states =*/true);
    add_rows_input(ctx, in, n_positions);
    return in;
}

void add_rows_input(ggml_context * ctx, StepInputs & in, int64_t n_positions) {
    in.keep_states = true;
    in.rows = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, DELTASPEC_ROWS_N_COLS, n_positions);
    ggml_set_input(in.rows);
    in.n_saved = in.n_tokens;
}

int64_t rows_max_walks(const StepInputs & in) {
    return std::max<int64_t>(1, in.n_seqs) + (in.rows->ne[1] > in.n_tokens ? DELTASPEC_ROWS_EXTRA_WALKS : 0);
}

void set_rows_input(const StepInputs & in, const std::vector<int32_t> & plan, const char * who) {
    const int64_t n_positions = in.rows->ne[1];
    if ((int64_t)plan.size() != n_positions * DELTASPEC_ROWS_N_COLS) {
        throw std::logic_error(std::string(who) + ": a plan of " + std::to_string(plan.size()) + " entries for a rows "
                               "tensor of " + std::to_string(n_positions * DELTASPEC_ROWS_N_COLS));
    }
    const int64_t n_walks = deltaspec_rows_count_walks(plan.data(), n_positions);
    if (n_walks > rows_max_walks(in)) {
        throw std::logic_error(std::string(who) + ": the plan has " + std::to_string(n_walks) + " walks, the graph's "
                               "recurrence looks at " + std::to_string(rows_max_walks(in)));
    }
    set_input(in.rows, plan.data(), plan.size() * sizeof(int32_t));
}

void set_chain_inputs(const StepInputs & in, int64_t p0, int64_t T, int64_t n_kv) {
    std::vector<int32_t> pos(4 * T, 0);
    std::vector<int64_t> rows(T);
    for (int64_t t = 0; t < T; ++t) {
        pos[t] = pos[T + t] = pos[2 * T + t] = (int32_t)(p0 + t);
        rows[t] = p0 + t;
    }
    set_input(in.pos, pos.data(), pos.size() * sizeof(int32_t));
    set_input(in.kv_rows, rows.data(), rows.size() * sizeof(int64_t));
    std::vector<ggml_fp16_t> mask(n_kv * T);
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), neg_inf = ggml_fp32_to_fp16(-INFINITY);
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < n_kv; ++j) mask[t * n_kv + j] = j <= p0 + t ? zero : neg_inf;
    }
    set_input(in.kq_mask, mask.data(), mask.size() * sizeof(ggml_fp16_t));
}

StepInputs make_batch_inputs(ggml_context * ctx, int64_t n_seqs, int64_t n_per_seq, int64_t n_kv, int64_t first_slot) {
    StepInputs in;
    in.n_tokens = n_seqs * n_per_seq;
    in.n_kv = n_kv;
    in.n_seqs = n_seqs;
    in.first_slot = first_slot;
    add_input_tensors(ctx, in, n_seqs);
    return in;
}

namespace {

ggml_tensor * rms_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * weight, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), weight);
}

// Offers `input`, which only the products with `weights` read, to fold_input (a weight stack
// stands for its parts: the products then multiply it, see SharedInputProducts, or its parts,
// which share its type and row length).
void offer_fold(const FoldInput & fold_input, ggml_tensor * input, std::initializer_list<const ggml_tensor *> weights) {
    if (!fold_input) return;
    std::vector<const ggml_tensor *> products;
    for (const ggml_tensor * w : weights) {
        const ggml_tensor * src0 = w->view_src ? w->view_src : w;
        if (std::find(products.begin(), products.end(), src0) == products.end()) products.push_back(src0);
    }
    fold_input(input, products);
}

// rms_norm(x) * weight where only products with `weights` read it
ggml_tensor * input_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * weight, float eps,
                         const FoldInput & fold_input, std::initializer_list<const ggml_tensor *> weights) {
    ggml_tensor * out = rms_norm(ctx, x, weight, eps);
    offer_fold(fold_input, out, weights);
    return out;
}

// x + product, where product is a weight product: offered to fold_input, so that our kernels may
// add x as they store the product (batches).
ggml_tensor * residual_add(ggml_context * ctx, const FoldInput & fold_input, ggml_tensor * x, ggml_tensor * product) {
    ggml_tensor * sum = ggml_add(ctx, x, product);
    if (product->op == GGML_OP_MUL_MAT) offer_fold(fold_input, sum, {product->src[0]});
    return sum;
}

// x / sqrt(sum(x^2) + eps) over ne0, written with rms_norm so eps enters exactly as in HF's l2norm.
ggml_tensor * l2_norm(ggml_context * ctx, ggml_tensor * x, float eps) {
    const float n = (float)x->ne[0];
    return ggml_scale(ctx, ggml_rms_norm(ctx, x, eps / n), 1.0f / std::sqrt(n));
}

// Products of one input x with several weights. Weights stacked at load (views of one tensor's
// rows, see load_weights) are multiplied as their whole stack, once, and each result is a view of
// its rows: one launch and one pass over x instead of one per weight. For a batch the view's
// columns are strided (a column of the stack's product holds every part), so the ops reading it
// must take strided rows (or get a ggml_cont).
class SharedInputProducts {
  public:
    SharedInputProducts(ggml_context * ctx, ggml_tensor * x) : ctx_(ctx), x_(x) {}

    const std::vector<ggml_tensor *> & products() const { return products_; }

    ggml_tensor * operator()(ggml_tensor * w) {
        ggml_tensor * stack = w->view_src;
        if (stack == nullptr) return products_.emplace_back(ggml_mul_mat(ctx_, w, x_));
        ggml_tensor * y = stacked_product(stack);
        const size_t first_row = w->view_offs / stack->nb[1];
        return ggml_view_2d(ctx_, y, w->ne[1], y->ne[1], y->nb[1], first_row * y->nb[0]);
    }

  private:
    ggml_tensor * stacked_product(ggml_tensor * stack) {
        for (auto & [s, y] : done_) {
            if (s == stack) return y;
        }
        ggml_tensor * y = products_.emplace_back(ggml_mul_mat(ctx_, stack, x_));
        return done_.emplace_back(stack, y).second;
    }

    ggml_context * ctx_;
    ggml_tensor * x_;
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> done_;  // stack -> its product with x
    std::vector<ggml_tensor *> products_;                        // every product made, in order
};

// When a batch's input projections are two products (weights of two types: Q4_K_M's Q6_K qkv or
// v beside the Q4_K stack of the rest), puts them next to each other in the graph and offers them
// to fold_input as a pair (see FoldInput): one quantization of x then serves both.
void offer_pair(const FoldInput & fold_input, ggml_cgraph * gf, const SharedInputProducts & project) {
    const std::vector<ggml_tensor *> & p = project.products();
    if (!fold_input || p.size() != 2 || p[0]->ne[1] < 2) return;  // one column: the mat-vecs prepare x in-kernel
    ggml_build_forward_expand(gf, p[0]);
    ggml_build_forward_expand(gf, p[1]);
    const int n = ggml_graph_n_nodes(gf);
    if (n >= 2 && ggml_graph_node(gf, n - 2) == p[0] && ggml_graph_node(gf, n - 1) == p[1]) fold_input(p[0], {p[1]});
}

// For text every IMROPE section carries the same position, which makes this NeoX RoPE on the
// first n_rot dims (HF: partial rotary with rotate_half); the other dims pass through. Linear and
// YaRN scaling enter as llama.cpp passes them (freq_scale, ext_factor, attn_factor, betas, n_ctx_orig).
ggml_tensor * rope(ggml_context * ctx, ggml_tensor * x, ggml_tensor * pos, const HParams & hp) {
    int sections[GGML_MROPE_SECTIONS];
    for (int i = 0; i < GGML_MROPE_SECTIONS; ++i) sections[i] = hp.rope_sections[i];
    return ggml_rope_multi(ctx, x, pos, nullptr, (int)hp.n_rot, sections, GGML_ROPE_TYPE_IMROPE,
                           (int)hp.rope_n_ctx_orig, hp.rope_freq_base, (float)hp.rope_freq_scale,
                           (float)hp.rope_ext_factor, (float)hp.rope_attn_factor, (float)hp.rope_beta_fast,
                           (float)hp.rope_beta_slow);
}

}  // namespace

// k_cache, v_cache: the sequence's own (one sequence) or every slot's (in.n_seqs > 0, StatePool).
ggml_tensor * gated_attention(ggml_context * ctx, ggml_cgraph * gf, const HParams & hp, const LayerWeights & l,
                              ggml_tensor * k_cache, ggml_tensor * v_cache, int64_t n_ctx_slot, ggml_tensor * x,
                              const StepInputs & in, const FoldInput & fold_input) {
    const int64_t T = in.n_tokens, D = hp.head_dim, H = hp.n_head, Hkv = hp.n_head_kv;
    const float eps = hp.rms_eps;

    SharedInputProducts project(ctx, x);
    // attn_q yields per head [query(D), gate(D)]; split with strided views.
    ggml_tensor * qg = project(l.wq);  // {2*H*D, T}
    const size_t f = sizeof(float);
    ggml_tensor * q = ggml_view_3d(ctx, qg, D, H, T, 2 * D * f, qg->nb[1], 0);
    ggml_tensor * gate = ggml_view_3d(ctx, qg, D, H, T, 2 * D * f, qg->nb[1], D * f);
    ggml_tensor * kp = project(l.wk);  // {Hkv*D, T}, maybe strided (a stack's rows)
    ggml_tensor * vp = project(l.wv);
    offer_pair(fold_input, gf, project);
    ggml_tensor * k = ggml_view_3d(ctx, kp, D, Hkv, T, D * f, kp->nb[1], 0);

    q = rms_norm(ctx, q, l.q_norm, eps);
    k = rms_norm(ctx, k, l.k_norm, eps);

    q = rope(ctx, q, in.pos, hp);
    k = rope(ctx, k, in.pos, hp);

    // Append this batch's K/V rows to the cache (converting to the cache type), then attend over
    // the first n_kv rows; the mask hides rows past each query's position. A tq3/tq4 cache has its
    // own write and attention nodes (ggml/deltaspec_tq.h), as has a rotated cache of a ggml type; a
    // head's row in a tq cache is head_bytes long.
    ggml_build_forward_expand(gf, deltaspec_kv_set_rows(ctx, k_cache, ggml_reshape_2d(ctx, k, D * Hkv, T), in.kv_rows));
    ggml_build_forward_expand(gf, deltaspec_kv_set_rows(ctx, v_cache, vp, in.kv_rows));
    const int format_k = deltaspec_kv_format(k_cache), format_v = deltaspec_kv_format(v_cache);
    ggml_tensor * out = nullptr;
    if (in.n_seqs > 0) {
        // one FA stream per sequence: its slot's first n_kv KV rows, its own queries and mask rows
        const int64_t N = in.n_seqs, Tq = T / N;
        auto streams = [&](ggml_tensor * cache) {
            const size_t slot_bytes = n_ctx_slot * cache->nb[1];
            ggml_tensor * view = ggml_view_4d(ctx, cache, deltaspec_kv_head_ne0(cache, D), Hkv, in.n_kv, N,
                                              deltaspec_kv_head_bytes(cache, D), cache->nb[1], slot_bytes,
                                              in.first_slot * slot_bytes);
            return ggml_permute(ctx, view, 0, 2, 1, 3);  // {D, n_kv, Hkv, N}
        };
        ggml_tensor * qs = ggml_permute(ctx, ggml_reshape_4d(ctx, q, D, H, Tq, N), 0, 2, 1, 3);  // {D, Tq, H, N}
        out = deltaspec_kv_flash_attn(ctx, qs, streams(k_cache), streams(v_cache), in.kq_mask,
                                      1.0f / std::sqrt((float)D), format_k, format_v);
    } else {
        ggml_tensor * kv_k = ggml_view_3d(ctx, k_cache, deltaspec_kv_head_ne0(k_cache, D), Hkv, in.n_kv,
                                          deltaspec_kv_head_bytes(k_cache, D), k_cache->nb[1], 0);
        ggml_tensor * kv_v = ggml_view_3d(ctx, v_cache, deltaspec_kv_head_ne0(v_cache, D), Hkv, in.n_kv,
                                          deltaspec_kv_head_bytes(v_cache, D), v_cache->nb[1], 0);
        out = deltaspec_kv_flash_attn(ctx, ggml_permute(ctx, q, 0, 2, 1, 3), ggml_permute(ctx, kv_k, 0, 2, 1, 3),
                                      ggml_permute(ctx, kv_v, 0, 2, 1, 3), in.kq_mask, 1.0f / std::sqrt((float)D),
                                      format_k, format_v);
    }
    ggml_prec_set_acc(out, GGML_PREC_F32);
    out = ggml_reshape_2d(ctx, out, H * D, T);  // FA returns {D, H, T} ({D, H, Tq, N} for streams)

    out = ggml_mul(ctx, out, ggml_sigmoid(ctx, ggml_reshape_2d(ctx, ggml_cont(ctx, gate), H * D, T)));
    return ggml_mul_mat(ctx, l.wo, out);
}

namespace {

ggml_tensor * gated_delta_net(ggml_context * ctx, ggml_cgraph * gf, const HParams & hp, const LayerWeights & l,
                              const StatePool & pool, const SequenceState & st, int il, ggml_tensor * x,
                              const StepInputs & in, const FoldInput & fold_input, VerifyStates * verify) {
    ggml_tensor * conv_state = st.conv[il];
    ggml_tensor * ssm_state = st.ssm[il];
    // rows of several sequences in consecutive slots (a tree batch's rows ops take any slots as they are)
    const bool several = in.n_seqs > 0 && !in.rows;
    const int64_t N = several ? in.n_seqs : 1;
    const int64_t T = in.n_tokens, Tq = T / N, S = hp.ssm_state_size, Hk = hp.ssm_n_k_heads, Hv = hp.ssm_n_v_heads;
    const int64_t C = hp.conv_channels(), Kc = hp.ssm_conv_kernel;
    const float eps = hp.rms_eps;
    const size_t f = sizeof(float);

    SharedInputProducts project(ctx, x);
    ggml_tensor * qkv = project(l.wqkv);    // {C, T}
    ggml_tensor * z = project(l.wgate);     // {Hv*S, T}
    ggml_tensor * beta = project(l.wbeta);  // {Hv, T}
    if (!ggml_is_contiguous(beta)) beta = ggml_cont(ctx, beta);  // ggml-cuda's sigmoid reads contiguous data
    beta = ggml_reshape_4d(ctx, ggml_sigmoid(ctx, beta), 1, Hv, Tq, N);
    // log-decay g = softplus(alpha + dt_bias) * (-exp(A_log)) <= 0
    ggml_tensor * g = ggml_softplus(ctx, ggml_add(ctx, project(l.walpha), l.dt_bias));
    g = ggml_reshape_4d(ctx, ggml_mul(ctx, g, l.ssm_a), 1, Hv, Tq, N);
    offer_pair(fold_input, gf, project);

    // Causal depthwise conv over [previous Kc-1 inputs | this batch]; keep the last Kc-1 as new state.
    ggml_tensor * conv_in = nullptr;
    ggml_tensor * y = nullptr;
    if (in.rows) {  // a tree: each row's window gathered along its ancestors, the pool read only
        ggml_tensor * windows = ggml_reshape_3d(ctx, pool.conv[il], Kc - 1, C, pool.n_seq);
        y = deltaspec_rows_ssm_conv(ctx, windows, qkv, l.conv1d, in.rows);  // {C, T, 1}
        if (in.keep_states) {  // a verify batch (a prefill of rows writes its slots back in the op)
            ggml_set_output(qkv->view_src ? qkv->view_src : qkv);
            verify->conv_x[il] = qkv;
        }
    } else if (several) {  // per sequence: {Kc-1+Tq, C, N}; the windows of the slots, read and written in place
        ggml_tensor * windows = ggml_view_3d(ctx, pool.conv[il], Kc - 1, C, N, (Kc - 1) * f, pool.conv[il]->nb[1],
                                             in.first_slot * pool.conv[il]->nb[1]);
        ggml_tensor * rows = ggml_view_3d(ctx, qkv, C, Tq, N, qkv->nb[1], Tq * qkv->nb[1], 0);
        conv_in = ggml_concat(ctx, windows, ggml_permute(ctx, rows, 1, 0, 2, 3), 0);
        ggml_tensor * last = ggml_view_3d(ctx, conv_in, Kc - 1, C, N, conv_in->nb[1], conv_in->nb[2], Tq * f);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, last, windows));
    } else {
        conv_in = ggml_concat(ctx, conv_state, ggml_transpose(ctx, qkv), 0);  // {Kc-1+T, C}
        ggml_tensor * last_window = ggml_view_2d(ctx, conv_in, Kc - 1, C, conv_in->nb[1], T * f);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, last_window, conv_state));
    }
    if (in.keep_states && !in.rows) {  // every token's window, for a rollback
        ggml_set_output(conv_in);
        verify->conv_in[il] = conv_in;
    }
    if (!in.rows) y = ggml_ssm_conv(ctx, ggml_reshape_3d(ctx, conv_in, Kc - 1 + Tq, C, N), l.conv1d);  // {C, Tq, N}
    y = ggml_silu(ctx, y);

    // q and k heads sit side by side in y: one l2-norm (one launch) covers both
    ggml_tensor * qk = l2_norm(ctx, ggml_view_4d(ctx, y, S, 2 * Hk, Tq, N, S * f, y->nb[1], y->nb[2], 0), eps);
    ggml_tensor * q = ggml_view_4d(ctx, qk, S, Hk, Tq, N, qk->nb[1], qk->nb[2], qk->nb[3], 0);
    ggml_tensor * k = ggml_view_4d(ctx, qk, S, Hk, Tq, N, qk->nb[1], qk->nb[2], qk->nb[3], Hk * qk->nb[1]);
    ggml_tensor * v = ggml_view_4d(ctx, y, S, Hv, Tq, N, S * f, y->nb[1], y->nb[2], 2 * Hk * S * f);

    // The op scales q by 1/sqrt(S) itself and broadcasts q/k head h % Hk to value head h, which is
    // the tiled V-head order the converter writes.
    // several: the slots' states side by side in the pool, a view (the op reads them in place)
    ggml_tensor * slots_state =
        several ? ggml_view_2d(ctx, pool.ssm[il], S * S * Hv, N, pool.ssm[il]->nb[1], in.first_slot * pool.ssm[il]->nb[1])
                : nullptr;
    ggml_tensor * state = ggml_reshape_4d(ctx, several ? slots_state : ssm_state, S, S, Hv, N);
    // The op returns the outputs, then the state after the last token (per sequence); the rows op
    // returns the outputs, then the states saved at the tree's branch points.
    ggml_tensor * res = in.rows ? deltaspec_rows_gated_delta_net(ctx, q, k, v, g, beta,
                                                                  ggml_reshape_4d(ctx, pool.ssm[il], S, S, Hv, pool.n_seq),
                                                                  in.rows, in.n_saved)
                                : ggml_gated_delta_net(ctx, q, k, v, g, beta, state, 1);
    if (in.rows) deltaspec_rows_set_max_walks(res, rows_max_walks(in));
    ggml_tensor * o = ggml_view_4d(ctx, res, S, Hv, Tq, N, S * f, S * Hv * f, S * Hv * Tq * f, 0);
    if (several) {
        // back into the slots' view: one token per sequence is the form ggml-cuda fuses into the
        // op (the kernel writes the new states in place), as for one sequence below
        ggml_tensor * new_states = ggml_view_2d(ctx, res, S * S * Hv, N, S * S * Hv * f, S * Hv * T * f);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, new_states, slots_state));
    } else if (in.rows && in.keep_states) {  // the pool stays; keep_path replays the accepted path from these
        for (ggml_tensor * t : {q, k, v, g, beta}) ggml_set_output(t->view_src ? t->view_src : t);
        verify->q[il] = q;
        verify->k[il] = k;
        verify->v[il] = v;
        verify->g[il] = g;
        verify->beta[il] = beta;
        verify->n_tokens = T;
    } else if (in.keep_states) {  // the state stays; keep(n) advances it from these (VerifyStates)
        for (ggml_tensor * t : {q, k, v, g, beta, res}) ggml_set_output(t->view_src ? t->view_src : t);
        verify->q[il] = q;
        verify->k[il] = k;
        verify->v[il] = v;
        verify->g[il] = g;
        verify->beta[il] = beta;
        verify->result[il] = res;
        verify->n_tokens = T;
    } else if (in.rows) {
        // a prefill of rows (Engine::prefill_rows): each slot's last row wrote its state back in the op
    } else {
        ggml_tensor * new_state = ggml_view_1d(ctx, res, S * S * Hv, S * Hv * T * f);
        // One token: copy into a view of the state, the form ggml-cuda fuses into the op (its kernel
        // then writes the new state in place and the 3 MB copy per layer is gone). Batches keep
        // the plain copy: the fused form would take them from our recurrence kernel to ggml's.
        ggml_tensor * target = T == 1 ? ggml_view_1d(ctx, ssm_state, ggml_nelements(ssm_state), 0) : ssm_state;
        ggml_build_forward_expand(gf, ggml_cpy(ctx, new_state, target));
    }

    // Gated RMSNorm per head: norm(o) * w * silu(z), as one SwiGLU of rows (which takes z's
    // strided columns).
    o = ggml_reshape_2d(ctx, rms_norm(ctx, o, l.ssm_norm, eps), Hv * S, T);
    ggml_tensor * gated = ggml_swiglu_split(ctx, z, o);
    offer_fold(fold_input, gated, {l.ssm_out});
    return ggml_mul_mat(ctx, l.ssm_out, gated);
}

}  // namespace

ggml_tensor * swiglu_ffn(ggml_context * ctx, ggml_cgraph * gf, const LayerWeights & l, ggml_tensor * x,
                         const FoldInput & fold_input) {
    // One token: two products, which ggml-cuda fuses with the SwiGLU into one mat-vec. A batch:
    // the gate/up stack's product, once.
    ggml_tensor * h = nullptr;
    if (x->ne[1] == 1) {
        // Stacked weights are views, which are graph nodes: put them in the graph first, so that
        // the two products and the SwiGLU stay adjacent, as ggml-cuda's fusion needs.
        for (ggml_tensor * w : {l.ffn_gate, l.ffn_up}) {
            if (w->view_src) ggml_build_forward_expand(gf, w);
        }
        h = ggml_swiglu_split(ctx, ggml_mul_mat(ctx, l.ffn_gate, x), ggml_mul_mat(ctx, l.ffn_up, x));
    } else {
        SharedInputProducts project(ctx, x);
        h = ggml_swiglu_split(ctx, project(l.ffn_gate), project(l.ffn_up));
        offer_fold(fold_input, h, {l.ffn_down});
    }
    return ggml_mul_mat(ctx, l.ffn_down, h);
}

ggml_tensor * build_qwen35(ggml_context * ctx, ggml_cgraph * gf, const HParams & hp, const ModelWeights & w,
                           const StatePool & pool, const SequenceState & st, const StepInputs & in,
                           int64_t n_logit_rows, const FoldInput & fold_input, VerifyStates * verify,
                           Taps * taps) {
    // a prefill of rows of several slots (rows, no verify states) returns each slot's last row
    const bool prefill_rows = in.n_seqs > 0 && in.rows && !in.keep_states;
    if (in.n_seqs > 0 && ((in.keep_states && !in.rows) || in.n_tokens % in.n_seqs != 0 ||
                          (n_logit_rows != 0 && n_logit_rows != (prefill_rows ? in.n_seqs : in.n_tokens)))) {
        throw std::logic_error("build_qwen35: rows of several sequences: equal rows per sequence, logits of every row "
                               "(each sequence's last row for a prefill) or none, verified as rows (no chain verify)");
    }
    if (in.keep_states) {
        if (verify == nullptr) throw std::logic_error("build_qwen35: a verify batch needs VerifyStates");
        VerifyStates & v = *verify;
        for (auto * per_layer : {&v.conv_in, &v.q, &v.k, &v.v, &v.g, &v.beta, &v.result, &v.conv_x}) {
            per_layer->assign(hp.n_layer, nullptr);
        }
    }
    const float eps = hp.rms_eps;
    ggml_tensor * x = ggml_get_rows(ctx, w.token_embd, in.tokens);  // {E, T}
    // a tapped hidden state: a graph output, so the allocator leaves it for the caller to read
    auto tap = [&](int il, ggml_tensor * h) {
        if (!taps) return;
        for (size_t i = 0; i < taps->layers.size(); ++i) {
            if (taps->layers[i] != il) continue;
            ggml_set_output(h);
            ggml_build_forward_expand(gf, h);
            taps->out[i] = h;
        }
    };
    if (taps) taps->out.assign(taps->layers.size(), nullptr);

    for (int il = 0; il < hp.n_layer; ++il) {
        const LayerWeights & l = w.layers[il];
        ggml_tensor * a = hp.recurrent[il]
                              ? input_norm(ctx, x, l.attn_norm, eps, fold_input, {l.wqkv, l.wgate, l.wbeta, l.walpha})
                              : input_norm(ctx, x, l.attn_norm, eps, fold_input, {l.wq, l.wk, l.wv});
        ggml_tensor * mixed = hp.recurrent[il]
                                  ? gated_delta_net(ctx, gf, hp, l, pool, st, il, a, in, fold_input, verify)
                                  : in.n_seqs > 0 ? gated_attention(ctx, gf, hp, l, pool.k[il], pool.v[il], pool.n_ctx, a, in,
                                                                    fold_input)
                                                  : gated_attention(ctx, gf, hp, l, st.k[il], st.v[il], st.n_ctx, a, in,
                                                                    fold_input);
        x = residual_add(ctx, fold_input, x, mixed);
        ggml_tensor * h = input_norm(ctx, x, l.post_norm, eps, fold_input, {l.ffn_gate, l.ffn_up});
        x = residual_add(ctx, fold_input, x, swiglu_ffn(ctx, gf, l, h, fold_input));
        tap(il, x);
    }
    if (taps && std::find(taps->layers.begin(), taps->layers.end(), hp.n_layer) != taps->layers.end()) {
        tap(hp.n_layer, rms_norm(ctx, x, w.output_norm, eps));  // every row, whatever the head reads
    }

    // A prefill micro-batch whose logits nobody reads skips the head (n_vocab x E per row).
    if (n_logit_rows == 0) return nullptr;
    if (prefill_rows) {  // row Tq-1 of every slot's Tq rows
        const int64_t Tq = in.n_tokens / in.n_seqs;
        x = ggml_cont(ctx, ggml_view_2d(ctx, x, x->ne[0], in.n_seqs, Tq * x->nb[1], (Tq - 1) * x->nb[1]));
    } else if (n_logit_rows < in.n_tokens) {
        x = ggml_view_2d(ctx, x, x->ne[0], n_logit_rows, x->nb[1], (in.n_tokens - n_logit_rows) * x->nb[1]);
    }
    x = input_norm(ctx, x, w.output_norm, eps, fold_input, {w.output});
    ggml_tensor * logits = ggml_mul_mat(ctx, w.output, x);
    ggml_set_output(logits);
    ggml_build_forward_expand(gf, logits);
    return logits;
}

}  // namespace deltaspec
