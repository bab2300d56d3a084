// The Gated DeltaNet token step on one warp's 4 columns of a head's state: the column sums shared by
// the verify kernel and the replay (deltaspec_deltanet.cu) and the rows op (deltaspec_rows.cu), and
// the step itself (token_step, the rows op's; the verify kernel keeps the same step inline), so that
// they give the same bits: ggml's (see deltaspec_deltanet.cu for why these sums are ggml's).
//
// A warp owns 4 columns of a state stored transposed (a column's S values contiguous); lane l holds
// rows r * 32 + l of each (kRows = S / 32 values a column). The two column sums a token needs
// (S^T k, then S^T q after the update) are reduced for 4 columns at once (reduce_scatter).
#pragma once

#include <cuda_runtime.h>

namespace deltaspec_cuda {

constexpr int kColumnsPerWarp = 4;

// The column (0..3 of the warp's) whose total lane `lane` holds after reduce_scatter.
__device__ __forceinline__ int reduced_column(int lane) { return (lane >> 3) & 3; }

// Warp sums of the 4 columns' shares p[0..3]; lane l gets the total of column reduced_column(l),
// added in the order of ggml's warp_reduce_sum (partners l ^ 16, l ^ 8, l ^ 4, l ^ 2, l ^ 1).
__device__ __forceinline__ float reduce_scatter(const float (&p)[kColumnsPerWarp], int lane) {
    const bool upper16 = lane & 16, upper8 = lane & 8;
    // partners 16 apart: this lane keeps columns 2 * upper16 + {0, 1}, gives the other two
    float keep0 = upper16 ? p[2] : p[0], keep1 = upper16 ? p[3] : p[1];
    const float give0 = upper16 ? p[0] : p[2], give1 = upper16 ? p[1] : p[3];
    keep0 += __shfl_xor_sync(0xffffffffu, give0, 16);
    keep1 += __shfl_xor_sync(0xffffffffu, give1, 16);
    // partners 8 apart: keeps column 2 * upper16 + upper8
    float sum = upper8 ? keep1 : keep0;
    sum += __shfl_xor_sync(0xffffffffu, upper8 ? keep0 : keep1, 8);
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    return sum;
}

// Every lane gets all 4 columns' values from the lanes holding them after reduce_scatter.
__device__ __forceinline__ void share_columns(float mine, int lane, float (&all)[kColumnsPerWarp]) {
    const bool upper16 = lane & 16, upper8 = lane & 8;
    const float other = __shfl_xor_sync(0xffffffffu, mine, 8);  // column reduced_column(lane) ^ 1
    const float pair0 = upper8 ? other : mine, pair1 = upper8 ? mine : other;  // columns 2 * upper16 + {0, 1}
    const float far0 = __shfl_xor_sync(0xffffffffu, pair0, 16), far1 = __shfl_xor_sync(0xffffffffu, pair1, 16);
    all[0] = upper16 ? far0 : pair0;
    all[1] = upper16 ? far1 : pair1;
    all[2] = upper16 ? pair0 : far0;
    all[3] = upper16 ? pair1 : far1;
}

// This lane's shares of (S^T x)[col] for the warp's 4 columns (x's values r * 32 + lane in x[r]).
template <int kRows>
__device__ __forceinline__ void column_shares(const float (&s)[kColumnsPerWarp][kRows], const float (&x)[kRows],
                                              float (&part)[kColumnsPerWarp]) {
#pragma unroll
    for (int c = 0; c < kColumnsPerWarp; c++) {
        part[c] = 0.0f;
#pragma unroll
        for (int r = 0; r < kRows; r++) part[c] += s[c][r] * x[r];
    }
}

// s <- decay * s + k delta^T on the warp's 4 columns.
template <int kRows>
__device__ __forceinline__ void update_columns(float (&s)[kColumnsPerWarp][kRows], const float (&k)[kRows],
                                               float decay, const float (&delta)[kColumnsPerWarp]) {
#pragma unroll
    for (int c = 0; c < kColumnsPerWarp; c++) {
#pragma unroll
        for (int r = 0; r < kRows; r++) s[c][r] = decay * s[c][r] + k[r] * delta[c];
    }
}

// A token's S floats (k or q), this lane's values r * 32 + lane.
template <int kRows>
__device__ __forceinline__ void lane_values(const float * tok, int lane, float (&x)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; r++) x[r] = tok[r * 32 + lane];
}

// One token: s <- exp(g) * s + k (beta * (v - exp(g) * S^T k))^T on the warp's 4 columns, with k and
// q the token's (S floats each, read at r * 32 + lane) and v_mine the value of this lane's reduced
// column. OUTPUT: returns (S^T q)[reduced column] after the update (unscaled). Every expression is
// ggml's, in its order.
template <int kRows, bool OUTPUT>
__device__ __forceinline__ float token_step(float (&s)[kColumnsPerWarp][kRows], const float * k_tok,
                                            const float * q_tok, const float & v_mine, const float & g,
                                            const float & beta, int lane) {
    const float decay = expf(g);
    float k[kRows], sk_part[kColumnsPerWarp];
    lane_values(k_tok, lane, k);
    column_shares(s, k, sk_part);
    const float sk = reduce_scatter(sk_part, lane);
    float delta[kColumnsPerWarp];
    share_columns((v_mine - decay * sk) * beta, lane, delta);
    update_columns(s, k, decay, delta);
    if constexpr (OUTPUT) {
        float q[kRows], out_part[kColumnsPerWarp];  // (S^T q)[col] after the update
        lane_values(q_tok, lane, q);
        column_shares(s, q, out_part);
        return reduce_scatter(out_part, lane);
    } else {
        return 0.0f;
    }
}

// token_step with its output's reduction left for later: out_part gets this lane's shares of
// (S^T q) after the update, and the shares of the row before (prev_part) are reduced here, at the
// same time as this row's S^T k (the two reductions are independent, so their shuffles overlap
// instead of the output's adding to every row's latency); returns that row's output. The same
// expressions in the same order as token_step: the same bits.
template <int kRows>
__device__ __forceinline__ float token_step_deferred(float (&s)[kColumnsPerWarp][kRows], const float * k_tok,
                                                     const float * q_tok, const float & v_mine, const float & g,
                                                     const float & beta, int lane,
                                                     const float (&prev_part)[kColumnsPerWarp],
                                                     float (&out_part)[kColumnsPerWarp]) {
    const float decay = expf(g);
    float k[kRows], q[kRows], sk_part[kColumnsPerWarp];
    lane_values(k_tok, lane, k);
    lane_values(q_tok, lane, q);
    column_shares(s, k, sk_part);
    const float sk = reduce_scatter(sk_part, lane);
    const float prev_out = reduce_scatter(prev_part, lane);
    float delta[kColumnsPerWarp];
    share_columns((v_mine - decay * sk) * beta, lane, delta);
    update_columns(s, k, decay, delta);
    column_shares(s, q, out_part);
    return prev_out;
}

}  // namespace deltaspec_cuda
