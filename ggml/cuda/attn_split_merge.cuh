// The last step of an attention split over blocks of cached rows: each block wrote its partial
// state per (query head, query row) -- D accumulator values, then the max and the sum of its
// online softmax -- and this merges the blocks in order. Used by the tq one-token kernels
// (deltaspec_tq_attn_tile.cuh) and the batch-invariant attention (deltaspec_invariant.cu), whose
// rows' results must not depend on anything but their own blocks. The includer provides CUDA's
// names (tests/host/tq_attn_tile_host.cpp runs it on the host).
#pragma once

#include <cstdint>

namespace deltaspec_attn {

// out[hn * D + i] <- the n_split blocks of hn (part + (hn * n_split + block) * (D + 2)) merged in
// block order: grid hn (a query head and row), thread i the output's coordinate i. A block whose
// rows were all masked holds no state (max -inf) and adds nothing.
template <int D>
__global__ void __launch_bounds__(D) merge_attention_splits(const float * __restrict__ part, int64_t n_split,
                                                            float * __restrict__ out) {
    const int64_t hn = blockIdx.x;
    const int i = threadIdx.x;
    const float * p = part + hn * n_split * (D + 2);
    float M = -INFINITY;
    for (int64_t sp = 0; sp < n_split; ++sp) M = fmaxf(M, p[sp * (D + 2) + D]);
    float S = 0.0f, a = 0.0f;
    for (int64_t sp = 0; sp < n_split; ++sp) {
        const float ms = p[sp * (D + 2) + D];
        if (ms != -INFINITY) {
            const float f = expf(ms - M);
            S += p[sp * (D + 2) + D + 1] * f;
            a += p[sp * (D + 2) + i] * f;
        }
    }
    out[hn * D + i] = S > 0.0f ? a * (1.0f / S) : 0.0f;
}

}  // namespace deltaspec_attn
