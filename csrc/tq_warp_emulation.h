// The CUDA tq kernels' source (ggml/cuda/deltaspec_tq_warp.cuh) run on the host, lanes as coroutines
// (csrc/tq_warp_emulation.cpp): test-only, to compare the bytes that source writes with the CPU
// codec's and with the device's.
#pragma once

#include <cstdint>

namespace deltaspec {

// n head vectors of head_dim floats at x -> n * (2 + head_dim * bits / 8) bytes, by tq_quantize
void tq_cuda_source_quantize(int bits, int64_t head_dim, int64_t n, const float * x, uint8_t * out);
// n head vectors rotated (inverse: rotated back) by tq_rotate
void tq_cuda_source_rotate(int64_t head_dim, int64_t n, const float * x, float * out, bool inverse);

// What the emulation has run in this process (so that a test can assert its path ran).
struct EmulationStats {
    int64_t warps = 0;     // warps run to completion
    int64_t shuffles = 0;  // __shfl_xor_sync calls, over all lanes
};
EmulationStats tq_cuda_source_stats();

}  // namespace deltaspec
