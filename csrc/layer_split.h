// One model over several devices, split by layers (llama.cpp's `-sm layer -ts`): each decoder
// block's weights, KV cache and recurrent state live in a buffer of the device the split gives that
// block, and ggml_backend_sched runs every graph over the devices' backends (it places a node on the
// device of its weights or of the state it writes, and copies activations between devices).
// Nothing here runs a graph: the engine's graphs stay the one-device graphs.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"

namespace deltaspec {

// Which device each of n_blocks + 1 "layers" goes to: blocks 0 .. n_blocks-1 (the GGUF's
// block_count: trunk layers, then the MTP layers stored after them), then the output layer
// (output norm and LM head) as layer n_blocks. The rule of llama.cpp's model loader
// (src/llama-model.cpp, llama_model_base::load_tensors: "calculate the split points" and
// get_layer_buft_list, with every layer offloaded): the cumulative sums of tensor_split, divided by
// their total, are split points s_0 <= s_1 <= ... = 1; layer il goes to the first device d with
// il / (n_blocks + 1) < s_d. tensor_split must have one entry per device, none negative, some > 0
// (std::invalid_argument otherwise).
std::vector<int> layer_devices(int64_t n_blocks, const std::vector<float> & tensor_split);

// The devices of a split and where each layer's tensors go. A "place" is a backend holding some of
// the model: the listed devices in their order, then the CPU when it is not listed (llama.cpp keeps
// the input layer, the token embeddings, on the CPU whatever the split).
struct LayerSplit {
    std::vector<std::string> names;        // each place's device name ("cuda:0", "cpu")
    std::vector<ggml_backend_t> backends;  // each place's backend (owned by the Engine)
    std::vector<int> block;                // the place of block il (trunk, then MTP)
    int output = 0;                        // output norm and LM head
    int input = 0;                         // token_embd (the CPU)
    int cpu = -1;                          // the CPU's place
    std::vector<float> tensor_split;       // as used (llama.cpp's default: each device's free memory)

    bool active() const { return !backends.empty(); }
    // The place of weight `name` (a GGUF tensor name, or a stack "blk.N.*"); "output.tied" is the
    // copy of a tied token_embd that serves as the LM head on the output's device.
    int weight_place(const std::string & name) const;
    // The backends for a scheduler: every place once, GPUs first in the listed order, the CPU last
    // (ggml_backend_sched_new wants the CPU last; earlier means preferred).
    std::vector<ggml_backend_t> sched_backends() const;
};

// Parses `devices` (names as Engine's `device` takes them; each once) and creates a backend for
// each (the CPU's is `cpu_backend`, created by the caller with its thread count), plus the block and
// output places for a model of n_blocks blocks. An empty tensor_split splits by free memory, as
// llama.cpp does when no -ts is given. Throws std::invalid_argument naming the parameter.
LayerSplit make_layer_split(const std::vector<std::string> & devices, const std::vector<float> & tensor_split,
                            int64_t n_blocks, ggml_backend_t cpu_backend);
// ggml's RPC backend (built in unless the engine links a lent ggml): a split's device may be
// "rpc:HOST:PORT", the first device of an RPC server there. start_rpc_server serves this process's
// CPU at `endpoint` ("127.0.0.1:PORT") from a thread of its own until the process ends: how the CPU
// tests split a model over two backends with real copies between them.
bool rpc_available();
void start_rpc_server(const std::string & endpoint, int n_threads);

// Frees the backends make_layer_split created (not the CPU's).
void free_layer_split(LayerSplit & split);

// Allocates every tensor of ctx that has no memory yet and is not a view into a buffer of
// backends[place_of(tensor)], one buffer per place used, and initialises the views after. Returns
// each place's buffer, null where a place holds none (the caller frees them); usage is set on each.
std::vector<ggml_backend_buffer_t> alloc_placed(ggml_context * ctx, const std::vector<ggml_backend_t> & backends,
                                                const std::function<int(const ggml_tensor *)> & place_of,
                                                ggml_backend_buffer_usage usage);

// What a place holds (Engine::device_layers): its decoder layers (trunk blocks whose weights are
// there), whether the input (token_embd) and output layers are, and the bytes of weights, KV cache
// (k, v) and recurrent state (conv, ssm and their checkpoint copies) in its buffers.
struct DeviceLayers {
    std::string device;   // as listed ("cuda:0", "cpu")
    std::string backend;  // ggml's name ("CUDA0", "CPU")
    std::vector<int> layers;
    bool input = false, output = false;
    size_t weight_bytes = 0, kv_bytes = 0, state_bytes = 0;
};

// DELTASPEC_TEST_SPLIT_BUG (test only) plants a bug so the split's tests can show that they notice:
// "all_first" gives every layer to the first device (the map ignores tensor_split); "state_first"
// puts every layer's KV cache and recurrent state on the first device whatever device its weights
// are on (a node that writes a state in place then writes a scheduler's copy of it); "no_side_graph"
// skips the small graphs a split runs through a scheduler of its own (keep()'s replay and the
// accepted paths' commit: the states stay as before the verify batch). Read per call; unset or empty in every real use, anything else
// throws std::invalid_argument.
enum class SplitBug { none, all_first, state_first, no_side_graph };
SplitBug split_bug();

}  // namespace deltaspec
