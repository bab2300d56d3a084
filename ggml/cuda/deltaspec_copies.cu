// Many small device-to-device copies in one launch: keeping part of a verify batch
// (Engine::keep) copies each DeltaNet layer's conv window back (48 on the 27B; it once also
// copied a kept state per layer). As a ggml graph such copies ran eagerly, launch by launch (a
// new graph each time, so ggml-cuda never captured it): about 0.9 ms on the H200 for ~0.1 ms of
// memory traffic.
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
