// The Engine's side of a layer split (layer_split.h): which backends its schedulers get, how the
// small graphs that run outside the step graphs (keep()'s replay, the accepted paths' commit) run
// when their tensors live on several devices, and what each device holds.
#include <stdexcept>

#include "engine.h"

namespace deltaspec {

std::vector<ggml_backend_t> Engine::sched_backends() const {
    if (split_.active()) return split_.sched_backends();
    if (backend_ == backend_cpu_) return {backend_};
    return {backend_, backend_cpu_};
}

void Engine::compute_split_graph(ggml_cgraph * gf, size_t graph_size, const char * what) {
    // A scheduler of its own, for this one run: it places each node on the device of the state it
    // writes (or of its weights) and copies what a node reads from another device, as for a step.
    if (split_bug() == SplitBug::no_side_graph) return;
    std::vector<ggml_backend_t> backends = sched_backends();
    ggml_backend_sched_t sched =
        ggml_backend_sched_new(backends.data(), nullptr, (int)backends.size(), graph_size, false, false);
    if (!sched) throw std::runtime_error("cannot create the ggml scheduler");
    const ggml_status status = ggml_backend_sched_graph_compute(sched, gf);
    ggml_backend_sched_free(sched);
    if (status != GGML_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + " failed");
}

std::vector<DeviceLayers> Engine::device_layers() const {
    const std::vector<ggml_backend_t> places = split_.active() ? split_.backends : std::vector<ggml_backend_t>{backend_};
    std::vector<DeviceLayers> out(places.size());
    for (size_t p = 0; p < places.size(); ++p) {
        out[p].device = split_.active() ? split_.names[p] : opts_.device;
        out[p].backend = ggml_backend_name(places[p]);
    }
    // a tensor's place: the one whose buffer holds it (one device: the only one)
    auto place_of = [&](const ggml_tensor * t, const std::vector<ggml_backend_buffer_t> & buffers) -> int {
        if (!split_.active()) return 0;
        const ggml_backend_buffer_t b = t->view_src ? t->view_src->buffer : t->buffer;
        for (size_t p = 0; p < buffers.size(); ++p) {
            if (buffers[p] != nullptr && buffers[p] == b) return (int)p;
        }
        throw std::logic_error(std::string("tensor '") + ggml_get_name(t) + "' is in none of the split's buffers");
    };
    const std::vector<ggml_backend_buffer_t> & wb = weights_.split_buffers;
    for (ggml_tensor * t = ggml_get_first_tensor(weights_.ctx); t; t = ggml_get_next_tensor(weights_.ctx, t)) {
        if (!t->view_src) out[place_of(t, wb)].weight_bytes += ggml_nbytes(t);
    }
    for (int il = 0; il < hp_.n_layer; ++il) out[place_of(weights_.layers[il].attn_norm, wb)].layers.push_back(il);
    out[place_of(weights_.token_embd, wb)].input = true;
    out[place_of(weights_.output, wb)].output = true;
    const std::vector<ggml_backend_buffer_t> & sb = pool_.split_buffers;
    for (size_t il = 0; il < pool_.k.size(); ++il) {
        for (const ggml_tensor * t : {pool_.k[il], pool_.v[il]}) {
            if (t) out[place_of(t, sb)].kv_bytes += ggml_nbytes(t);
        }
        for (const ggml_tensor * t : {pool_.conv[il], pool_.ssm[il]}) {
            if (t) out[place_of(t, sb)].state_bytes += ggml_nbytes(t);
        }
    }
    return out;
}

}  // namespace deltaspec
