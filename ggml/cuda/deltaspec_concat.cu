// Concatenation of short rows along dim 0: the DeltaNet conv input, [conv state (Kc-1 values) |
// this batch's T inputs] per channel, whose second part is the transposed product qkv {C, T}.
//
// ggml's kernel for a non-contiguous source gives each of the C = 10240 rows (channels) a thread
// block of its own and reads the transposed part one value per row, T * 4 * C bytes apart: a
// 17-token verify spent 0.45 ms in its 48 launches (9.4 us each; bench/HISTORY.md). Here a thread
// block takes 32 channels: it reads each token's 32 channel values (128 contiguous bytes of
// qkv) into a shared tile and writes the 32 rows, which are contiguous in the result, in one
// coalesced sweep.
//
// Several sequences (decoding N slots: {Kc-1 + Tq, C, N}, each slot's windows beside its rows) are
// planes of the same: grid y. There ggml's kernel took 100 us a layer for 16 sequences of one
// token (a thread block per channel and sequence, 4 values each), 2.4 ms of a 16-sequence step.
//
// Served: f32, dim 0, 2-D or 3-D, the result contiguous, rows of up to kMaxRow values (T <= 61
// with Kc = 4: decode steps and verify batches), what deltaspec's kernels are on for. The rest
// goes to ggml's kernel.
#include "common.cuh"
#include "concat.cuh"
#include "gemv_common.cuh"

#include <cstdint>

bool deltaspec_cuda_kernels_on();  // deltaspec_matmul.cu

namespace {

constexpr int kChannels = 32;  // rows of the result per thread block
constexpr int kMaxRow = 64;    // values per row
constexpr int kThreads = 256;

// dst row c of plane p = [src0 row c (n0 values) | src1 row c (n - n0)] of plane p = blockIdx.y;
// sources by byte strides (value, row, plane)
__global__ void __launch_bounds__(kThreads)
concat_short_rows(const char * src0, const char * src1, float * dst, int n0, int n, int64_t n_rows, int64_t nb00,
                  int64_t nb01, int64_t nb02, int64_t nb10, int64_t nb11, int64_t nb12) {
    __shared__ float tile[kMaxRow][kChannels + 1];  // [value][channel], +1: the write sweep's reads spread over banks
    deltaspec_cuda::wait_for_inputs();
    src0 += blockIdx.y * nb02;
    src1 += blockIdx.y * nb12;
    dst += (int64_t)blockIdx.y * n_rows * n;
    const int lane = threadIdx.x % kChannels, first = threadIdx.x / kChannels;
    const int64_t row0 = (int64_t)blockIdx.x * kChannels, row = row0 + lane;
    if (row < n_rows) {
        for (int i = first; i < n; i += kThreads / kChannels) {  // lanes: 32 neighbouring channels
            const char * p = i < n0 ? src0 + i * nb00 + row * nb01 : src1 + (i - n0) * nb10 + row * nb11;
            tile[i][lane] = *reinterpret_cast<const float *>(p);
        }
    }
    __syncthreads();
    const int rows_here = n_rows - row0 < kChannels ? (int)(n_rows - row0) : kChannels;
    float * out = dst + row0 * n;  // this block's rows are contiguous in dst
    for (int k = threadIdx.x; k < rows_here * n; k += kThreads) out[k] = tile[k % n][k / n];
}

bool serves(const ggml_tensor * dst) {
    const ggml_tensor * a = dst->src[0];
    const ggml_tensor * b = dst->src[1];
    for (const ggml_tensor * t : {dst, a, b}) {
        if (t->type != GGML_TYPE_F32 || t->ne[3] != 1 || t->nb[0] % 4 != 0 || t->nb[1] % 4 != 0 || t->nb[2] % 4 != 0) {
            return false;
        }
    }
    return deltaspec_cuda_kernels_on() && ggml_get_op_params_i32(dst, 0) == 0 && ggml_is_contiguous(dst) &&
           dst->ne[0] <= kMaxRow && a->ne[1] == dst->ne[1] && b->ne[1] == dst->ne[1] &&
           a->ne[2] == dst->ne[2] && b->ne[2] == dst->ne[2] && dst->ne[2] <= 65535 &&
           a->ne[0] + b->ne[0] == dst->ne[0];
}

}  // namespace

// ggml-cuda.cu calls this in place of ggml_cuda_op_concat (inject.cmake renames it).
void deltaspec_op_concat(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (!serves(dst)) {
        ggml_cuda_op_concat(ctx, dst);
        return;
    }
    const ggml_tensor * a = dst->src[0];
    const ggml_tensor * b = dst->src[1];
    const int64_t n_rows = dst->ne[1];
    const dim3 grid((unsigned)((n_rows + kChannels - 1) / kChannels), (unsigned)dst->ne[2]);
    deltaspec_cuda::launch(concat_short_rows, grid, kThreads, 0, ctx.stream(), (const char *)a->data,
                           (const char *)b->data, (float *)dst->data, (int)a->ne[0], (int)dst->ne[0], n_rows,
                           (int64_t)a->nb[0], (int64_t)a->nb[1], (int64_t)a->nb[2], (int64_t)b->nb[0],
                           (int64_t)b->nb[1], (int64_t)b->nb[2]);
    CUDA_CHECK(cudaGetLastError());
}
