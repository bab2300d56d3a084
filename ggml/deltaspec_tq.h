// deltaspec_tq: TurboQuant-class KV cache types, tq3 and tq4 (TurboQuant-MSE, Zandieh et al. 2025).
//
// Each head vector x of D values (D = 32, 64, 128 or 256) is rotated, y = R x with
// R = H_D S / sqrt(D) (S: fixed random signs, H_D: the Walsh-Hadamard matrix, so R is orthogonal and
// applied by a fast transform), and every coordinate of y is stored as a b-bit index into the
// Lloyd-Max codebook of the law a rotated coordinate follows (ggml/deltaspec_tq_codebook.h, derived by
// python/deltaspec/tq_codebook.py), with one fp16 scale per head vector:
//
//   tq3: a block of D values = fp16 d | qs[D/4]: low 2 bits of each index, 4 per byte (value i at
//        bits 2*(i%4) of byte i/4) | qh[D/8]: the high bit (value i at bit i%8 of byte i/8).
//        2 + 3D/8 bytes: 3 + 16/D bits per value (D=256: 3.0625, 0.68x q4_0's 4.5; D=64: 3.25).
//   tq4: fp16 d | qs[D/2]: 4-bit indices, value i at bits 4*(i%2) of byte i/2.
//        2 + D/2 bytes: 4 + 16/D bits per value (D=256: 4.0625; D=64: 4.25).
//
// The stored vector is y_hat[i] = d * c[idx_i] in the ROTATED domain. Quantizing: sigma = |y|/sqrt(D),
// idx_i = the cell of y_i / sigma (compared against sigma * the codebook's midpoints), then d is the
// least-squares scale of those centroids, <y, c> / <c, c> (never worse than sigma; the "norm
// correction" of vLLM and Luce). Attention never rotates the cache back: since R is orthogonal,
// q.k = (R q).(R k), so the attention node rotates its queries when K is tq, and rotates its output
// back (R^T) when V is tq; the rotation costs O(D log D) per query row, not per cached row.
//
// The arithmetic of the quantizer is fixed (ggml/deltaspec_tq_codec.h): the sums of squares and dot
// products are 32 lane partials (lane l owns values l*D/32 .. (l+1)*D/32-1, fused multiply-adds in
// order) reduced by a butterfly, exactly what a CUDA warp computes, so that the CPU and the CUDA
// quantizers write the same bytes (tests/test_gpu_turboquant.py).
//
// How the types reach ggml without a changed upstream file. ggml's ggml_type enum and its type-trait
// tables are static arrays inside ggml.c and ggml-cpu.c, so a new type cannot be registered from
// outside (an unused enum slot has block size 0 there, which every row-size computation divides by),
// and even a registered type would have no flash-attention kernel. So a tq cache is a plain ggml tensor
// of raw bytes, and two nodes of ours, riding existing op types as the rows ops do
// (ggml/deltaspec_rows.h), write and read it:
//   - the cache tensor is typed BF16 with ne0 = n_head_kv * (bytes of one head) / 2, and carries
//     DELTASPEC_TQ_MAGIC, the bit width and D in its op_params (a leaf's op_params are otherwise
//     unused), which is how the graph builder, the memory tables and state_info know its format.
//     BF16 because ggml-cuda places a SET_ROWS node only for a few destination types, and BF16 is the
//     2-byte one that none of its fused rope/norm + set_rows paths takes (they want F32/F16 rows);
//   - quantize-on-write: a GGML_OP_SET_ROWS node (magic in op_params[0]) from F32 rows;
//   - dequantize-in-attention: a GGML_OP_FLASH_ATTN_EXT node (magic in op_params[4]); K and V may be
//     tq3, tq4 or any ggml type the backend's attention reads (f16, q8_0, ...), in any mix.
// The same two nodes also give ggml's own quantized types the rotation (a "rotated" cache: a plain
// ggml tensor of that type marked DELTASPEC_KV_ROTATED, whose rows hold R x quantized by ggml's
// rounding): llama.cpp rotates its quantized caches alike (with the plain Hadamard transform), which
// spreads outlier channels over the whole head before a block's absmax scale sees them.
// ggml-cpu.c's calls of ggml_compute_forward_set_rows / _flash_attn_ext and ggml-cuda.cu's calls of
// ggml_cuda_op_set_rows / ggml_cuda_flash_attn_ext (and its FA support and allocation-size queries)
// are renamed at build time to our dispatchers (ggml/cpu/inject.cmake, ggml/cuda/inject.cmake), which
// compute our nodes and hand every other node to ggml's function.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DELTASPEC_TQ_MAGIC 0x51544453  // "DSTQ"

// A cache's format (deltaspec_kv_format): a plain ggml type, a ggml type holding rotated rows, tq3, tq4.
enum deltaspec_kv_format {
    DELTASPEC_KV_PLAIN = 0,
    DELTASPEC_KV_ROTATED = 1,
    DELTASPEC_KV_TQ3 = 3,
    DELTASPEC_KV_TQ4 = 4,
};
#define DELTASPEC_TQ_FA_PARAM 4        // op_params index of the magic in an attention node

// Whether D is a head dim the tq types serve.
bool deltaspec_tq_head_dim_ok(int64_t head_dim);
// Bytes of one head vector of D values at `bits` (3 or 4): 2 + D * bits / 8.
size_t deltaspec_tq_head_bytes(int bits, int64_t head_dim);

// A new cache tensor of n_rows rows, each n_heads head vectors of head_dim values at `bits`.
struct ggml_tensor * deltaspec_tq_new_cache(struct ggml_context * ctx, int bits, int64_t head_dim, int64_t n_heads,
                                           int64_t n_rows);
// Copies the tq marking of `from` onto `to` (a tensor over the same bytes, e.g. one slot's part).
void deltaspec_tq_copy_mark(struct ggml_tensor * to, const struct ggml_tensor * from);
// A new cache tensor of ggml type `type` (quantized) whose rows hold rotated head vectors.
struct ggml_tensor * deltaspec_kv_new_rotated_cache(struct ggml_context * ctx, enum ggml_type type, int64_t head_dim,
                                                   int64_t n_heads, int64_t n_rows);
// The bit width (3, 4) of a tq cache tensor, 0 for any other tensor.
int deltaspec_tq_cache_bits(const struct ggml_tensor * cache);
// The format of a cache tensor (enum deltaspec_kv_format; PLAIN for any unmarked tensor).
int deltaspec_kv_format(const struct ggml_tensor * cache);

// What a graph builder uses for any cache (tq or a plain ggml type):
// ne0 and bytes of one head vector of head_dim values in the cache's rows,
int64_t deltaspec_kv_head_ne0(const struct ggml_tensor * cache, int64_t head_dim);
size_t deltaspec_kv_head_bytes(const struct ggml_tensor * cache, int64_t head_dim);
// cache rows idx[t] <- x[:, t] (F32 [n_heads * head_dim, T], idx I64 [T]): ggml_set_rows, or our
// node for a tq or rotated cache,
struct ggml_tensor * deltaspec_kv_set_rows(struct ggml_context * ctx, struct ggml_tensor * cache,
                                           struct ggml_tensor * x, struct ggml_tensor * idx);
// and attention: ggml_flash_attn_ext(q, k, v, mask, scale, 0, 0) when both formats are PLAIN,
// otherwise our node: q F32 [D, T, H, N], k and v views of the caches [head ne0, n_kv, H_kv, N] (rows
// of one head contiguous, any strides), mask F16 [n_kv, >= T, 1, N]; result F32 [D, H, T, N] as
// ggml's. format_k / format_v: deltaspec_kv_format of the caches the views are of.
struct ggml_tensor * deltaspec_kv_flash_attn(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                             struct ggml_tensor * v, struct ggml_tensor * mask, float scale,
                                             int format_k, int format_v);

// Whether t is a node of ours (what the backends' dispatchers ask).
static inline bool deltaspec_tq_is_set_rows(const struct ggml_tensor * t) {
    return t->op == GGML_OP_SET_ROWS && t->op_params[0] == DELTASPEC_TQ_MAGIC;
}
static inline bool deltaspec_tq_is_flash_attn(const struct ggml_tensor * t) {
    return t->op == GGML_OP_FLASH_ATTN_EXT && t->op_params[DELTASPEC_TQ_FA_PARAM] == DELTASPEC_TQ_MAGIC;
}

// Host-side reference codec (the CPU backend's own arithmetic), for tests and tools:
// x: n_heads * head_dim floats -> n_heads * deltaspec_tq_head_bytes bytes, and back to the rotated
// domain; rotation of n_heads vectors in place (inverse = false: y = R x, true: x = R^T y).
void deltaspec_tq_quantize(int bits, int64_t head_dim, int64_t n_heads, const float * x, uint8_t * out);
void deltaspec_tq_dequantize_rotated(int bits, int64_t head_dim, int64_t n_heads, const uint8_t * in, float * y);
void deltaspec_tq_rotate(int64_t head_dim, int64_t n_heads, float * x, bool inverse);

#ifdef __cplusplus
}
#endif
