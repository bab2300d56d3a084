// C entry points to deltaspec's CUDA kernels (ggml/cuda/*.cuh) for the standalone kernel benchmark
// (kernels_bench.py, through ctypes). Each returns the CUDA error of its launch (0: none).
#include "../../ggml/cuda/q4k_gemv.cuh"
#include "../../ggml/cuda/q4k_mma.cuh"
#include "../../ggml/cuda/q6k_gemv.cuh"
#include "../../ggml/cuda/q6k_mma.cuh"

extern "C" {

// paired < 0: the engine's choice (kQ4KPairedMinRows)
int deltaspec_q4k_gemv(const void * W, const void * G, const float * x, float * y, long long n_rows,
                       long long n_cols, long long row_bytes, void * stream, int resident, int paired) {
    const bool pair = paired < 0 ? n_rows >= deltaspec_cuda::kQ4KPairedMinRows : paired != 0;
    deltaspec_cuda::launch_q4k_gemv(W, G, x, y, n_rows, n_cols, row_bytes, (cudaStream_t)stream, resident != 0,
                                    nullptr, deltaspec_cuda::XNorm{}, pair);
    return (int)cudaGetLastError();
}

// resident < 0: the engine's choice (q6k_resident_grid)
int deltaspec_q6k_gemv(const void * W, const float * x, float * y, long long n_rows, long long n_cols,
                       long long row_bytes, void * stream, int resident) {
    const bool grid = resident < 0 ? deltaspec_cuda::q6k_resident_grid(n_rows, n_cols) : resident != 0;
    deltaspec_cuda::launch_q6k_gemv(W, x, y, n_rows, n_cols, row_bytes, (cudaStream_t)stream, grid);
    return (int)cudaGetLastError();
}

long long deltaspec_mma_x_bytes(long long n_k, int n_cols) {
    return (long long)deltaspec_cuda::mma_x_bytes(n_k, n_cols);
}

// row_tiles: 16-row tiles per thread block (1, 2, 4), k_split: thread blocks per cluster sharing
// a tile's k (1..4); 0: the kernel's own choice
int deltaspec_q4k_mma(const void * W, const float * x, long long ldx, float * y, long long ldy, long long n_rows,
                      long long n_k, int n_cols, long long row_bytes, void * scratch, void * stream, int row_tiles,
                      int k_split) {
    deltaspec_cuda::launch_q4k_mma(W, x, ldx, y, ldy, n_rows, n_k, n_cols, row_bytes, scratch, (cudaStream_t)stream,
                                    {}, {}, {}, row_tiles, k_split);
    return (int)cudaGetLastError();
}

// row_tiles: 16-row tiles per thread block (1, 2, 4), k_split: thread blocks per cluster sharing
// a tile's k (1..4); 0: the kernel's own choice
int deltaspec_q6k_mma(const void * W, const float * x, long long ldx, float * y, long long ldy, long long n_rows,
                      long long n_k, int n_cols, long long row_bytes, void * scratch, void * stream, int row_tiles,
                      int k_split) {
    deltaspec_cuda::launch_q6k_mma(W, x, ldx, y, ldy, n_rows, n_k, n_cols, row_bytes, scratch, (cudaStream_t)stream,
                                    {}, {}, {}, row_tiles, k_split);
    return (int)cudaGetLastError();
}

}  // extern "C"
