// Pieces shared by deltaspec's one-column mat-vec kernels (q4k_gemv.cuh, q6k_gemv.cuh): x
// quantized to int8 once per thread block into shared memory, streaming weight loads, warp sums,
// and a grid sized to what the device keeps resident (each resident thread block then walks many
// row groups, so x is prepared ~once per resident block rather than once per 8 rows).
#pragma once

#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

namespace deltaspec_cuda {

// A speed switch of our kernels for A/B runs: on unless the environment sets `name` to 0. Callers
// read it once (a static), so one process measures one setting.
inline bool env_switch_on(const char * name) {
    const char * env = std::getenv(name);
    return env == nullptr || std::strcmp(env, "0") != 0;
}

__device__ __forceinline__ uint4 load_stream(const uint8_t * p) {
    return __ldcs(reinterpret_cast<const uint4 *>(p));
}

__device__ __forceinline__ uint2 load_stream8(const uint8_t * p) {
    return __ldcs(reinterpret_cast<const uint2 *>(p));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// 16 floats -> 16 int8 (4 words) with one scale: x ~= scale * xq
__device__ __forceinline__ float quantize16(const float4 (&v)[4], int (&xq)[4]) {
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[k].x), fabsf(v[k].y)), fmaxf(fabsf(v[k].z), fabsf(v[k].w))));
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int q0 = __float2int_rn(v[k].x * inv), q1 = __float2int_rn(v[k].y * inv);
        const int q2 = __float2int_rn(v[k].z * inv), q3 = __float2int_rn(v[k].w * inv);
        xq[k] = (int)__byte_perm(__byte_perm(q0, q1, 0x0040), __byte_perm(q2, q3, 0x0040), 0x5410);
    }
    return amax / 127.0f;
}

// x of a mat-vec in shared memory, quantized once per thread block: per 256-value block its int8
// values (256 bytes + 16 bytes of padding), and per block the (scale, exact sum) of its 16 slices
// of 16 values (+ one pad pair; the sums serve zero points such as Q4_K's mins and Q6_K's -32).
// The lanes of a warp read the same offset in different blocks; without the pads those reads all
// fell on the same banks (256 and 128 bytes apart), serializing them up to 8-16 ways.
constexpr int kXValuesStride = 256 + 16;
constexpr int kXSlicesStride = 16 + 1;

struct XShared {
    const int8_t * values_base;
    const float2 * slices_base;
    float scale;  // every product with x is multiplied by this (a folded rms_norm's 1/rms; else 1)
    // the int8 values from `offset` (0..255) of block b
    __device__ __forceinline__ const int8_t * values(int b, int offset) const {
        return values_base + b * kXValuesStride + offset;
    }
    // scale and exact sum of slice s (0..15) of block b
    __device__ __forceinline__ float2 slice(int b, int s) const { return slices_base[b * kXSlicesStride + s]; }
};

__host__ __device__ inline size_t x_smem_bytes(int64_t n_cols) {
    const int64_t n_blocks = n_cols / 256;
    return (size_t)(n_blocks * kXValuesStride + n_blocks * kXSlicesStride * (int64_t)sizeof(float2));
}

// An rms_norm folded into a mat-vec: its x is then rms_norm(x) * w, ggml's fused RMS_NORM + MUL.
struct XNorm {
    const float * w = nullptr;  // n_cols weights, 16-byte aligned; nullptr: x is used as it is
    float eps = 0.0f;
};

// All threads of the block (256): x (n_cols f32, a multiple of 256, 16-byte aligned) -> smem.
// With a norm, x * norm.w is quantized and the norm's 1/rms, common to every value, becomes
// `scale` (per-slice int8 scales do not care about a common factor), so one pass over x serves
// both the sum of squares and the quantization.
__device__ __forceinline__ XShared prepare_x(const float * x, int n_cols, uint8_t * smem,
                                             XNorm norm = XNorm{}) {
    __shared__ float warp_sumsq[8];
    const int n_blocks = n_cols / 256;
    int8_t * values = reinterpret_cast<int8_t *>(smem);
    float2 * slices = reinterpret_cast<float2 *>(smem + n_blocks * kXValuesStride);
    float sumsq = 0.0f;
#pragma unroll 2
    for (int sl = threadIdx.x; sl < n_cols / 16; sl += blockDim.x) {
        const float4 * p = reinterpret_cast<const float4 *>(x + 16 * sl);
        float4 v[4] = {p[0], p[1], p[2], p[3]};  // an activation: a coherent load (see wait_for_inputs)
        if (norm.w != nullptr) {
            const float4 * pw = reinterpret_cast<const float4 *>(norm.w + 16 * sl);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float4 w = __ldg(pw + k);
                sumsq += (v[k].x * v[k].x + v[k].y * v[k].y) + (v[k].z * v[k].z + v[k].w * v[k].w);
                v[k] = make_float4(v[k].x * w.x, v[k].y * w.y, v[k].z * w.z, v[k].w * w.w);
            }
        }
        int q[4];
        const float d = quantize16(v, q);
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) sum += (v[k].x + v[k].y) + (v[k].z + v[k].w);
        const int b = sl >> 4, s = sl & 15;
        *reinterpret_cast<int4 *>(values + b * kXValuesStride + 16 * s) = make_int4(q[0], q[1], q[2], q[3]);
        slices[b * kXSlicesStride + s] = make_float2(d, sum);
    }
    if (norm.w != nullptr) {
        sumsq = warp_sum(sumsq);
        if ((threadIdx.x & 31) == 0) warp_sumsq[threadIdx.x >> 5] = sumsq;
    }
    __syncthreads();
    float scale = 1.0f;
    if (norm.w != nullptr) {
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w) total += warp_sumsq[w];
        scale = rsqrtf(total / (float)n_cols + norm.eps);  // as ggml's rms_norm: 1/sqrt(mean(x^2) + eps)
    }
    return XShared{values, slices, scale};
}

// What the launchers need to know of the current device, asked once per device (the launchers
// run for every product a graph holds while ggml-cuda is not replaying a captured CUDA graph).
struct DeviceFacts {
    int sm_count = 1;
    int cc_major = 0;  // compute capability
};

inline DeviceFacts device_facts() {
    static std::atomic<int> known_sms[64] = {}, known_cc[64] = {};  // 0: not asked yet
    int device = 0;
    cudaGetDevice(&device);
    std::atomic<int> & n_sm = known_sms[device % 64];
    std::atomic<int> & cc = known_cc[device % 64];
    if (n_sm.load() == 0) {
        int n = 1, major = 0;
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
        cc = major;
        n_sm = n > 0 ? n : 1;
    }
    return DeviceFacts{n_sm.load(), cc.load()};
}

inline int device_sm_count() { return device_facts().sm_count; }

// Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
// kernel before it in the stream is still finishing. Ours then issue their first weight loads
// (weights never change during a graph), wait in wait_for_inputs() until that kernel has finished
// and its writes are visible, and only then read activations or write anything. Right after the
// wait each lets the next kernel launch early in turn (ggml-cuda's own kernels take part the same
// way, ggml_cuda_pdl_sync / ggml_cuda_pdl_lc), so the next kernel's thread blocks move onto SMs as
// ours leave them instead of after the whole grid and a launch gap. Without the launch attribute
// (or before sm_90) the wait returns at once.
// What the kernel before writes (activations, x's quantized scratch) is read with plain,
// coherent loads through pointers that are not const __restrict__ and not with __ldg: the
// compiler may treat read-only-path loads as invariant and move them above the wait, and the
// memory model that orders the wait does not cover that path (llama.cpp PR 24030 found such races
// and dropped __restrict__ where ggml-cuda uses early launch). Weights keep it: they never change.
__device__ __forceinline__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Whether the launchers use it: off until the engine switches it on (deltaspec_cuda_set_early_launch),
// so that the standalone kernel benchmark times each launch on its own.
inline std::atomic<bool> & early_launch() {
    static std::atomic<bool> on{false};
    return on;
}

// kernel<<<grid, block, smem, stream>>>(args...), early-launched as above when switched on and
// the device has it, in thread block clusters of `cluster` blocks along x (sm_90 and later; 1: no
// clusters; grid.x must be a multiple). The launch's error, if any, is left for cudaGetLastError as
// with <<<>>>.
template <typename... Params, typename... Args>
inline void launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             int cluster, Args &&... args) {
    cudaLaunchAttribute attrs[2] = {};
    int n_attrs = 0;
    if (early_launch().load() && device_facts().cc_major >= 9) {
        attrs[n_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[n_attrs++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster > 1) {
        attrs[n_attrs].id = cudaLaunchAttributeClusterDimension;
        attrs[n_attrs++].val.clusterDim = {(unsigned)cluster, 1, 1};
    }
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attrs;
    config.numAttrs = n_attrs;
    cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
inline void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args &&... args) {
    launch_clustered(kernel, grid, block, smem, stream, 1, std::forward<Args>(args)...);
}

// Blocks of 256 threads of `kernel` with `smem` bytes that the current device keeps resident at
// once. Asked once per (device, kernel, smem) and remembered: the query costs microseconds, which
// a decode step that launches hundreds of these (when not replaying a CUDA graph) would feel.
template <typename Kernel>
inline int64_t resident_blocks(Kernel kernel, size_t smem) {
    struct Entry {
        int device;
        const void * kernel;
        size_t smem;
        int64_t blocks;
    };
    static std::mutex mutex;
    static std::vector<Entry> known;
    int device = 0;
    cudaGetDevice(&device);
    std::lock_guard<std::mutex> lock(mutex);
    for (const Entry & e : known) {
        if (e.device == device && e.kernel == (const void *)kernel && e.smem == smem) return e.blocks;
    }
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    int per_sm = 1;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, smem);
    known.push_back({device, (const void *)kernel, smem, (int64_t)device_sm_count() * (per_sm > 0 ? per_sm : 1)});
    return known.back().blocks;
}

// Thread blocks of 256 threads to launch for n_groups row groups: with resident, no more than stay
// resident at once, so each block prepares x once and then walks groups blockIdx.x, + gridDim.x,
// ...; without, one block per group.
template <typename Kernel>
inline unsigned launch_grid(Kernel kernel, size_t smem, int64_t n_groups, bool resident) {
    const int64_t most = resident_blocks(kernel, smem);  // also opts into > 48 KB of shared memory
    return (unsigned)(resident && n_groups > most ? most : n_groups);
}

}  // namespace deltaspec_cuda
