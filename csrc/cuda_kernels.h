// deltaspec's own CUDA kernels (ggml/cuda/), which live inside ggml-cuda when it was built with
// them (ggml/cuda/inject.cmake). They are process-wide: ggml-cuda routes its quantized mat-vecs
// and small-batch products through them once switched on.
#pragma once

namespace deltaspec {

// Whether the ggml this module runs on carries them (a CPU build, or a stock ggml, does not).
bool cuda_kernels_available();

// Switch them on, unless the environment says DELTASPEC_CUDA_KERNELS=0 (for A/B measurements);
// returns whether they are on.
bool enable_cuda_kernels();

}  // namespace deltaspec
