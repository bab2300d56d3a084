// x of the tensor-core kernels (q4k_mma.cuh, q6k_mma.cuh), which multiply a weight matrix by 2..32
// f32 columns (verifying a draft chain): each column quantized per 256 values (one k-quant block)
// to int8 with one f32 scale, as ggml's CPU path quantizes x (q8_K), by one small kernel before
// the product. Stored for the mma's B fragments: value 32 s + o of column c (sub-block s of 32
// values) at byte (s * n_pad + c) * 32 + o', so that the 8 columns of one mma are 256 contiguous
// bytes; one warp load then touches 2 cache lines, not the 8 of a column-major x. A folded
// rms_norm (XNorm, the products' input is rms_norm(x) * w) is applied here: x * w is quantized and
// the column's 1/rms enters its scales; so is a folded SwiGLU (XGlu, the input is silu(x) * up).
//   * Q4_K (k = 32 per mma): o' = o; lane t of an mma reads values 8t..8t+7 of the sub-block.
//   * Q6_K (k = 16 per mma, one scale per 16 weights): the sub-block's two 16-value halves are
//     interleaved by 4, o' = 8 (o % 16 / 4) + 4 (o / 16) + o % 4, so lane t's values 4t..4t+3 of
//     both halves are one 8-byte load.
// Both also get the integer sums of x's values the kernels' offsets need (XSums): Q4_K's mins
// per 32-value sub-block, Q6_K's -32 per 16-value group.
#pragma once

#include <cooperative_groups.h>
#include <cstdint>
#include <cuda_runtime.h>
#include <type_traits>

#include "gemv_common.cuh"

namespace deltaspec_cuda {

// Per column and 256-value block: sums of x's int8 values as int8 high and low parts (sum = 64 *
// hi + lo, lo in 0..63), as mma B fragments: per 32-value sub-block for Q4_K (entries 0..7), per
// 16-value group for Q6_K (0..15).
struct alignas(16) XSums {
    int8_t hi[16], lo[16];
};

// How quantize_x256 lays x out, for which kernel.
enum class XFormat {
    q4k,  // values in order, sums per 32
    q6k,  // halves interleaved, sums per 16
};

// A SwiGLU folded into the quantization: the products' x is silu(x) * up (ggml's SWIGLU of split
// halves), column c of up at up + c * ld_up, 16-byte aligned.
struct XGlu {
    const float * up = nullptr;  // nullptr: no SwiGLU
    int64_t ld_up = 0;
};

// A residual added as the products are stored (ggml's ADD after the product, fused): y = W x + res,
// column c of res at res + c * ld; res may be y itself (an in-place add).
struct YResidual {
    const float * res = nullptr;  // nullptr: y = W x
    int64_t ld = 0;
};

// Columns padded to a multiple of 8 (the mma's n): 8, 16, 24 or 32.
inline int mma_padded_cols(int n_cols) { return (n_cols + 7) / 8 * 8; }

// Calls launch(std::integral_constant<int, NT>) with NT = the 8-column tiles n_cols (2..32) needs:
// the kernels are templates on NT, which sizes their accumulators.
template <typename Launch>
inline void with_column_tiles(int n_cols, Launch && launch) {
    switch (mma_padded_cols(n_cols) / 8) {
        case 1: launch(std::integral_constant<int, 1>{}); break;
        case 2: launch(std::integral_constant<int, 2>{}); break;
        case 3: launch(std::integral_constant<int, 3>{}); break;
        default: launch(std::integral_constant<int, 4>{}); break;
    }
}

// The quantized x in one device scratch buffer (mma_x_bytes of it, 16-byte aligned):
// values [n_k / 32][n_pad][32] int8, scales dx [n_k / 256][n_pad], sums [n_k / 256][n_pad].
struct MmaX {
    int8_t * values;
    float * dx;
    XSums * sums;
};

inline size_t mma_x_bytes(int64_t n_k, int n_cols) {
    const int64_t n_pad = mma_padded_cols(n_cols), n_blocks = n_k / 256;
    return (size_t)(n_pad * n_k + n_blocks * n_pad * (int64_t)(sizeof(float) + sizeof(XSums)));
}

inline MmaX mma_x_layout(void * scratch, int64_t n_k, int n_cols) {
    const int64_t n_pad = mma_padded_cols(n_cols), n_blocks = n_k / 256;
    int8_t * values = static_cast<int8_t *>(scratch);
    float * dx = reinterpret_cast<float *>(values + n_pad * n_k);
    return {values, dx, reinterpret_cast<XSums *>(dx + n_blocks * n_pad)};
}

// The other layout: the one a pair of products of one x (a Q4_K and a Q6_K matrix) also needs.
__host__ __device__ constexpr XFormat other_format(XFormat f) { return f == XFormat::q4k ? XFormat::q6k : XFormat::q4k; }

// Stores lane `lane`'s 8 quantized values of sub-block s of block b, column col, in F's layout, and
// the sums of its sub-block (sum32: the lane's and its 3 neighbours') or 16-value group (sum16:
// its own and lane ^ 1's).
template <XFormat F>
__device__ __forceinline__ void store_x256(const MmaX & out, int n_pad, int b, int col, int lane, uint32_t lo4,
                                           uint32_t hi4, int sum16, int sum32) {
    const int s = lane >> 2, t = lane & 3;  // values 8t..8t+7 of sub-block s
    int8_t * sub = out.values + ((int64_t)(8 * b + s) * n_pad + col) * 32;
    if (F == XFormat::q6k) {  // values 8t..8t+3: half t / 2, slot 2 (t % 2); 8t+4..8t+7: slot 2 (t % 2) + 1
        const int o = 16 * (t & 1) + 4 * (t >> 1);
        reinterpret_cast<uint32_t *>(sub + o)[0] = lo4;
        reinterpret_cast<uint32_t *>(sub + o + 8)[0] = hi4;
    } else {
        *reinterpret_cast<uint2 *>(sub + 8 * t) = make_uint2(lo4, hi4);
    }
    // lanes t, t ^ 1 hold a 16-value group (2s + t / 2), all four the sub-block s
    if (F == XFormat::q4k ? t == 0 : (t & 1) == 0) {
        const int sum = F == XFormat::q4k ? sum32 : sum16;
        const int hi = sum >= 0 ? sum / 64 : -((-sum + 63) / 64), i = F == XFormat::q4k ? s : 2 * s + (t >> 1);
        XSums & xs = out.sums[(int64_t)b * n_pad + col];
        xs.hi[i] = (int8_t)hi;
        xs.lo[i] = (int8_t)(sum - 64 * hi);
    }
}

// x (n_cols columns of n_k f32, column c at x + c * ldx) -> the layout above; columns
// n_cols..n_pad-1 are zero. One warp per 256 values, 8 per lane (lanes 4s..4s+3 hold sub-block s).
// With a norm, a thread block is one column's n_k / 256 warps (n_k <= 8192), which add up the
// column's sum of squares in shared memory. kBoth: `other` gets the other layout too (the same
// values, scales and sums, so each of a pair of products sees what its own quantization gives).
template <XFormat F, bool kBoth = false>
__global__ void quantize_x256(const float * x, int64_t ldx, int n_cols, int n_k, int n_pad, MmaX out,
                              XNorm norm, XGlu glu, MmaX other) {
    wait_for_inputs();  // x comes from earlier kernels, and so do the last reads of the scratch
    const int lane = threadIdx.x & 31, n_blocks = n_k / 256;
    int col, b;
    if (norm.w != nullptr) {
        col = blockIdx.x;
        b = threadIdx.x >> 5;
    } else {
        const int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
        if (w >= (int64_t)n_pad * n_blocks) return;
        col = (int)(w / n_blocks);
        b = (int)(w % n_blocks);
    }
    float v[8] = {};
    if (col < n_cols) {
        const float4 * p = reinterpret_cast<const float4 *>(x + col * ldx + 256 * b + 8 * lane);
        const float4 v0 = p[0], v1 = p[1];
        v[0] = v0.x; v[1] = v0.y; v[2] = v0.z; v[3] = v0.w; v[4] = v1.x; v[5] = v1.y; v[6] = v1.z; v[7] = v1.w;
        if (glu.up != nullptr) {  // as ggml-cuda's swiglu: x / (1 + exp(-x)) * up
            const float4 * pu = reinterpret_cast<const float4 *>(glu.up + col * glu.ld_up + 256 * b + 8 * lane);
            const float4 u0 = pu[0], u1 = pu[1];
            const float u[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = v[i] / (1.0f + expf(-v[i])) * u[i];
        }
    }
    float col_scale = 1.0f;  // the norm's 1/rms: common to the column, so it joins the scales
    if (norm.w != nullptr) {
        __shared__ float warp_sumsq[32];
        float sumsq = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) sumsq += v[i] * v[i];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sumsq += __shfl_xor_sync(0xffffffffu, sumsq, o);
        if (lane == 0) warp_sumsq[b] = sumsq;
        __syncthreads();
        sumsq = 0.0f;
        for (int i = 0; i < n_blocks; ++i) sumsq += warp_sumsq[i];
        col_scale = rsqrtf(sumsq / (float)n_k + norm.eps);
        const float4 * pw = reinterpret_cast<const float4 *>(norm.w + 256 * b + 8 * lane);
        const float4 w0 = pw[0], w1 = pw[1];
        v[0] *= w0.x; v[1] *= w0.y; v[2] *= w0.z; v[3] *= w0.w; v[4] *= w1.x; v[5] *= w1.y; v[6] *= w1.z; v[7] *= w1.w;
    }
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int q[8], sum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        q[i] = __float2int_rn(v[i] * inv);
        sum += q[i];
    }
    const uint32_t lo4 = __byte_perm(__byte_perm(q[0], q[1], 0x0040), __byte_perm(q[2], q[3], 0x0040), 0x5410);
    const uint32_t hi4 = __byte_perm(__byte_perm(q[4], q[5], 0x0040), __byte_perm(q[6], q[7], 0x0040), 0x5410);
    const int sum16 = sum + __shfl_xor_sync(0xffffffffu, sum, 1);
    const int sum32 = F == XFormat::q4k || kBoth ? sum16 + __shfl_xor_sync(0xffffffffu, sum16, 2) : 0;
    store_x256<F>(out, n_pad, b, col, lane, lo4, hi4, sum16, sum32);
    if (kBoth) store_x256<other_format(F)>(other, n_pad, b, col, lane, lo4, hi4, sum16, sum32);
    const float dx = amax / 127.0f * col_scale;
    if (lane == 0) out.dx[(int64_t)b * n_pad + col] = dx;
    if (kBoth && lane == 0) other.dx[(int64_t)b * n_pad + col] = dx;
}

// The largest n_k a folded norm allows: one thread block holds a column.
constexpr int64_t kMmaNormMaxK = 32 * 256;

// x quantized into scratch (mma_x_bytes(n_k, n_cols)) in F's layout; other_scratch (as large, or
// nullptr) gets the other layout in the same launch.
template <XFormat F>
inline MmaX launch_quantize_x256(const float * x, int64_t ldx, int64_t n_k, int n_cols, void * scratch,
                                 cudaStream_t stream, XNorm norm, XGlu glu, void * other_scratch = nullptr) {
    const int n_pad = mma_padded_cols(n_cols);
    const MmaX out = mma_x_layout(scratch, n_k, n_cols);
    const MmaX other = other_scratch != nullptr ? mma_x_layout(other_scratch, n_k, n_cols) : MmaX{};
    const int64_t warps = (int64_t)n_pad * (n_k / 256);
    const auto kernel = other_scratch != nullptr ? quantize_x256<F, true> : quantize_x256<F, false>;
    if (norm.w != nullptr) {
        const unsigned threads = (unsigned)(n_k / 256 * 32);
        launch(kernel, (unsigned)n_pad, threads, 0, stream, x, ldx, n_cols, (int)n_k, n_pad, out, norm, glu, other);
    } else {
        launch(kernel, (unsigned)((warps + 7) / 8), 256, 0, stream, x, ldx, n_cols, (int)n_k, n_pad, out, norm, glu,
               other);
    }
    return out;
}

// Asynchronous global -> shared copies of the tensor-core kernels' weight stages (ggml's
// cp-async.cuh has the 16-byte one, but needs ggml-cuda's common.cuh; these headers also compile
// alone, for kernels_bench). 16 bytes bypass L1 (.cg, the only form that size allows); 8 go
// through it (.ca).
__device__ __forceinline__ void cp_async16(void * smem, const void * gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(smem)),
                 "l"(gmem));
}

__device__ __forceinline__ void cp_async8(void * smem, const void * gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"((unsigned)__cvta_generic_to_shared(smem)),
                 "l"(gmem));
}

// Row tiles of 16 rows one thread block of a tensor-core kernel covers: its 8 warps split into R
// row tiles x 8 / R phases along k. Every block reads all of x (n_k x 8 NT int8) through L2,
// which for one tile of 16 rows is NP / 9 times the Q4_K weight bytes it reads (x of 16
// columns: 1.8x); the warps of two or four tiles read the same x at about the same time (through L1,
// which caches global loads), so L2 serves it once per R tiles. Measured (H200, kernels_bench): it helps
// where the larger blocks still fill the device (DeltaNet stack at 16 columns 1.31 -> 1.22x one
// column), but the step from 8 to 9 columns (+0.2x) stays: L2 was not the main limit. (An L1
// prefetch of the next block's x, one line a lane, made every case slower: 1.22 -> 2.01x.)
// Calls launch(std::integral_constant<int, R>) for row_tiles = R in 1, 2, 4 (up to MAX).
template <int MAX, typename Launch>
inline void with_row_tiles(int row_tiles, Launch && launch) {
    if (row_tiles <= 1) {
        launch(std::integral_constant<int, 1>{});
    } else if (row_tiles == 2 || MAX == 2) {
        launch(std::integral_constant<int, 2>{});
    } else {
        if constexpr (MAX >= 4) launch(std::integral_constant<int, 4>{});
    }
}

// R for a matrix of n_rows: the most tiles (up to max_tiles) whose blocks still fill the
// device's waves (two blocks per SM) to at least 3/4; else one tile. Every block of a matrix
// carries the same work, so a last wave a fraction full costs a whole wave's time. H200
// (kernels_bench, 16 columns, x one column): ffn gate+up 34816 rows, R = 1/2/4: 1.32/1.31/1.42
// (R = 4 is 2.06 waves); DeltaNet stack 16480 rows: 1.31/1.20/1.19 (R = 4: 0.98 of one wave);
// 5120 rows: 1.33/1.46/2.04 (R = 2 fills 61 % of one wave).
inline int mma_row_tiles(int64_t n_rows, int max_tiles) {
    const int64_t slots = 2 * (int64_t)device_sm_count();
    for (int r = max_tiles; r > 1; r /= 2) {
        const int64_t blocks = (n_rows + 16 * r - 1) / (16 * r), waves = (blocks + slots - 1) / slots;
        if (4 * blocks >= 3 * waves * slots) return r;
    }
    return 1;
}

// Split along k: a row tile's blocks shared by the C thread blocks of a cluster (sm_90+), which add
// up their partial sums through distributed shared memory at the end. Meant for matrices of few
// rows: 5120 rows are 320 tiles of 16, 1.2 waves of the H200's 264 slots (two blocks per SM), so
// the second wave runs a fifth full. The order of the sums is fixed (cluster rank, then warp), so
// results do not vary from run to run. Measured (H200, kernels_bench, 5120 x 17408 and 5120 x
// 6144, 2..32 columns; bench/HISTORY.md): it pays only for Q6_K, and only C = 2 (ffn down at 16
// columns 53.6 -> 50.1 us, 8: 47.7 -> 45.0, 17: 60.5 -> 55.8; C = 4: 63.8 at 16). Q4_K lost with
// both (ffn down at 16: 34.6 -> 36.5 / 50.1; ssm_out 16.7 -> 22.3 / 35.2), so the wave's tail is
// not what holds Q4_K back there (what does was not measured). A guess at Q6_K's gain: its
// thread blocks stage their rows together and wait for each other at every 8-block step.
// This thread block's place in its cluster along k: rank and number of blocks (0 and 1 without
// clusters, as before sm_90).
struct KSplit {
    int rank, size;
};

__device__ __forceinline__ KSplit k_split() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const auto cluster = cooperative_groups::this_cluster();
    return {(int)cluster.block_rank(), (int)cluster.num_blocks()};
#else
    return {0, 1};
#endif
}

// A barrier for the thread block, or for the whole cluster (with its shared memory writes
// visible to every block of it) when the blocks split k.
__device__ __forceinline__ void k_split_sync(const KSplit & ks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (ks.size > 1) {
        cooperative_groups::this_cluster().sync();
        return;
    }
#endif
    __syncthreads();
}

// p, an address in this block's shared memory, as block `rank` of the cluster holds it.
template <typename T>
__device__ __forceinline__ T * k_split_peer(T * p, const KSplit & ks, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (ks.size > 1) return cooperative_groups::this_cluster().map_shared_rank(p, rank);
#endif
    return p;
}

// The C a launch asks for, as the device allows it: clusters need sm_90 or later.
inline int mma_k_split_allowed(int k_split) { return device_facts().cc_major >= 9 ? k_split : 1; }

// The end of a tensor-core kernel whose 8 warps each hold partial sums of 16 rows (R row tiles,
// warp w on tile w % R; lane (g, t): acc[nt] = rows g, g + 8 of its tile x columns 8 nt + 2t,
// 8 nt + 2t + 1, the mma's C layout): add up each tile's 8 / R warps, and those of the other
// thread blocks of its cluster (the split above), in shared memory (mma_partial_floats<NT> floats a
// block) and write y[c * ldy + r] (plus the residual's value there); each block of a cluster
// writes every C-th value.
constexpr int kPartialRowStride = 20;  // 16 rows + 4: the lanes' stores, 8t + g apart, hit 32 banks
template <int NT>
constexpr int mma_partial_floats = 8 * 8 * NT * kPartialRowStride;

template <int NT, int R>
__device__ __forceinline__ void mma_reduce_store(const float (&acc)[NT][4], float * partial, float * y, int64_t ldy,
                                                 YResidual residual, int row_base, int n_rows, int n_cols) {
    constexpr int NP = 8 * NT, KS = 8 / R;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    float * mine = partial + warp * NP * kPartialRowStride;  // [column][row of the warp's tile]
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int c = 8 * nt + 2 * t;
        mine[c * kPartialRowStride + g] = acc[nt][0];
        mine[(c + 1) * kPartialRowStride + g] = acc[nt][1];
        mine[c * kPartialRowStride + g + 8] = acc[nt][2];
        mine[(c + 1) * kPartialRowStride + g + 8] = acc[nt][3];
    }
    const KSplit ks = k_split();
    k_split_sync(ks);  // every block's partial sums are in its shared memory
    for (int i = threadIdx.x + ks.rank * blockDim.x; i < 16 * R * NP; i += blockDim.x * ks.size) {
        const int r = i & 15, tile = (i >> 4) % R, col = i / (16 * R);
        float v = 0.0f;
        for (int c = 0; c < ks.size; ++c) {
            const float * sums = k_split_peer(partial, ks, c);
#pragma unroll
            for (int k = 0; k < KS; ++k) v += sums[((k * R + tile) * NP + col) * kPartialRowStride + r];
        }
        const int row = row_base + 16 * tile + r;
        if (col < n_cols && row < n_rows) {
            if (residual.res != nullptr) v += residual.res[col * residual.ld + row];
            y[col * ldy + row] = v;
        }
    }
    if (ks.size > 1) k_split_sync(ks);  // no block leaves while another still reads its shared memory
}

}  // namespace deltaspec_cuda
