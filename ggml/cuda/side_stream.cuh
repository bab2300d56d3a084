// Work of ours outside ggml's graphs (keep()'s window copies and replay) on a CUDA stream of our
// own. ggml-cuda's streams do not synchronize with the legacy default stream, so the callers
// synchronize ggml's backend first, and this waits for its stream before returning.
#pragma once

#include <cuda_runtime.h>

// The stream on `device`, created once (deltaspec_copies.cu); nullptr if that failed.
cudaStream_t deltaspec_side_stream(int device);

// The device whose memory p points to, or -1 when it is not device memory (a failed query's
// error is cleared: the callers then fall back).
inline int device_of(const void * p) {
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return attr.type == cudaMemoryTypeDevice ? attr.device : -1;
}

// Calls launch(stream) (which returns whether its launches succeeded) with our stream on
// `device` and waits for them; false on a CUDA error.
template <typename Launch>
inline bool run_on_side_stream(int device, Launch && launch) {
    int device_before = 0;
    if (cudaGetDevice(&device_before) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) return false;
    cudaStream_t stream = deltaspec_side_stream(device);
    bool ok = stream != nullptr && launch(stream);
    ok = ok && cudaStreamSynchronize(stream) == cudaSuccess;
    cudaSetDevice(device_before);
    return ok;
}
