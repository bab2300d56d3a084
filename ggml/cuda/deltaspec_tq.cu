// The tq KV cache nodes on CUDA (ggml/deltaspec_tq.h), run by ggml-cuda's renamed entries
// (inject.cmake): ggml_cuda_op_set_rows -> deltaspec_tq_op_set_rows, ggml_cuda_flash_attn_ext ->
// deltaspec_tq_flash_attn_ext, and FA's support and allocation-size queries; every other node goes to
// ggml's function.
//
// Quantize-on-write and the rotation: the warp kernels of deltaspec_tq_warp.cuh (one warp per head
// vector, the CPU codec's arithmetic step for step, so the bytes equal the CPU quantizer's; that
// header also compiles on the host, where the CPU-only tests check it).
//
// A rotated cache of a ggml type (DELTASPEC_KV_ROTATED): the rows are rotated into a scratch buffer
// and ggml's own set_rows quantizes them; its attention reads the cache as it is.
//
// Attention: Q is rotated when K is rotated (tq or not). A one-token step with both sides tq reads
// the tq rows in place, split over the cache and then merged: by tiles of rows
// (tq_decode_attn_tile, deltaspec_tq_attn_tile.cuh), or with DELTASPEC_TQ_DECODE_KERNEL=warp by the
// older one-warp-per-row kernel (tq_decode_attn and its merge, kept for A/B). Any other
// step decodes the visible K/V rows of a tq side to F16 in the rotated domain and runs ggml's own
// flash attention on them (its vector kernel for a token, its tensor-core kernel for batches): a
// write and a read of F16 K/V per step, ~4.4 bytes per cached value where the in-place kernel reads
// 0.4. The output is rotated back when V is rotated.
#include "common.cuh"
#include "fattn.cuh"
#include "set-rows.cuh"

#include "deltaspec_invariant.h"
#include "deltaspec_tq.h"
#include "deltaspec_tq_codebook.h"
#include "deltaspec_tq_warp.cuh"
#include "deltaspec_tq_attn_tile.cuh"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

using namespace deltaspec_tq_warp;
using namespace deltaspec_tq_attn;

// tq rows [n_kv, Hkv, n_streams] (row (j, hk, n) at src + j*nb1 + hk*nb2 + n*nb3) -> F16 contiguous
// [D, n_kv, Hkv, n_streams] in the rotated domain; one warp per row
template <int BITS, int D>
__global__ void tq_decode(const char * __restrict__ src, size_t nb1, size_t nb2, size_t nb3, int64_t n_kv, int64_t Hkv,
                          int64_t n_rows, half * __restrict__ dst) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t r = (int64_t)blockIdx.x * kWarpsPerBlock + warp;
    if (r >= n_rows) return;
    const int64_t j = r % n_kv, hk = r / n_kv % Hkv, n = r / (n_kv * Hkv);
    const uint8_t * in = (const uint8_t *)(src + j * nb1 + hk * nb2 + n * nb3);
    half hd;
    memcpy(&hd, in, 2);
    const float d = __half2float(hd);
    const uint8_t * qs = in + 2;
    for (int i = lane; i < D; i += 32) {
        const int k = BITS == 3 ? ((qs[i / 4] >> (2 * (i % 4))) & 3) | ((qs[D / 4 + i / 8] >> (i % 8)) & 1) << 2
                                : (qs[i / 2] >> (4 * (i % 2))) & 15;
        dst[r * D + i] = __float2half(d * centroid<BITS, D>(k));
    }
}

// One-token attention reading tq rows in place (both K and V tq, one query per stream): block
// (split, kv head, stream) walks rows [split * chunk, +chunk) with 4 warps taking every 4th row,
// lane l holding values l*D/32 .. of the query heads of that kv head (G of them, rotated) and of
// their accumulators. Per row: the K row's centroids, G warp-reduced dots, the online softmax, the
// V row's centroids into the accumulators. The 4 warps merge in shared memory and the block writes
// its part (accumulator, max, sum per query head) to `part`; tq_decode_merge combines the splits.
template <int D, int BK, int BV>
__global__ void tq_decode_attn(const float * __restrict__ qrot, const char * __restrict__ K, size_t k_nb1, size_t k_nb2,
                               size_t k_nb3, const char * __restrict__ V, size_t v_nb1, size_t v_nb2, size_t v_nb3,
                               const char * __restrict__ mask, size_t mask_nb3, int64_t mask_ne3, int64_t n_kv, int H,
                               int G, float scale, int64_t chunk, float * __restrict__ part) {
    constexpr int NE = D / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t split = blockIdx.x, hk = blockIdx.y, n = blockIdx.z, n_split = gridDim.x;
    float qv[kMaxGroup][NE], acc[kMaxGroup][NE], m[kMaxGroup], s[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
        m[g] = -INFINITY;
        s[g] = 0.0f;
#pragma unroll
        for (int k = 0; k < NE; ++k) {
            qv[g][k] = g < G ? qrot[((hk * G + g) + H * n) * D + lane * NE + k] : 0.0f;
            acc[g][k] = 0.0f;
        }
    }
    const half * mrow = (const half *)(mask + (n % mask_ne3) * mask_nb3);
    const int64_t j1 = min(n_kv, (split + 1) * chunk);
    for (int64_t j = split * chunk + warp; j < j1; j += kWarpsPerBlock) {
        const float mv = __half2float(mrow[j]);
        if (mv == -INFINITY) continue;
        const uint8_t * kr = (const uint8_t *)(K + j * k_nb1 + hk * k_nb2 + n * k_nb3);
        const uint8_t * vr = (const uint8_t *)(V + j * v_nb1 + hk * v_nb2 + n * v_nb3);
        half hk16, hv16;
        memcpy(&hk16, kr, 2);
        memcpy(&hv16, vr, 2);
        float kc[NE], vc[NE];
#pragma unroll
        for (int k = 0; k < NE; ++k) {
            kc[k] = centroid<BK, D>(index_at<BK, D>(kr + 2, lane * NE + k));
            vc[k] = __half2float(hv16) * centroid<BV, D>(index_at<BV, D>(vr + 2, lane * NE + k));
        }
        const float dk = __half2float(hk16) * scale;
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
            if (g >= G) break;
            float dot = 0.0f;
#pragma unroll
            for (int k = 0; k < NE; ++k) dot += qv[g][k] * kc[k];
            const float sc = warp_sum(dot) * dk + mv;
            float w = 1.0f;
            if (sc > m[g]) {
                const float shrink = m[g] == -INFINITY ? 0.0f : expf(m[g] - sc);
#pragma unroll
                for (int k = 0; k < NE; ++k) acc[g][k] *= shrink;
                s[g] *= shrink;
                m[g] = sc;
            } else {
                w = expf(sc - m[g]);
            }
#pragma unroll
            for (int k = 0; k < NE; ++k) acc[g][k] += w * vc[k];
            s[g] += w;
        }
    }
    // merge the 4 warps: each writes its state, then warp 0 combines per query head
    __shared__ float sm_acc[kWarpsPerBlock][kMaxGroup][D], sm_m[kWarpsPerBlock][kMaxGroup], sm_s[kWarpsPerBlock][kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= G) break;
#pragma unroll
        for (int k = 0; k < NE; ++k) sm_acc[warp][g][lane * NE + k] = acc[g][k];
        if (lane == 0) {
            sm_m[warp][g] = m[g];
            sm_s[warp][g] = s[g];
        }
    }
    __syncthreads();
    for (int g = warp; g < G; g += kWarpsPerBlock) {
        float M = -INFINITY;
        for (int w = 0; w < kWarpsPerBlock; ++w) M = fmaxf(M, sm_m[w][g]);
        float S = 0.0f, f[kWarpsPerBlock];
        for (int w = 0; w < kWarpsPerBlock; ++w) {
            f[w] = sm_m[w][g] == -INFINITY ? 0.0f : expf(sm_m[w][g] - M);
            S += sm_s[w][g] * f[w];
        }
        float * out = part + (((n * H) + hk * G + g) * n_split + split) * (D + 2);
        for (int i = lane; i < D; i += 32) {
            float a = 0.0f;
            for (int w = 0; w < kWarpsPerBlock; ++w) a += sm_acc[w][g][i] * f[w];
            out[i] = a;
        }
        if (lane == 0) {
            out[D] = M;
            out[D + 1] = S;
        }
    }
}

// out (contiguous [D, H, 1, N], rotated domain) <- the splits of tq_decode_attn merged; one warp per
// (query head, stream)
template <int D>
__global__ void tq_decode_merge(const float * __restrict__ part, int64_t n_split, int64_t n_heads, float * __restrict__ out) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t hn = (int64_t)blockIdx.x * kWarpsPerBlock + warp;  // h + H * n
    if (hn >= n_heads) return;
    const float * p = part + hn * n_split * (D + 2);
    float M = -INFINITY;
    for (int64_t sp = 0; sp < n_split; ++sp) M = fmaxf(M, p[sp * (D + 2) + D]);
    float S = 0.0f;
    for (int64_t sp = 0; sp < n_split; ++sp) {
        const float ms = p[sp * (D + 2) + D];
        S += ms == -INFINITY ? 0.0f : p[sp * (D + 2) + D + 1] * expf(ms - M);
    }
    const float inv = S > 0.0f ? 1.0f / S : 0.0f;
    for (int i = lane; i < D; i += 32) {
        float a = 0.0f;
        for (int64_t sp = 0; sp < n_split; ++sp) {
            const float ms = p[sp * (D + 2) + D];
            if (ms != -INFINITY) a += p[sp * (D + 2) + i] * expf(ms - M);
        }
        out[hn * D + i] = a * inv;
    }
}

int64_t n_blocks(int64_t n_warps) { return (n_warps + kWarpsPerBlock - 1) / kWarpsPerBlock; }

// Which in-place kernel serves a one-token step with both sides tq: DELTASPEC_TQ_DECODE_KERNEL unset,
// "1" or "tile": tq_decode_attn_tile; "warp": tq_decode_attn; "0": neither, the step goes through
// the decode-to-F16 path (read per call: an A/B switch for the benchmarks and the GPU tests).
enum DecodeKernel { kDecodeF16 = 0, kDecodeTile = 1, kDecodeWarp = 2 };

DecodeKernel decode_kernel_choice() {
    const char * env = std::getenv("DELTASPEC_TQ_DECODE_KERNEL");
    if (env == nullptr || std::strcmp(env, "") == 0 || std::strcmp(env, "1") == 0 || std::strcmp(env, "tile") == 0) {
        return kDecodeTile;
    }
    if (std::strcmp(env, "warp") == 0) return kDecodeWarp;
    if (std::strcmp(env, "0") == 0) return kDecodeF16;
    GGML_ABORT("DELTASPEC_TQ_DECODE_KERNEL must be tile (the default), warp or 0 (decode to F16), got '%s'", env);
}

// Host-side count of the tq attention steps by kernel (DecodeKernel: the F16 path, tile, warp), for
// the GPU tests to check which one ran (deltaspec_cuda_tq_decode_launches).
std::atomic<int64_t> g_decode_launches[3];

// Planted bug for tests/test_gpu_turboquant.py (DELTASPEC_TEST_TQ_ATTN_BUG=skip_last_row, read per
// call): the tile kernel leaves out the last row of every tile.
bool planted_tile_skips_last_row() {
    const char * bug = std::getenv("DELTASPEC_TEST_TQ_ATTN_BUG");
    return bug != nullptr && std::strcmp(bug, "skip_last_row") == 0;
}

// The in-place kernels serve one query per stream with both K and V tq and at most kMaxGroup query
// heads per KV head.
bool decode_kernel_serves(const ggml_tensor * dst, int format_k, int format_v) {
    if (decode_kernel_choice() == kDecodeF16) return false;
    const ggml_tensor *Q = dst->src[0], *K = dst->src[1];
    const bool tq_k = format_k == DELTASPEC_KV_TQ3 || format_k == DELTASPEC_KV_TQ4;
    const bool tq_v = format_v == DELTASPEC_KV_TQ3 || format_v == DELTASPEC_KV_TQ4;
    const int64_t D = Q->ne[0];  // compiled for the large heads, where the cache's bytes dominate (Qwen3.5: 256)
    return tq_k && tq_v && (D == 128 || D == 256) && Q->ne[1] == 1 && Q->ne[2] % K->ne[2] == 0 &&
           Q->ne[2] / K->ne[2] <= kMaxGroup;
}

template <int D>
void launch_decode_attn_warp(int format_k, int format_v, const ggml_tensor * dst, const float * qrot, float * out,
                             ggml_backend_cuda_context & ctx) {
    const ggml_tensor *Q = dst->src[0], *K = dst->src[1], *V = dst->src[2], *mask = dst->src[3];
    float scale;
    memcpy(&scale, dst->op_params, sizeof(float));
    const int64_t n_kv = K->ne[1], Hkv = K->ne[2], N = Q->ne[3], H = Q->ne[2];
    const int64_t chunk = 256, n_split = (n_kv + chunk - 1) / chunk;
    ggml_cuda_pool_alloc<float> part(ctx.pool(), n_split * N * H * (D + 2));
    const dim3 grid((unsigned)n_split, (unsigned)Hkv, (unsigned)N);
    auto * k = format_k == 3 ? (format_v == 3 ? tq_decode_attn<D, 3, 3> : tq_decode_attn<D, 3, 4>)
                             : (format_v == 3 ? tq_decode_attn<D, 4, 3> : tq_decode_attn<D, 4, 4>);
    k<<<grid, 32 * kWarpsPerBlock, 0, ctx.stream()>>>(qrot, (const char *)K->data, K->nb[1], K->nb[2], K->nb[3],
                                                      (const char *)V->data, V->nb[1], V->nb[2], V->nb[3],
                                                      (const char *)mask->data, mask->nb[3], mask->ne[3], n_kv, (int)H,
                                                      (int)(H / Hkv), scale, chunk, part.get());
    tq_decode_merge<D><<<n_blocks(N * H), 32 * kWarpsPerBlock, 0, ctx.stream()>>>(part.get(), n_split, N * H, out);
}

// The split for the tile kernel: whole tiles per block, as few as make about kTileBlocksPerSm blocks
// per SM over all (KV head, stream) pairs (at 64K rows and 4 KV heads on 132 SMs: 4 tiles a block,
// 128 splits, 512 blocks), and one tile per block where the cache is shorter than that (at 4K:
// 32 splits): short caches are latency bound, so more blocks with less work each.
int64_t tile_chunk(int64_t n_kv, int64_t n_pairs, int n_sm) {
    const int64_t n_tiles = (n_kv + kTileRows - 1) / kTileRows;
    const int64_t want_splits = std::max<int64_t>(1, (kTileBlocksPerSm * n_sm + n_pairs - 1) / n_pairs);
    return (n_tiles + want_splits - 1) / want_splits * kTileRows;
}

template <int D>
void launch_decode_attn_tile(int format_k, int format_v, const ggml_tensor * dst, const float * qrot, float * out,
                             ggml_backend_cuda_context & ctx) {
    const ggml_tensor *Q = dst->src[0], *K = dst->src[1], *V = dst->src[2], *mask = dst->src[3];
    float scale;
    memcpy(&scale, dst->op_params, sizeof(float));
    const int64_t n_kv = K->ne[1], Hkv = K->ne[2], N = Q->ne[3], H = Q->ne[2];
    const int64_t chunk = tile_chunk(n_kv, Hkv * N, ggml_cuda_info().devices[ctx.device].nsm);
    const int64_t n_split = (n_kv + chunk - 1) / chunk;
    ggml_cuda_pool_alloc<float> part(ctx.pool(), n_split * N * H * (D + 2));
    const dim3 grid((unsigned)n_split, (unsigned)Hkv, (unsigned)N);
    auto * k = format_k == 3 ? (format_v == 3 ? tq_decode_attn_tile<D, 3, 3> : tq_decode_attn_tile<D, 3, 4>)
                             : (format_v == 3 ? tq_decode_attn_tile<D, 4, 3> : tq_decode_attn_tile<D, 4, 4>);
    k<<<grid, kTileRows, 0, ctx.stream()>>>(qrot, (const char *)K->data, K->nb[1], K->nb[2], K->nb[3],
                                            (const char *)V->data, V->nb[1], V->nb[2], V->nb[3],
                                            (const char *)mask->data, mask->nb[3], mask->ne[3], n_kv, (int)H,
                                            (int)(H / Hkv), scale, chunk, planted_tile_skips_last_row(), part.get());
    deltaspec_attn::merge_attention_splits<D><<<(unsigned)(N * H), D, 0, ctx.stream()>>>(part.get(), n_split, out);
}

template <int D>
void launch_decode_attn(int format_k, int format_v, const ggml_tensor * dst, const float * qrot, float * out,
                        ggml_backend_cuda_context & ctx) {
    const DecodeKernel which = decode_kernel_choice();
    ++g_decode_launches[which];
    if (which == kDecodeWarp) {
        launch_decode_attn_warp<D>(format_k, format_v, dst, qrot, out, ctx);
    } else {
        launch_decode_attn_tile<D>(format_k, format_v, dst, qrot, out, ctx);
    }
}

template <int D> void launch_quantize(int bits, const ggml_tensor * dst, cudaStream_t stream) {
    const ggml_tensor * x = dst->src[0];
    const ggml_tensor * idx = dst->src[1];
    const int64_t T = x->ne[1], H = x->ne[0] / D;
    if (T == 0) return;
    auto * k = bits == 3 ? tq_quantize<3, D> : tq_quantize<4, D>;
    k<<<n_blocks(T * H), 32 * kWarpsPerBlock, 0, stream>>>((const char *)x->data, x->nb[1], (const int64_t *)idx->data,
                                                           (char *)dst->data, dst->nb[1], T, H);
}

template <int D> void launch_rotate(const char * src, size_t nb1, size_t nb2, size_t nb3, int64_t n0, int64_t n1,
                                    int64_t n2, float * dst, bool inverse, cudaStream_t stream) {
    const int64_t n_vec = n0 * n1 * n2;
    tq_rotate<D><<<n_blocks(n_vec), 32 * kWarpsPerBlock, 0, stream>>>(src, nb1, nb2, nb3, n0, n1, n_vec, dst, inverse);
}

template <int D> void launch_decode(int bits, const ggml_tensor * t, half * dst, cudaStream_t stream) {
    const int64_t n_rows = t->ne[1] * t->ne[2] * t->ne[3];
    auto * k = bits == 3 ? tq_decode<3, D> : tq_decode<4, D>;
    k<<<n_blocks(n_rows), 32 * kWarpsPerBlock, 0, stream>>>((const char *)t->data, t->nb[1], t->nb[2], t->nb[3],
                                                            t->ne[1], t->ne[2], n_rows, dst);
}

// fn<D>(args...) for the head dims the tq types serve
#define DELTASPEC_TQ_BY_DIM(D, fn, ...)                       \
    switch (D) {                                              \
        case 32: fn<32>(__VA_ARGS__); break;                  \
        case 64: fn<64>(__VA_ARGS__); break;                  \
        case 128: fn<128>(__VA_ARGS__); break;                \
        case 256: fn<256>(__VA_ARGS__); break;                \
        default: GGML_ABORT("tq: unsupported head dim %d", (int)(D)); \
    }

bool is_tq(int format) { return format == DELTASPEC_KV_TQ3 || format == DELTASPEC_KV_TQ4; }

// The node ggml's flash attention runs instead of ours: the tq sides replaced by F16 tensors of D
// values per row (contiguous, data set by the caller), the magic cleared.
struct PlainAttention {
    ggml_tensor node, q, k, v;
    explicit PlainAttention(const ggml_tensor * dst) {
        node = *dst;
        node.op_params[DELTASPEC_TQ_FA_PARAM] = 0;
        const int format_k = dst->op_params[DELTASPEC_TQ_FA_PARAM + 1];
        const int format_v = dst->op_params[DELTASPEC_TQ_FA_PARAM + 2];
        const int64_t D = dst->src[0]->ne[0];
        q = *dst->src[0];
        k = *dst->src[1];
        v = *dst->src[2];
        if (format_k != DELTASPEC_KV_PLAIN) as_contiguous(q, GGML_TYPE_F32, D);  // the rotated copy
        if (is_tq(format_k)) as_contiguous(k, GGML_TYPE_F16, D);
        if (is_tq(format_v)) as_contiguous(v, GGML_TYPE_F16, D);
        node.src[0] = &q;
        node.src[1] = &k;
        node.src[2] = &v;
    }
    static void as_contiguous(ggml_tensor & t, ggml_type type, int64_t D) {
        t.type = type;
        t.ne[0] = D;
        t.nb[0] = ggml_type_size(type);
        for (int i = 1; i < GGML_MAX_DIMS; ++i) t.nb[i] = t.nb[i - 1] * t.ne[i - 1];
        t.view_src = nullptr;
        t.view_offs = 0;
        t.op = GGML_OP_NONE;
    }
};

// Planted bug for tests/test_gpu_turboquant.py (DELTASPEC_TEST_TQ_BUG=cuda_q_rotated_back, read per call
// so that a test can set it): Q goes through R^T instead of R when K is rotated.
bool planted_q_rotated_back() {
    const char * bug = std::getenv("DELTASPEC_TEST_TQ_BUG");
    return bug != nullptr && std::strcmp(bug, "cuda_q_rotated_back") == 0;
}

void tq_flash_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const int format_k = dst->op_params[DELTASPEC_TQ_FA_PARAM + 1], format_v = dst->op_params[DELTASPEC_TQ_FA_PARAM + 2];
    const ggml_tensor *Q = dst->src[0], *K = dst->src[1], *V = dst->src[2];
    const int64_t D = Q->ne[0];
    cudaStream_t stream = ctx.stream();
    PlainAttention plain(dst);

    ggml_cuda_pool_alloc<float> q_rot(ctx.pool());
    ggml_cuda_pool_alloc<half> k16(ctx.pool()), v16(ctx.pool());
    if (format_k != DELTASPEC_KV_PLAIN) {
        q_rot.alloc(ggml_nelements(Q));
        DELTASPEC_TQ_BY_DIM(D, launch_rotate, (const char *)Q->data, Q->nb[1], Q->nb[2], Q->nb[3], Q->ne[1], Q->ne[2],
                                              Q->ne[3], q_rot.get(), planted_q_rotated_back(), stream);
        plain.q.data = q_rot.get();
    }
    const bool invariant = deltaspec_cuda_invariant(ctx);  // every step: the F16 rows, one kernel for all
    if (!invariant && decode_kernel_serves(dst, format_k, format_v)) {  // one token: the tq rows read in place
        ggml_cuda_pool_alloc<float> out(ctx.pool(), ggml_nelements(dst));
        if (D == 128) {
            launch_decode_attn<128>(format_k, format_v, dst, q_rot.get(), out.get(), ctx);
        } else {
            launch_decode_attn<256>(format_k, format_v, dst, q_rot.get(), out.get(), ctx);
        }
        const size_t f = sizeof(float);  // [D, H, 1, N] contiguous, rotated back into dst
        DELTASPEC_TQ_BY_DIM(D, launch_rotate, (const char *)out.get(), D * f, D * f * dst->ne[1],
                            D * f * dst->ne[1] * dst->ne[2], dst->ne[1], dst->ne[2], dst->ne[3], (float *)dst->data,
                            true, stream);
        return;
    }
    ++g_decode_launches[kDecodeF16];
    if (is_tq(format_k)) {
        k16.alloc(D * K->ne[1] * K->ne[2] * K->ne[3]);
        DELTASPEC_TQ_BY_DIM(D, launch_decode, format_k, K, k16.get(), stream);
        plain.k.data = k16.get();
    }
    if (is_tq(format_v)) {
        v16.alloc(D * V->ne[1] * V->ne[2] * V->ne[3]);
        DELTASPEC_TQ_BY_DIM(D, launch_decode, format_v, V, v16.get(), stream);
        plain.v.data = v16.get();
    }
    // ggml's attention writes into a buffer of the size it asks for (room for its own F16 copies of
    // a side that is neither tq nor F16), then the output goes to dst (rotated back when V is tq)
    plain.node.data = nullptr;
    const size_t out_bytes = ggml_cuda_flash_attn_ext_get_alloc_size(ctx.device, &plain.node) + 256;
    ggml_cuda_pool_alloc<char> out(ctx.pool(), out_bytes);
    plain.node.data = (void *)GGML_PAD((uintptr_t)out.get(), 128);
    if (invariant && deltaspec_invariant_attn_serves(&plain.node)) {
        deltaspec_invariant_attn(ctx, &plain.node, (float *)plain.node.data);
    } else {
        if (invariant) deltaspec_invariant_count(kInvariantMisses);
        ggml_cuda_flash_attn_ext(ctx, &plain.node);
    }
    if (format_v != DELTASPEC_KV_PLAIN) {
        const size_t f = sizeof(float);
        DELTASPEC_TQ_BY_DIM(D, launch_rotate, (const char *)plain.node.data, D * f, D * f * dst->ne[1],
                                              D * f * dst->ne[1] * dst->ne[2], dst->ne[1], dst->ne[2], dst->ne[3],
                                              (float *)dst->data, true, stream);
    } else {
        CUDA_CHECK(cudaMemcpyAsync(dst->data, plain.node.data, ggml_nbytes(dst), cudaMemcpyDeviceToDevice, stream));
    }
}

}  // namespace

// ggml-cuda.cu's calls, renamed (inject.cmake)
void deltaspec_tq_op_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (!deltaspec_tq_is_set_rows(dst)) {
        ggml_cuda_op_set_rows(ctx, dst);
        return;
    }
    const int format = dst->op_params[1];
    const int64_t D = dst->op_params[2];
    if (is_tq(format)) {
        DELTASPEC_TQ_BY_DIM(D, launch_quantize, format, dst, ctx.stream());
        return;
    }
    // a rotated cache of a ggml type: rotated rows into scratch, then ggml's set_rows from there
    const ggml_tensor * x = dst->src[0];
    const int64_t T = x->ne[1], H = x->ne[0] / D;
    ggml_cuda_pool_alloc<float> rotated(ctx.pool(), x->ne[0] * T);
    DELTASPEC_TQ_BY_DIM(D, launch_rotate, (const char *)x->data, D * sizeof(float), x->nb[1], 0, H, T, 1,
                        rotated.get(), false, ctx.stream());
    ggml_tensor rows = *x, node = *dst;
    PlainAttention::as_contiguous(rows, GGML_TYPE_F32, x->ne[0]);
    rows.data = rotated.get();
    node.op_params[0] = 0;
    node.src[0] = &rows;
    ggml_cuda_op_set_rows(ctx, &node);
}

void deltaspec_tq_flash_attn_ext(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (deltaspec_tq_is_flash_attn(dst)) {
        tq_flash_attn(ctx, dst);
    } else if (deltaspec_cuda_invariant(ctx) && deltaspec_invariant_attn_serves(dst)) {
        deltaspec_invariant_attn(ctx, dst, (float *)dst->data);
    } else {
        if (deltaspec_cuda_invariant(ctx)) deltaspec_invariant_count(kInvariantMisses);
        ggml_cuda_flash_attn_ext(ctx, dst);
    }
}

bool deltaspec_tq_flash_attn_ext_supported(int device, const ggml_tensor * dst) {
    if (!deltaspec_tq_is_flash_attn(dst)) return ggml_cuda_flash_attn_ext_supported(device, dst);
    PlainAttention plain(dst);
    // the head dims the kernels are compiled for (deltaspec_tq_head_dim_ok's, which lives in the engine,
    // not in this library: a llama.cpp build of ggml-cuda carries this file without it)
    const int64_t D = dst->src[0]->ne[0];
    return (D == 32 || D == 64 || D == 128 || D == 256) && ggml_cuda_flash_attn_ext_supported(device, &plain.node);
}

// tq attention steps run so far in this process (host side) by the in-place tile kernel (kernel 1),
// the warp kernel (2) or the decode-to-F16 path (0); -1 for another kernel number
extern "C" __attribute__((visibility("default"))) int64_t deltaspec_cuda_tq_decode_launches(int kernel) {
    return kernel >= 0 && kernel < 3 ? g_decode_launches[kernel].load() : -1;
}

// our node's output is plain: ggml's scratch goes into a pool buffer of its own (tq_flash_attn)
size_t deltaspec_tq_flash_attn_ext_get_alloc_size(int device, const ggml_tensor * dst) {
    if (!deltaspec_tq_is_flash_attn(dst)) return ggml_cuda_flash_attn_ext_get_alloc_size(device, dst);
    return ggml_nbytes(dst);
}
