#include "layer_split.h"
#include "env.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

#include <thread>

#include "ggml-alloc.h"
#ifdef DELTASPEC_RPC
#include "ggml-rpc.h"
#endif

namespace deltaspec {

ggml_backend_dev_t backend_device(const std::string & device);  // engine.cpp

namespace {

// A split's device: a name backend_device takes, or "rpc:HOST:PORT", the first device of ggml's RPC
// server there (the caller checks that it answers: ggml aborts the process when it does not).
ggml_backend_dev_t split_device(const std::string & name) {
    if (name.rfind("rpc:", 0) != 0) return backend_device(name);
#ifdef DELTASPEC_RPC
    ggml_backend_reg_t reg = ggml_backend_rpc_add_server(name.substr(4).c_str());
    if (!reg || ggml_backend_reg_dev_count(reg) == 0) {
        throw std::runtime_error("devices: the RPC server at '" + name.substr(4) + "' offers no device");
    }
    return ggml_backend_reg_dev_get(reg, 0);
#else
    throw std::invalid_argument("devices: '" + name + "': this build of deltaspec has no RPC backend");
#endif
}

}  // namespace

bool rpc_available() {
#ifdef DELTASPEC_RPC
    return true;
#else
    return false;
#endif
}

void start_rpc_server(const std::string & endpoint, int n_threads) {
#ifdef DELTASPEC_RPC
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    // it serves until the process ends (ggml has no call that stops it)
    std::thread([endpoint, n_threads, cpu]() mutable {
        ggml_backend_rpc_start_server(endpoint.c_str(), nullptr, (size_t)std::max(1, n_threads), 1, &cpu);
    }).detach();
#else
    (void)endpoint;
    (void)n_threads;
    throw std::runtime_error("this build of deltaspec has no RPC backend");
#endif
}

SplitBug split_bug() {
    return static_cast<SplitBug>(planted_choice("DELTASPEC_TEST_SPLIT_BUG",
                                                {"all_first", "state_first", "no_side_graph"}));
}

std::vector<int> layer_devices(int64_t n_blocks, const std::vector<float> & tensor_split) {
    if (n_blocks < 0) throw std::invalid_argument("layer_devices: n_blocks must be >= 0");
    if (tensor_split.empty()) throw std::invalid_argument("tensor_split: needs one entry per device, got none");
    double sum = 0;
    for (float x : tensor_split) {
        if (!std::isfinite(x) || x < 0) {
            throw std::invalid_argument("tensor_split: entries must be finite and >= 0, got " + std::to_string(x));
        }
        sum += x;
    }
    if (sum <= 0) throw std::invalid_argument("tensor_split: at least one entry must be > 0");
    // split points in float, as llama.cpp computes them (a layer on a boundary falls the same way)
    std::vector<float> points(tensor_split.size());
    float acc = 0;
    for (size_t i = 0; i < tensor_split.size(); ++i) points[i] = acc += tensor_split[i];
    for (float & p : points) p /= acc;
    const int64_t n_layers = n_blocks + 1;  // the output layer counts as the last one
    std::vector<int> out(n_layers);
    for (int64_t il = 0; il < n_layers; ++il) {
        const float at = float(il) / float(n_layers);
        const auto first_above = std::upper_bound(points.begin(), points.end(), at);
        // past the last point only by rounding (at < 1): the last device
        out[il] = std::min<int>((int)(first_above - points.begin()), (int)points.size() - 1);
    }
    if (split_bug() == SplitBug::all_first) std::fill(out.begin(), out.end(), 0);
    return out;
}

int LayerSplit::weight_place(const std::string & name) const {
    if (name.rfind("blk.", 0) == 0) {
        const size_t dot = name.find('.', 4);
        const int il = std::stoi(name.substr(4, dot - 4));
        if (il < 0 || il >= (int)block.size()) throw std::out_of_range("weight '" + name + "': no such block in the split");
        return block[il];
    }
    if (name == "token_embd.weight") return input;
    return output;  // output_norm.weight, output.weight, output.tied
}

std::vector<ggml_backend_t> LayerSplit::sched_backends() const {
    std::vector<ggml_backend_t> out;
    for (size_t i = 0; i < backends.size(); ++i) {
        if ((int)i != cpu) out.push_back(backends[i]);
    }
    out.push_back(backends[cpu]);
    return out;
}

LayerSplit make_layer_split(const std::vector<std::string> & devices, const std::vector<float> & tensor_split,
                            int64_t n_blocks, ggml_backend_t cpu_backend) {
    if (devices.empty()) throw std::invalid_argument("devices: needs at least one device");
    if (!tensor_split.empty() && tensor_split.size() != devices.size()) {
        throw std::invalid_argument("tensor_split: one entry per device expected (" + std::to_string(devices.size()) +
                                    "), got " + std::to_string(tensor_split.size()));
    }
    std::vector<ggml_backend_dev_t> devs;
    for (const std::string & name : devices) {
        ggml_backend_dev_t dev = split_device(name);
        if (std::find(devs.begin(), devs.end(), dev) != devs.end()) {
            throw std::invalid_argument("devices: '" + name + "' names a device listed before it");
        }
        devs.push_back(dev);
    }
    std::vector<float> split = tensor_split;
    if (split.empty()) {  // llama.cpp's default: by each device's free memory
        for (ggml_backend_dev_t dev : devs) {
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(dev, &free, &total);
            if (free == 0 && total == 0) ggml_backend_dev_memory(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU), &free, &total);
            split.push_back((float)free);
        }
    }
    const std::vector<int> map = layer_devices(n_blocks, split);  // validates split

    LayerSplit s;
    s.tensor_split = split;
    try {
        for (size_t i = 0; i < devs.size(); ++i) {
            s.names.push_back(devices[i]);
            if (ggml_backend_dev_type(devs[i]) == GGML_BACKEND_DEVICE_TYPE_CPU) {
                s.cpu = (int)i;
                s.backends.push_back(cpu_backend);
                continue;
            }
            ggml_backend_t b = ggml_backend_dev_init(devs[i], nullptr);
            if (!b) throw std::runtime_error("cannot initialise device '" + devices[i] + "'");
            s.backends.push_back(b);
        }
    } catch (...) {
        free_layer_split(s);
        throw;
    }
    if (s.cpu < 0) {  // the input layer's place
        s.cpu = (int)s.backends.size();
        s.names.push_back("cpu");
        s.backends.push_back(cpu_backend);
    }
    s.block.assign(map.begin(), map.end() - 1);
    s.output = map.back();
    s.input = s.cpu;
    if (split_bug() == SplitBug::all_first) s.input = 0;
    return s;
}

void free_layer_split(LayerSplit & split) {
    for (size_t i = 0; i < split.backends.size(); ++i) {
        if ((int)i != split.cpu && split.backends[i]) ggml_backend_free(split.backends[i]);
    }
    split.backends.clear();
}

std::vector<ggml_backend_buffer_t> alloc_placed(ggml_context * ctx, const std::vector<ggml_backend_t> & backends,
                                                const std::function<int(const ggml_tensor *)> & place_of,
                                                ggml_backend_buffer_usage usage) {
    auto own = [](const ggml_tensor * t) { return t->data == nullptr && t->view_src == nullptr; };
    std::vector<size_t> bytes(backends.size(), 0);
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
        if (!own(t)) continue;
        const int p = place_of(t);
        ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(backends.at(p));
        bytes[p] += GGML_PAD(ggml_backend_buft_get_alloc_size(buft, t), ggml_backend_buft_get_alignment(buft));
    }
    std::vector<ggml_backend_buffer_t> buffers(backends.size(), nullptr);
    std::vector<ggml_tallocr> allocs(backends.size());
    auto free_all = [&] {
        for (ggml_backend_buffer_t b : buffers) {
            if (b) ggml_backend_buffer_free(b);
        }
    };
    for (size_t p = 0; p < backends.size(); ++p) {
        if (bytes[p] == 0) continue;
        // room to align the first tensor too, whatever the base address
        bytes[p] += ggml_backend_buft_get_alignment(ggml_backend_get_default_buffer_type(backends[p]));
        buffers[p] = ggml_backend_alloc_buffer(backends[p], bytes[p]);
        if (!buffers[p]) {
            free_all();
            throw std::runtime_error("cannot allocate " + std::to_string(bytes[p] >> 20) + " MiB on " +
                                     ggml_backend_name(backends[p]) + " (out of memory?)");
        }
        ggml_backend_buffer_set_usage(buffers[p], usage);
        allocs[p] = ggml_tallocr_new(buffers[p]);
    }
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
        if (!own(t)) continue;
        if (ggml_tallocr_alloc(&allocs[place_of(t)], t) != GGML_STATUS_SUCCESS) {
            free_all();
            throw std::runtime_error("cannot place tensor '" + std::string(ggml_get_name(t)) + "'");
        }
    }
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
        if (t->view_src != nullptr && t->buffer == nullptr) ggml_backend_view_init(t);  // in creation order
    }
    return buffers;
}

}  // namespace deltaspec
