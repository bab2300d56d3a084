// A C entry point to ggml/cuda/q4k_gemv.cuh for the standalone kernel benchmark (ctypes).
#include "../../ggml/cuda/q4k_gemv.cuh"

extern "C" int deltaspec_q4k_gemv(const void * W, const void * G, const float * x, float * y, long long n_rows,
                                  long long n_cols, long long row_bytes, void * stream, int rows_per_warp) {
    deltaspec_cuda::launch_q4k_gemv(W, G, x, y, n_rows, n_cols, row_bytes, (cudaStream_t)stream,
                                    rows_per_warp);
    return (int)cudaGetLastError();
}
