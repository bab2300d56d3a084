// The tq cache types' host side (deltaspec_tq.h): cache tensors and their marking, the graph
// builders, and the reference codec for tests. The computing sides live in ggml-cpu
// (ggml/cpu/deltaspec_tq_cpu.cpp) and ggml-cuda (ggml/cuda/deltaspec_tq.cu).
#include "deltaspec_tq.h"

#include "deltaspec_tq_codec.h"

#include <cstring>
#include <initializer_list>

namespace {

enum mark_param { MARK_MAGIC = 0, MARK_BITS = 1, MARK_HEAD_DIM = 2 };

bool bits_ok(int bits) { return bits == 3 || bits == 4; }

void check_cache_args(int bits, int64_t head_dim) {
    if (!bits_ok(bits)) GGML_ABORT("deltaspec_tq: bits must be 3 or 4, got %d", bits);
    if (!deltaspec_tq_head_dim_ok(head_dim)) {
        GGML_ABORT("deltaspec_tq: head dim must be 32, 64, 128 or 256, got %lld", (long long)head_dim);
    }
}

int64_t cache_head_dim(const ggml_tensor * cache) { return cache->op_params[MARK_HEAD_DIM]; }

}  // namespace

extern "C" {

bool deltaspec_tq_head_dim_ok(int64_t head_dim) { return deltaspec_tq::head_dim_index(head_dim) >= 0; }

size_t deltaspec_tq_head_bytes(int bits, int64_t head_dim) { return deltaspec_tq::head_bytes(bits, head_dim); }

ggml_tensor * deltaspec_tq_new_cache(ggml_context * ctx, int bits, int64_t head_dim, int64_t n_heads, int64_t n_rows) {
    check_cache_args(bits, head_dim);
    const size_t row = n_heads * deltaspec_tq_head_bytes(bits, head_dim);  // even: 2 + 3D/8 or 2 + D/2, D >= 32
    ggml_tensor * t = ggml_new_tensor_2d(ctx, GGML_TYPE_BF16, (int64_t)(row / 2), n_rows);
    t->op_params[MARK_MAGIC] = DELTASPEC_TQ_MAGIC;
    t->op_params[MARK_BITS] = bits;
    t->op_params[MARK_HEAD_DIM] = (int32_t)head_dim;
    return t;
}

void deltaspec_tq_copy_mark(ggml_tensor * to, const ggml_tensor * from) {
    for (int p : {MARK_MAGIC, MARK_BITS, MARK_HEAD_DIM}) to->op_params[p] = from->op_params[p];
}

ggml_tensor * deltaspec_kv_new_rotated_cache(ggml_context * ctx, ggml_type type, int64_t head_dim, int64_t n_heads,
                                             int64_t n_rows) {
    check_cache_args(3, head_dim);
    if (!ggml_is_quantized(type) || head_dim % ggml_blck_size(type) != 0) {
        GGML_ABORT("deltaspec_kv_new_rotated_cache: %s is not a quantized type of whole blocks per head of %lld",
                   ggml_type_name(type), (long long)head_dim);
    }
    ggml_tensor * t = ggml_new_tensor_2d(ctx, type, n_heads * head_dim, n_rows);
    t->op_params[MARK_MAGIC] = DELTASPEC_TQ_MAGIC;
    t->op_params[MARK_BITS] = DELTASPEC_KV_ROTATED;
    t->op_params[MARK_HEAD_DIM] = (int32_t)head_dim;
    return t;
}

int deltaspec_kv_format(const ggml_tensor * cache) {
    if (cache == nullptr || cache->op != GGML_OP_NONE || cache->op_params[MARK_MAGIC] != DELTASPEC_TQ_MAGIC) return 0;
    return cache->op_params[MARK_BITS];
}

int deltaspec_tq_cache_bits(const ggml_tensor * cache) {
    const int format = deltaspec_kv_format(cache);
    return bits_ok(format) ? format : 0;
}

int64_t deltaspec_kv_head_ne0(const ggml_tensor * cache, int64_t head_dim) {
    const int bits = deltaspec_tq_cache_bits(cache);
    return bits ? (int64_t)deltaspec_tq_head_bytes(bits, head_dim) / 2 : head_dim;
}

size_t deltaspec_kv_head_bytes(const ggml_tensor * cache, int64_t head_dim) {
    const int bits = deltaspec_tq_cache_bits(cache);
    return bits ? deltaspec_tq_head_bytes(bits, head_dim) : ggml_row_size(cache->type, head_dim);
}

ggml_tensor * deltaspec_kv_set_rows(ggml_context * ctx, ggml_tensor * cache, ggml_tensor * x, ggml_tensor * idx) {
    const int format = deltaspec_kv_format(cache), bits = deltaspec_tq_cache_bits(cache);
    if (format == DELTASPEC_KV_PLAIN) return ggml_set_rows(ctx, cache, x, idx);
    const int64_t D = cache_head_dim(cache);
    const int64_t n_heads = bits ? cache->ne[0] * 2 / (int64_t)deltaspec_tq_head_bytes(bits, D) : cache->ne[0] / D;
    if (x->type != GGML_TYPE_F32 || x->ne[0] != n_heads * D || x->nb[0] != sizeof(float) || x->ne[2] != 1 ||
        x->ne[3] != 1 || idx->type != GGML_TYPE_I64 || idx->ne[0] != x->ne[1] || !ggml_is_contiguous(idx)) {
        GGML_ABORT("deltaspec_kv_set_rows: x must be F32 [%lld, T] with rows contiguous and idx I64 [T], got x %s "
                   "[%lld, %lld, %lld], idx %s [%lld]", (long long)(n_heads * D), ggml_type_name(x->type),
                   (long long)x->ne[0], (long long)x->ne[1], (long long)x->ne[2], ggml_type_name(idx->type),
                   (long long)idx->ne[0]);
    }
    ggml_tensor * result = ggml_view_tensor(ctx, cache);
    result->op = GGML_OP_SET_ROWS;
    result->src[0] = x;
    result->src[1] = idx;
    result->src[2] = cache;  // as ggml_set_rows (the destination among the sources)
    result->op_params[0] = DELTASPEC_TQ_MAGIC;
    result->op_params[1] = format;
    result->op_params[2] = (int32_t)D;
    return result;
}

ggml_tensor * deltaspec_kv_flash_attn(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                                      ggml_tensor * mask, float scale, int format_k, int format_v) {
    if (format_k == DELTASPEC_KV_PLAIN && format_v == DELTASPEC_KV_PLAIN) {
        return ggml_flash_attn_ext(ctx, q, k, v, mask, scale, 0.0f, 0.0f);
    }
    const int64_t D = q->ne[0];
    auto format_ok = [](int f) { return f == DELTASPEC_KV_PLAIN || f == DELTASPEC_KV_ROTATED || bits_ok(f); };
    if (!format_ok(format_k) || !format_ok(format_v) || !deltaspec_tq_head_dim_ok(D)) {
        GGML_ABORT("deltaspec_kv_flash_attn: formats 0, 1, 3 or 4 and head dim 32..256 (power of two), got %d, %d, "
                   "D=%lld", format_k, format_v, (long long)D);
    }
    const int bits_k = bits_ok(format_k) ? format_k : 0, bits_v = bits_ok(format_v) ? format_v : 0;
    const struct {
        const ggml_tensor * t;
        int bits;
        const char * name;
    } kv[] = {{k, bits_k, "k"}, {v, bits_v, "v"}};
    for (const auto & s : kv) {
        const int64_t ne0 = s.bits ? (int64_t)deltaspec_tq_head_bytes(s.bits, D) / 2 : D;
        if (s.t->ne[0] != ne0 || s.t->ne[1] != k->ne[1] || q->ne[2] % s.t->ne[2] != 0 || s.t->ne[3] != q->ne[3]) {
            GGML_ABORT("deltaspec_kv_flash_attn: %s must be [%lld, n_kv, H_kv, %lld] with H_kv dividing %lld, got "
                       "[%lld, %lld, %lld, %lld]", s.name, (long long)ne0, (long long)q->ne[3], (long long)q->ne[2],
                       (long long)s.t->ne[0], (long long)s.t->ne[1], (long long)s.t->ne[2], (long long)s.t->ne[3]);
        }
    }
    if (q->type != GGML_TYPE_F32 || mask == nullptr || mask->type != GGML_TYPE_F16 || mask->ne[0] != k->ne[1] ||
        mask->ne[1] < q->ne[1]) {
        GGML_ABORT("deltaspec_kv_flash_attn: q must be F32 and mask F16 [n_kv, >= T, ...]");
    }
    ggml_tensor * result = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, q->ne[2], q->ne[1], q->ne[3]);
    result->op = GGML_OP_FLASH_ATTN_EXT;
    result->src[0] = q;
    result->src[1] = k;
    result->src[2] = v;
    result->src[3] = mask;
    const float params[3] = {scale, 0.0f, 0.0f};  // scale, max_bias, logit_softcap (as ggml's)
    memcpy(result->op_params, params, sizeof(params));
    result->op_params[3] = GGML_PREC_DEFAULT;
    result->op_params[DELTASPEC_TQ_FA_PARAM] = DELTASPEC_TQ_MAGIC;
    result->op_params[DELTASPEC_TQ_FA_PARAM + 1] = format_k;
    result->op_params[DELTASPEC_TQ_FA_PARAM + 2] = format_v;
    return result;
}

void deltaspec_tq_quantize(int bits, int64_t head_dim, int64_t n_heads, const float * x, uint8_t * out) {
    check_cache_args(bits, head_dim);
    const size_t hb = deltaspec_tq_head_bytes(bits, head_dim);
    for (int64_t h = 0; h < n_heads; ++h) deltaspec_tq::quantize_head(bits, head_dim, x + h * head_dim, out + h * hb);
}

void deltaspec_tq_dequantize_rotated(int bits, int64_t head_dim, int64_t n_heads, const uint8_t * in, float * y) {
    check_cache_args(bits, head_dim);
    const size_t hb = deltaspec_tq_head_bytes(bits, head_dim);
    for (int64_t h = 0; h < n_heads; ++h) {
        deltaspec_tq::dequantize_head_rotated(bits, head_dim, in + h * hb, y + h * head_dim);
    }
}

void deltaspec_tq_rotate(int64_t head_dim, int64_t n_heads, float * x, bool inverse) {
    check_cache_args(3, head_dim);
    for (int64_t h = 0; h < n_heads; ++h) {
        if (inverse) {
            deltaspec_tq::unrotate(x + h * head_dim, head_dim);
        } else {
            deltaspec_tq::rotate(x + h * head_dim, head_dim);
        }
    }
}

}  // extern "C"
