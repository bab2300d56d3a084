// deltaspec_cuda_copy_rows (deltaspec_copies.cu, inside ggml-cuda when it carries our kernels):
// many small device copies of f32 rows in one launch. Plain C, so that the engine can declare
// it weak and link against a ggml-cuda without it.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// rows x cols f32 values; row r starts at src + r * src_stride (dst + r * dst_stride), in values
struct deltaspec_copy {
    const float * src;
    float * dst;
    int64_t rows, cols, src_stride, dst_stride;
};

// Copies every job on the device holding jobs[0].dst and waits for them; the caller must have
// finished (synchronized) whatever writes the sources. Returns false on a CUDA error or when
// jobs[0].dst is not device memory (nothing copied then); jobs must not overlap.
bool deltaspec_cuda_copy_rows(const struct deltaspec_copy * jobs, int n_jobs);

#ifdef __cplusplus
}
#endif
