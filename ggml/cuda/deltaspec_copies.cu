// Many small device-to-device copies in one launch: keeping part of a verify batch
// (Engine::keep) copies each DeltaNet layer's conv window back (48 on the 27B; it once also
// copied a kept state per layer). As a ggml graph such copies ran eagerly, launch by launch (a
// new graph each time, so ggml-cuda never captured it): about 0.9 ms on the H200 for ~0.1 ms of
// memory traffic. Committing a tree's accepted path (Engine::commit_paths) gathers each layer's
// window from the path's rows the same way (commit_windows): one launch for all layers.
#include "deltaspec_copies.h"
#include "side_stream.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>

namespace {

constexpr int kJobsPerLaunch = 32;  // by value in the kernel's parameters (32 x 48 bytes)
constexpr int kBlocksPerJob = 64;

struct Jobs {
    deltaspec_copy job[kJobsPerLaunch];
};

// Block (x, y) copies its share of job y, grid-striding over the job's values; contiguous jobs of
// 16-byte aligned whole float4s go four values at a time.
__global__ void copy_rows(const Jobs jobs) {
    const deltaspec_copy & j = jobs.job[blockIdx.y];
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vectors = j.rows == 1 && j.cols % 4 == 0 && (uintptr_t)j.src % 16 == 0 && (uintptr_t)j.dst % 16 == 0;
    if (vectors) {
        const float4 * src = reinterpret_cast<const float4 *>(j.src);
        float4 * dst = reinterpret_cast<float4 *>(j.dst);
        for (int64_t i = first; i < j.cols / 4; i += stride) dst[i] = src[i];
        return;
    }
    for (int64_t i = first; i < j.rows * j.cols; i += stride) {
        const int64_t r = i / j.cols, c = i % j.cols;
        j.dst[r * j.dst_stride + c] = j.src[r * j.src_stride + c];
    }
}

}  // namespace

cudaStream_t deltaspec_side_stream(int device) {
    static std::mutex mutex;  // engines on other threads may get here first at the same time
    static cudaStream_t streams[64] = {};
    std::lock_guard<std::mutex> lock(mutex);
    cudaStream_t & mine = streams[device % 64];
    if (mine == nullptr && cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking) != cudaSuccess) mine = nullptr;
    return mine;
}

extern "C" __attribute__((visibility("default"))) bool deltaspec_cuda_copy_rows(const deltaspec_copy * jobs,
                                                                                 int n_jobs) {
    if (n_jobs <= 0) return true;
    const int device = device_of(jobs[0].dst);
    if (device < 0) return false;  // host memory: the caller copies another way
    return run_on_side_stream(device, [&](cudaStream_t stream) {
        for (int first = 0; first < n_jobs; first += kJobsPerLaunch) {
            const int n = std::min(kJobsPerLaunch, n_jobs - first);
            Jobs batch;
            std::copy(jobs + first, jobs + first + n, batch.job);
            copy_rows<<<dim3(kBlocksPerJob, n), 256, 0, stream>>>(batch);
            if (cudaGetLastError() != cudaSuccess) return false;
        }
        return true;
    });
}

namespace {

constexpr int kWindowLayersPerLaunch = 64;  // by value in the kernel's parameters (64 x 24 bytes)

struct WindowLayers {
    deltaspec_window_layer layer[kWindowLayersPerLaunch];
};

// Thread (x, layer y) rewrites one channel's window: it reads all of the new window (from the old
// one and the path's inputs) before it writes any of it, and no other thread touches that channel.
__global__ void commit_windows(const WindowLayers layers, const deltaspec_window_path path) {
    const deltaspec_window_layer & l = layers.layer[blockIdx.y];
    const int64_t ch = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= path.channels) return;
    const int W = path.width, n = path.n_rows, kept = min(n, W);
    float * window = l.windows + ch * W;
    float next[DELTASPEC_WINDOW_MAX];
    for (int j = 0; j < W; ++j) {
        const int i = n + j;  // position in (old window, path inputs)
        next[j] = i < W ? window[i] : l.x[(int64_t)path.last[j - W + kept] * l.x_row + ch];
    }
    for (int j = 0; j < W; ++j) window[j] = next[j];
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int deltaspec_cuda_commit_windows(
    const deltaspec_window_path * paths, int n_paths, const deltaspec_window_layer * layers, int n_layers) {
    if (n_paths <= 0 || n_layers <= 0) return 1;
    for (int p = 0; p < n_paths; ++p) {
        if (paths[p].width < 1 || paths[p].width > DELTASPEC_WINDOW_MAX || paths[p].n_rows < 0) return 0;
    }
    const int device = device_of(layers[0].windows);
    if (device < 0) return 0;
    return run_on_side_stream(device, [&](cudaStream_t stream) {
        for (int p = 0; p < n_paths; ++p) {
            if (paths[p].n_rows == 0) continue;
            const deltaspec_window_layer * mine = layers + (int64_t)p * n_layers;
            for (int first = 0; first < n_layers; first += kWindowLayersPerLaunch) {
                const int n = std::min(kWindowLayersPerLaunch, n_layers - first);
                WindowLayers batch;
                std::copy(mine + first, mine + first + n, batch.layer);
                const dim3 grid((unsigned)((paths[p].channels + 255) / 256), (unsigned)n);
                commit_windows<<<grid, 256, 0, stream>>>(batch, paths[p]);
                if (cudaGetLastError() != cudaSuccess) return false;
            }
        }
        return true;
    }) ? 1 : -1;
}
