// The recurrent states after accepted paths, committed by our CUDA kernels (Engine::commit_states_cuda,
// called by commit_paths): per slot, one launch rolls every DeltaNet layer's state along the path's
// rows from the verify pass's inputs (the chain keep()'s replay, gathering rows), one gathers every
// layer's conv window from the path's last inputs. As the rows ops in a commit graph this was three
// launches a layer, 144 on a 27B, whose launch latency made a tree's commit cost 0.9 ms on the H200
// against 0.2 for a chain's keep(): the difference between a verify round of 1 + 22 tree rows and
// the chain of the same width.
//
// The arithmetic is the rows ops' (both run deltanet_columns.cuh's token step in ggml's order), so
// the state is the one the verify pass's rows went through.
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "cuda_kernels.h"
#include "engine.h"

namespace deltaspec {

bool Engine::commit_states_cuda(const std::vector<std::vector<int32_t>> & paths) {
    // our launches take raw pointers of one GPU: a layer split's states span devices
    if (backend_ == backend_cpu_ || split_.active()) return false;
    const VerifyStates & vs = step_.verify;
    const RowsPending & pend = rows_pending_;
    const int64_t f = sizeof(float), S = hp_.ssm_state_size, H = hp_.ssm_n_v_heads;
    const int64_t C = hp_.conv_channels(), W = hp_.ssm_conv_kernel - 1;
    if (W < 1 || W > DELTASPEC_WINDOW_MAX) return false;

    // every recurrent layer's pools and conv inputs, checked once (the recurrence's inputs are
    // checked as they are added below, before anything is launched)
    std::vector<int> layers;
    for (int il = 0; il < hp_.n_layer; ++il) {
        if (!vs.q[il]) continue;
        const ggml_tensor *x = vs.conv_x[il], *ssm = pool_.ssm[il], *conv = pool_.conv[il];
        for (const ggml_tensor * t : {x, ssm, conv}) {
            if (t == nullptr || t->type != GGML_TYPE_F32 || t->nb[0] != f || t->data == nullptr) return false;
        }
        if (!ggml_is_contiguous(ssm) || !ggml_is_contiguous(conv) || ggml_nelements(ssm) != S * S * H * pool_.n_seq ||
            ggml_nelements(conv) != W * C * pool_.n_seq || x->ne[0] != C) {
            return false;
        }
        layers.push_back(il);
    }
    if (layers.empty()) return false;  // no recurrent layer: nothing for the kernels

    // per slot with a path: its rows, its states' and windows' places in the pools
    std::vector<deltaspec_deltanet_path> state_paths;
    std::vector<deltaspec_window_path> window_paths;
    deltaspec_deltanet_replay shape = {};
    std::vector<deltaspec_deltanet_layer> state_layers;
    std::vector<deltaspec_window_layer> window_layers;
    for (size_t i = 0; i < paths.size(); ++i) {
        const std::vector<int32_t> & path = paths[i];
        const int64_t n = (int64_t)path.size();
        if (n == 0) continue;
        if (n > DELTASPEC_DELTANET_PATH_MAX) return false;
        deltaspec_deltanet_path sp = {};
        sp.n_rows = (int32_t)n;
        std::copy(path.begin(), path.end(), sp.rows);
        state_paths.push_back(sp);
        const int64_t slot = pend.first_slot + (int64_t)i;
        deltaspec_window_path wp = {};
        wp.channels = C;
        wp.width = (int32_t)W;
        wp.n_rows = (int32_t)n;
        const int64_t kept = std::min(n, W);
        std::copy(path.end() - kept, path.end(), wp.last);
        window_paths.push_back(wp);
        for (int il : layers) {
            if (!add_deltanet_replay_layer(vs.q[il], vs.k[il], vs.v[il], vs.g[il], vs.beta[il],
                                           (float *)pool_.ssm[il]->data + slot * S * S * H, shape, state_layers)) {
                return false;
            }
            window_layers.push_back({(const float *)vs.conv_x[il]->data, (float *)pool_.conv[il]->data + slot * C * W,
                                     (int64_t)(vs.conv_x[il]->nb[1] / f)});
        }
    }
    if (state_paths.empty()) return false;  // no slot keeps a row: nothing for the kernels

    ggml_backend_synchronize(backend_);  // the verify pass wrote the inputs; ours run on a stream of their own
    // the states first: their launch declines before touching anything (kernels off, a state size it
    // does not serve), and then the graph commits both
    if (!cuda_deltanet_replay_paths(shape, state_paths, state_layers)) return false;
    if (!cuda_commit_windows(window_paths, window_layers)) {
        throw std::runtime_error("the conv windows of the accepted paths were not committed after their DeltaNet states");
    }
    return true;
}

}  // namespace deltaspec
