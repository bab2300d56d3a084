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

#define DELTASPEC_WINDOW_MAX 16  // the conv's window width (its kernel size - 1) served

// One DeltaNet layer's conv windows of one slot (channel c's `width` inputs at windows + c * width,
// oldest first) and the verify batch's conv inputs (row r's channel c at x[r * x_row + c]; a layer
// whose input projection is stacked with others reads a view of wider rows).
struct deltaspec_window_layer {
    const float * x;
    float * windows;
    int64_t x_row;
};

// A slot's accepted path of n_rows rows, of which `last` holds the final min(n_rows, width), oldest
// first: the window after it is the last `width` of (the window before it, then those rows' inputs).
struct deltaspec_window_path {
    int64_t channels;
    int32_t width, n_rows;
    int32_t last[DELTASPEC_WINDOW_MAX];
};

// Commits every path's windows: paths[p] rewrites layers[p * n_layers .. (p + 1) * n_layers - 1]
// in place, on the device holding layers[0].windows, and waits; the caller must have synchronized
// whatever wrote the inputs. Returns 1 when done; 0 when nothing was launched (a width outside 1 ..
// DELTASPEC_WINDOW_MAX, host memory); -1 on a CUDA error after launching (windows partly rewritten).
int deltaspec_cuda_commit_windows(const struct deltaspec_window_path * paths, int n_paths,
                                   const struct deltaspec_window_layer * layers, int n_layers);

#ifdef __cplusplus
}
#endif
