// Keeping the first n tokens of a verify batch (Engine::keep): the batch's graph advanced the KV
// rows and conv windows by all T tokens and left the DeltaNet states as they were before it, with
// the recurrence's inputs and the state after the last token as graph outputs (VerifyStates).
// For n < T the conv windows after token n-1 are copied back and each DeltaNet state is rolled
// forward by the recurrence of the first n tokens; for n = T the states after the batch are
// copied in. On CUDA with our kernels each is one launch for all layers, otherwise a small ggml
// graph does it.
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "cuda_kernels.h"
#include "engine.h"
#include "ggml-alloc.h"
#include "output_alias.h"

namespace deltaspec {

namespace {

// The first n tokens (dim 2) of t, a view of a verify graph output, as a view in ctx.
ggml_tensor * first_tokens(ggml_context * ctx, const ggml_tensor * t, int64_t n) {
    ggml_tensor * base = detached(ctx, t->view_src ? t->view_src : t);
    return ggml_view_4d(ctx, base, t->ne[0], t->ne[1], n, t->ne[3], t->nb[1], t->nb[2], t->nb[3],
                        t->view_src ? t->view_offs : 0);
}

// Where the DeltaNet op's result (outputs, then the state after the last token) holds that state.
size_t last_state_offset(const ggml_tensor * result, const ggml_tensor * state) {
    return ggml_nbytes(result) - ggml_nbytes(state);
}

}  // namespace

void Engine::advance_verify_state(int64_t n) {
    const bool any_recurrent = std::any_of(hp_.recurrent.begin(), hp_.recurrent.end(), [](bool r) { return r; });
    if (!any_recurrent) return;  // attention layers only: the KV rows past n are dead, nothing to advance
    const bool all = n == verify_T_;  // the graph left the windows after all T tokens
    // our CUDA launches take raw pointers of one GPU: a layer split's state spans devices
    const bool on_gpu = backend_ != backend_cpu_ && !split_.active();
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
        const ggml_tensor * conv = seq().conv[il];
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
        const ggml_tensor * ssm = seq().ssm[il];
        if (ssm->type != GGML_TYPE_F32 || !ggml_is_contiguous(ssm)) return false;
        const char * last = (const char *)vs.result[il]->data + last_state_offset(vs.result[il], ssm);
        jobs.push_back({(const float *)last, (float *)ssm->data, 1, ggml_nelements(ssm), 0, 0});
    }
    return cuda_copy_rows(jobs);
}

bool Engine::replay_deltanet_cuda(int64_t n) {
    const VerifyStates & vs = step_.verify;
    std::vector<deltaspec_deltanet_layer> layers;
    deltaspec_deltanet_replay shape = {};
    shape.n_tokens = n;
    for (int il = 0; il < hp_.n_layer; ++il) {
        if (!vs.q[il]) continue;
        ggml_tensor * ssm = seq().ssm[il];
        if (ssm->type != GGML_TYPE_F32 || !ggml_is_contiguous(ssm) ||
            !add_deltanet_replay_layer(vs.q[il], vs.k[il], vs.v[il], vs.g[il], vs.beta[il], (float *)ssm->data, shape,
                                       layers)) {
            return false;
        }
    }
    return cuda_deltanet_replay(shape, layers);
}

void Engine::advance_verify_state_graph(int64_t n, bool conv, bool deltanet) {
    const VerifyStates & vs = step_.verify;
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
                ggml_tensor * state = seq().conv[il];
                ggml_tensor * conv_in = detached(ctx, vs.conv_in[il]);
                ggml_tensor * window = ggml_view_2d(ctx, conv_in, state->ne[0], state->ne[1], conv_in->nb[1],
                                                    vs.window_column(verify_T_ - n) * conv_in->nb[0]);
                ggml_build_forward_expand(gf, ggml_cpy(ctx, window, state));
            }
            if (deltanet && n == verify_T_) {  // the state after the batch, as the op left it
                ggml_tensor * ssm = seq().ssm[il];
                ggml_tensor * result = detached(ctx, vs.result[il]);
                ggml_tensor * last =
                    ggml_view_1d(ctx, result, ggml_nelements(ssm), last_state_offset(vs.result[il], ssm));
                ggml_build_forward_expand(gf, ggml_cpy(ctx, last, ssm));
            } else if (deltanet) {  // the verify graph's op over the first n tokens, from the live state
                ggml_tensor * ssm = seq().ssm[il];
                const ggml_tensor * v = vs.v[il];
                ggml_tensor * state = ggml_reshape_4d(ctx, ssm, v->ne[0], v->ne[0], v->ne[1], 1);
                ggml_tensor * res =
                    ggml_gated_delta_net(ctx, first_tokens(ctx, vs.q[il], n), first_tokens(ctx, vs.k[il], n),
                                         first_tokens(ctx, v, n), first_tokens(ctx, vs.g[il], n),
                                         first_tokens(ctx, vs.beta[il], n), state, 1);
                ggml_tensor * after = ggml_view_1d(ctx, res, ggml_nelements(ssm), last_state_offset(res, ssm));
                ggml_build_forward_expand(gf, ggml_cpy(ctx, after, ssm));
                replays = true;
            }
        }
        if (split_.active()) {  // the layers' states and outputs live on several devices
            compute_split_graph(gf, n_tensors, "advancing the recurrent state");
            ggml_free(ctx);
            return;
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
