// Keeping the first n tokens of a verify batch (Engine::keep): the batch's graph advanced the KV
// rows and conv windows by all T tokens and left the DeltaNet states as they were before it, with
// the recurrence's inputs and the state after the last token as graph outputs (VerifyStates).
// For n < T the conv windows after token n-1 are copied back and each DeltaNet state is rolled
// forward by the recurrence of the first n tokens; for n = T the states after the batch are
// copied in. On CUDA with our kernels each is one launch for all layers, otherwise a small ggml
// graph does it.
#include <stdexcept>
#include <vector>

#include "cuda_kernels.h"
#include "engine.h"
#include "ggml-alloc.h"

namespace deltaspec {

namespace {

// A tensor of ctx over t's data, without t's op and sources (a graph over t must not pull in the
// graph that computed it). t's values must be contiguous (they are: see VerifyStates).
ggml_tensor * detached(ggml_context * ctx, const ggml_tensor * t) {
    ggml_tensor * d = ggml_new_tensor(ctx, t->type, GGML_MAX_DIMS, t->ne);
    if (!ggml_is_contiguous(t) || ggml_backend_tensor_alloc(t->buffer, d, t->data) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("cannot alias a verify graph output");
    }
    return d;
}

}  // namespace

void Engine::advance_verify_state(int64_t n) {
    const bool all = n == verify_T_;  // the graph left the windows after all T tokens
    const bool on_gpu = backend_ != backend_cpu_;
    if (on_gpu) ggml_backend_synchronize(backend_);  // our launches run on a stream of their own
    const bool conv = all || (on_gpu && copy_conv_windows_cuda(n));
    const bool deltanet = on_gpu && (all ? copy_last_states_cuda() : replay_deltanet_cuda(n));
    if (!conv || !deltanet) advance_verify_state_graph(n, !conv, !deltanet);
}

bool Engine::copy_conv_windows_cuda(int64_t n) {
    const VerifyStates & vs = step_.verify;
    std::vector<deltaspec_copy> jobs;
    for (int il = 0; il < hp_.n_layer; ++il) {
        if (!vs.conv_in[il]) continue;
        const ggml_tensor * conv = state_.conv[il];
        const ggml_tensor * conv_in = vs.conv_in[il];
        if (conv->type != GGML_TYPE_F32 || conv->nb[0] != sizeof(float) || conv_in->nb[0] != sizeof(float)) {
            return false;
        }
        // the window: Kc-1 columns of every channel's row
        const int64_t conv_in_stride = conv_in->nb[1] / sizeof(float), conv_stride = conv->nb[1] / sizeof(float);
        jobs.push_back({(const float *)conv_in->data + vs.window_column(verify_T_ - n), (float *)conv->data,
                        conv->ne[1], conv->ne[0], conv_in_stride, conv_stride});
    }
    return cuda_copy_rows(jobs);
}

bool Engine::copy_last_states_cuda() {
    const VerifyStates & vs = step_.verify;
    std::vector<deltaspec_copy> jobs;
    for (int il = 0; il < hp_.n_layer; ++il) {
        if (!vs.result[il]) continue;
        const ggml_tensor * ssm = state_.ssm[il];
        if (ssm->type != GGML_TYPE_F32 || !ggml_is_contiguous(ssm)) return false;
        const char * last = (const char *)vs.result[il]->data + vs.last_state_offs;
        jobs.push_back({(const float *)last, (float *)ssm->data, 1, ggml_nelements(ssm), 0, 0});
    }
    return cuda_copy_rows(jobs);
}

bool Engine::replay_deltanet_cuda(int64_t n) {
    const VerifyStates & vs = step_.verify;
    const int64_t S = hp_.ssm_state_size, Hk = hp_.ssm_n_k_heads, Hv = hp_.ssm_n_v_heads, f = sizeof(float);
    std::vector<deltaspec_deltanet_layer> layers;
    deltaspec_deltanet_replay shape = {};
    for (int il = 0; il < hp_.n_layer; ++il) {
        if (!vs.qk[il]) continue;
        const ggml_tensor *qk = vs.qk[il], *y = vs.y[il], *g = vs.g[il], *beta = vs.beta[il];
        const ggml_tensor * ssm = state_.ssm[il];
        for (const ggml_tensor * t : {qk, y, g, beta, ssm}) {
            if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) return false;
        }
        // q: heads 0..Hk-1 of a token's qk column, k: heads Hk..2Hk-1; v: the last Hv*S of y's
        shape = {Hv, Hk, S, n, S, qk->nb[2] / f, S, y->nb[1] / f, g->nb[1] / f, g->nb[2] / f};
        const float * qk_data = (const float *)qk->data;
        layers.push_back({qk_data, qk_data + Hk * S, (const float *)y->data + 2 * Hk * S, (const float *)g->data,
                          (const float *)beta->data, (float *)ssm->data});
    }
    return layers.empty() || cuda_deltanet_replay(shape, layers);
}

void Engine::advance_verify_state_graph(int64_t n, bool conv, bool deltanet) {
    const VerifyStates & vs = step_.verify;
    const int64_t S = hp_.ssm_state_size, Hk = hp_.ssm_n_k_heads, Hv = hp_.ssm_n_v_heads;
    const size_t f = sizeof(float);
    // per recurrent layer at most 6 aliases and 18 other tensors, 12 of them the graph's nodes
    const size_t n_tensors = 24 * (size_t)hp_.n_layer + 16, n_nodes = 12 * (size_t)hp_.n_layer + 16;
    ggml_init_params params = {ggml_tensor_overhead() * n_tensors + ggml_graph_overhead_custom(n_nodes, false),
                               nullptr, /*no_alloc =*/true};
    ggml_context * ctx = ggml_init(params);
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, n_nodes, false);
    ggml_backend_buffer_t results = nullptr;  // the replays' outputs
    bool replays = false;
    try {
        for (int il = 0; il < hp_.n_layer; ++il) {
            if (!vs.conv_in[il]) continue;
            if (conv) {
                ggml_tensor * state = state_.conv[il];
                ggml_tensor * conv_in = detached(ctx, vs.conv_in[il]);
                ggml_tensor * window = ggml_view_2d(ctx, conv_in, state->ne[0], state->ne[1], conv_in->nb[1],
                                                    vs.window_column(verify_T_ - n) * conv_in->nb[0]);
                ggml_build_forward_expand(gf, ggml_cpy(ctx, window, state));
            }
            if (deltanet && n == verify_T_) {  // the state after the batch, as the op left it
                ggml_tensor * ssm = state_.ssm[il];
                ggml_tensor * result = detached(ctx, vs.result[il]);
                ggml_tensor * last = ggml_view_1d(ctx, result, ggml_nelements(ssm), vs.last_state_offs);
                ggml_build_forward_expand(gf, ggml_cpy(ctx, last, ssm));
            } else if (deltanet) {  // the verify graph's op over the first n tokens, from the live state
                ggml_tensor * ssm = state_.ssm[il];
                ggml_tensor * qk = detached(ctx, vs.qk[il]);
                ggml_tensor * y = detached(ctx, vs.y[il]);
                ggml_tensor * g = detached(ctx, vs.g[il]);
                ggml_tensor * beta = detached(ctx, vs.beta[il]);
                ggml_tensor * q = ggml_view_4d(ctx, qk, S, Hk, n, 1, qk->nb[1], qk->nb[2], qk->nb[3], 0);
                ggml_tensor * k = ggml_view_4d(ctx, qk, S, Hk, n, 1, qk->nb[1], qk->nb[2], qk->nb[3], Hk * qk->nb[1]);
                ggml_tensor * v = ggml_view_4d(ctx, y, S, Hv, n, 1, S * f, y->nb[1], y->nb[2], 2 * Hk * S * f);
                g = ggml_view_4d(ctx, g, 1, Hv, n, 1, g->nb[1], g->nb[2], g->nb[3], 0);
                beta = ggml_view_4d(ctx, beta, 1, Hv, n, 1, beta->nb[1], beta->nb[2], beta->nb[3], 0);
                ggml_tensor * state = ggml_reshape_4d(ctx, ssm, S, S, Hv, 1);
                ggml_tensor * res = ggml_gated_delta_net(ctx, q, k, v, g, beta, state, 1);
                ggml_tensor * after = ggml_view_1d(ctx, res, S * S * Hv, S * Hv * n * f);
                ggml_build_forward_expand(gf, ggml_cpy(ctx, after, ssm));
                replays = true;
            }
        }
        results = ggml_backend_alloc_ctx_tensors(ctx, backend_);  // the replays' results (none for windows alone)
        if (results == nullptr && replays) throw std::runtime_error("cannot allocate the recurrent state's replay");
        for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
            if (t->view_src != nullptr && t->buffer == nullptr) ggml_backend_view_init(t);  // in creation order
        }
        if (ggml_backend_graph_compute(backend_, gf) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("advancing the recurrent state failed");
        }
    } catch (...) {
        if (results) ggml_backend_buffer_free(results);
        ggml_free(ctx);
        throw;
    }
    if (results) ggml_backend_buffer_free(results);
    ggml_free(ctx);
}

}  // namespace deltaspec
