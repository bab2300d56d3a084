#include "cuda_kernels.h"

#include "env.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>

// Defined by ggml/cuda/deltaspec_matmul.cu inside ggml-cuda when it carries our kernels. Weak, so
// that a ggml without them links too and leaves the pointer null.
extern "C" void deltaspec_cuda_set_kernels(bool on) __attribute__((weak));
extern "C" bool deltaspec_cuda_fold_input(ggml_tensor * input, const ggml_tensor * const * weights,
                                          int n_weights) __attribute__((weak));
extern "C" bool deltaspec_cuda_pair_products(ggml_tensor * first, ggml_tensor * second) __attribute__((weak));
extern "C" int64_t deltaspec_cuda_pair_count() __attribute__((weak));
extern "C" bool deltaspec_cuda_set_batch_invariant(ggml_backend_t backend, bool on) __attribute__((weak));
extern "C" int64_t deltaspec_cuda_invariant_count(int which) __attribute__((weak));
extern "C" bool deltaspec_cuda_copy_rows(const deltaspec_copy * jobs, int n_jobs) __attribute__((weak));
extern "C" void deltaspec_cuda_set_mma_row_tiles(int row_tiles) __attribute__((weak));
extern "C" void deltaspec_cuda_set_mma_k_split(int k_split) __attribute__((weak));
extern "C" void deltaspec_cuda_set_mma_max_columns(int n) __attribute__((weak));
extern "C" void deltaspec_cuda_set_deltanet(bool on) __attribute__((weak));
extern "C" void deltaspec_cuda_set_early_launch(bool on) __attribute__((weak));
extern "C" int64_t deltaspec_cuda_deltanet_launches() __attribute__((weak));
extern "C" int deltaspec_cuda_deltanet_replay(const deltaspec_deltanet_replay * shape,
                                              const deltaspec_deltanet_layer * layers,
                                              int n_layers) __attribute__((weak));
extern "C" int deltaspec_cuda_deltanet_replay_paths(const deltaspec_deltanet_replay * shape,
                                                    const deltaspec_deltanet_path * paths, int n_paths,
                                                    const deltaspec_deltanet_layer * layers,
                                                    int n_layers) __attribute__((weak));
extern "C" int deltaspec_cuda_commit_windows(const deltaspec_window_path * paths, int n_paths,
                                             const deltaspec_window_layer * layers, int n_layers) __attribute__((weak));

namespace deltaspec {

namespace {

// A count the tensor-core kernels take from the environment: 0 (unset: the kernels choose) or one
// of `allowed`; anything else is refused, naming the values it takes.
int env_count(const char * name, std::initializer_list<int> allowed) {
    const char * env = std::getenv(name);
    const std::string value = env != nullptr ? env : "0";
    if (value == "0") return 0;
    std::string choices;
    for (const int v : allowed) {
        if (value == std::to_string(v)) return v;
        choices += (choices.empty() ? "" : ", ") + std::to_string(v);
    }
    throw std::invalid_argument(std::string(name) + " must be 0 (automatic) or one of " + choices + ", not '" + value +
                                "'");
}

}  // namespace

bool cuda_kernels_available() { return deltaspec_cuda_set_kernels != nullptr; }

bool enable_cuda_kernels() {
    if (!cuda_kernels_available()) return false;
    const bool on = env_on("DELTASPEC_CUDA_KERNELS");
    deltaspec_cuda_set_kernels(on);
    if (deltaspec_cuda_set_deltanet != nullptr) deltaspec_cuda_set_deltanet(on && env_on("DELTASPEC_CUDA_DELTANET"));
    if (deltaspec_cuda_set_early_launch != nullptr) {
        deltaspec_cuda_set_early_launch(on && env_on("DELTASPEC_CUDA_PDL"));
    }
    if (deltaspec_cuda_set_mma_row_tiles != nullptr) {
        deltaspec_cuda_set_mma_row_tiles(env_count("DELTASPEC_MMA_ROW_TILES", {1, 2, 4}));
    }
    if (deltaspec_cuda_set_mma_k_split != nullptr) {
        deltaspec_cuda_set_mma_k_split(env_count("DELTASPEC_MMA_K_SPLIT", {1, 2, 3, 4}));
    }
    if (deltaspec_cuda_set_mma_max_columns != nullptr) {  // products up to N columns on our tensor cores
        deltaspec_cuda_set_mma_max_columns(env_count("DELTASPEC_MMA_MAX_COLUMNS", {32, 64, 96, 128, 256, 512}));
    }
    return on;
}

bool cuda_set_mma_max_columns(int n) {
    if (deltaspec_cuda_set_mma_max_columns == nullptr) return false;
    deltaspec_cuda_set_mma_max_columns(n);
    return true;
}

int64_t cuda_deltanet_launches() {
    return deltaspec_cuda_deltanet_launches != nullptr ? deltaspec_cuda_deltanet_launches() : -1;
}

bool cuda_set_batch_invariant(ggml_backend_t backend, bool on) {
    return deltaspec_cuda_set_batch_invariant != nullptr && deltaspec_cuda_set_batch_invariant(backend, on);
}

int64_t cuda_invariant_count(int which) {
    return deltaspec_cuda_invariant_count != nullptr ? deltaspec_cuda_invariant_count(which) : -1;
}

bool cuda_fold_input(ggml_tensor * input, const std::vector<const ggml_tensor *> & weights) {
    if (input->op == GGML_OP_MUL_MAT) {  // a pair of products; DELTASPEC_MMA_PAIRS=0: none (A/B, tests)
        return weights.size() == 1 && deltaspec_cuda_pair_products != nullptr && env_on("DELTASPEC_MMA_PAIRS") &&
               deltaspec_cuda_pair_products(input, const_cast<ggml_tensor *>(weights[0]));
    }
    return deltaspec_cuda_fold_input != nullptr &&
           deltaspec_cuda_fold_input(input, weights.data(), (int)weights.size());
}

int64_t cuda_pair_count() { return deltaspec_cuda_pair_count != nullptr ? deltaspec_cuda_pair_count() : -1; }

bool cuda_deltanet_replay(const deltaspec_deltanet_replay & shape,
                          const std::vector<deltaspec_deltanet_layer> & layers) {
    if (deltaspec_cuda_deltanet_replay == nullptr) return false;
    const int done = deltaspec_cuda_deltanet_replay(&shape, layers.data(), (int)layers.size());
    if (done < 0) throw std::runtime_error("replaying the DeltaNet states on the GPU failed (a CUDA error)");
    return done == 1;
}

bool add_deltanet_replay_layer(const ggml_tensor * q, const ggml_tensor * k, const ggml_tensor * v,
                               const ggml_tensor * g, const ggml_tensor * beta, float * state,
                               deltaspec_deltanet_replay & shape, std::vector<deltaspec_deltanet_layer> & layers) {
    const int64_t f = sizeof(float);
    for (const ggml_tensor * t : {q, k, v, g, beta}) {
        if (t->type != GGML_TYPE_F32 || t->nb[0] != f) return false;
    }
    if (!ggml_are_same_stride(q, k) || !ggml_are_same_stride(g, beta)) return false;
    const deltaspec_deltanet_replay here = {v->ne[1], q->ne[1], v->ne[0], shape.n_tokens, (int64_t)(q->nb[1] / f),
                                            (int64_t)(q->nb[2] / f), (int64_t)(v->nb[1] / f), (int64_t)(v->nb[2] / f),
                                            (int64_t)(g->nb[1] / f), (int64_t)(g->nb[2] / f)};
    if (!layers.empty() && std::memcmp(&here, &shape, sizeof(shape)) != 0) return false;
    shape = here;
    layers.push_back({(const float *)q->data, (const float *)k->data, (const float *)v->data, (const float *)g->data,
                      (const float *)beta->data, state});
    return true;
}

bool cuda_deltanet_replay_paths(const deltaspec_deltanet_replay & shape,
                                const std::vector<deltaspec_deltanet_path> & paths,
                                const std::vector<deltaspec_deltanet_layer> & layers) {
    if (deltaspec_cuda_deltanet_replay_paths == nullptr || paths.empty()) return false;
    const int n_layers = (int)(layers.size() / paths.size());
    const int done = deltaspec_cuda_deltanet_replay_paths(&shape, paths.data(), (int)paths.size(), layers.data(), n_layers);
    if (done < 0) throw std::runtime_error("replaying the accepted paths' DeltaNet states on the GPU failed (a CUDA error)");
    return done == 1;
}

bool cuda_commit_windows(const std::vector<deltaspec_window_path> & paths,
                         const std::vector<deltaspec_window_layer> & layers) {
    if (deltaspec_cuda_commit_windows == nullptr || paths.empty()) return false;
    const int n_layers = (int)(layers.size() / paths.size());
    const int done = deltaspec_cuda_commit_windows(paths.data(), (int)paths.size(), layers.data(), n_layers);
    if (done < 0) throw std::runtime_error("committing the accepted paths' conv windows on the GPU failed (a CUDA error)");
    return done == 1;
}

bool cuda_copy_rows(const std::vector<deltaspec_copy> & jobs) {
    return deltaspec_cuda_copy_rows != nullptr && deltaspec_cuda_copy_rows(jobs.data(), (int)jobs.size());
}

}  // namespace deltaspec
