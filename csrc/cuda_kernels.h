// deltaspec's own CUDA kernels (ggml/cuda/), which live inside ggml-cuda when it was built with
// them (ggml/cuda/inject.cmake). They are process-wide: ggml-cuda routes its quantized mat-vecs
// and small-batch products through them once switched on.
#pragma once

#include <vector>

#include "ggml.h"

namespace deltaspec {

// Whether the ggml this module runs on carries them (a CPU build, or a stock ggml, does not).
bool cuda_kernels_available();

// Switch them on, unless the environment says DELTASPEC_CUDA_KERNELS=0 (for A/B measurements);
// returns whether they are on.
bool enable_cuda_kernels();

// Offers a one-token norm, norm_mul = MUL(RMS_NORM(x), w), to our CUDA mat-vecs: when they are on
// and serve every one of `weights` (the products that read the norm), they apply the norm
// themselves and ggml-cuda skips it (ggml/cuda/deltaspec_matmul.cu); returns whether it was folded.
bool cuda_fold_norm(ggml_tensor * norm_mul, const std::vector<const ggml_tensor *> & weights);

}  // namespace deltaspec
