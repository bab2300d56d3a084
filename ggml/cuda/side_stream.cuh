// Work of ours outside ggml's graphs (keep()'s window copies and replay) on a CUDA stream of our
// own. ggml-cuda's streams do not synchronize with the legacy default stream, so the callers
// synchronize ggml's backend first, and this waits for its stream before returning.
#pragma once

#include <cuda_runtime.h>

// The stream on `device`, created once (deltaspec_copies.cu); nullptr if that failed.
cudaStream_t deltaspec_side_stream(int device);

// Whether p points to device memory (a failed query's error is cleared).
inline bool is_device_memory(const void * p) {
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return attr.type == cudaMemoryTypeDevice;
}

// Calls launch(stream) (which returns whether its launches succeeded) on the device holding
// device_ptr and waits for them. False when device_ptr is not device memory (nothing launched:
// the caller falls back) or on a CUDA error.
template <typename Launch>
inline bool run_on_side_stream(const void * device_ptr, Launch && launch) {
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, device_ptr) != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
        cudaGetLastError();  // clear it: the caller falls back
        return false;
    }
    int device_before = 0;
    if (cudaGetDevice(&device_before) != cudaSuccess || cudaSetDevice(attr.device) != cudaSuccess) return false;
    cudaStream_t stream = deltaspec_side_stream(attr.device);
    bool ok = stream != nullptr && launch(stream);
    ok = ok && cudaStreamSynchronize(stream) == cudaSuccess;
    cudaSetDevice(device_before);
    return ok;
}
