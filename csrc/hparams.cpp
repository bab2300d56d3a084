// read_hparams: the qwen35 hyper-parameters from a GGUF's metadata, every value checked, with
// messages that name the file and the key (Python raises them as deltaspec.errors' classes).
#include "hparams.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <memory>
#include <set>

#include "ggml.h"
#include "gguf.h"

namespace deltaspec {

int64_t HParams::n_attention_layers() const { return (int64_t)std::count(recurrent.begin(), recurrent.end(), false); }

int64_t HParams::recurrent_state_bytes() const {
    const int64_t per_layer = ssm_state_size * ssm_state_size * ssm_n_v_heads + (ssm_conv_kernel - 1) * conv_channels();
    return (n_layer - n_attention_layers()) * per_layer * 4;
}

namespace {

constexpr const char * ARCH = "qwen35";
constexpr int64_t MAX_DIM = 1 << 20;  // no real dimension comes near this; larger values mean a corrupt file

// One metadata value, as Python sees it (messages print values the way Python's repr does).
struct Value {
    enum Kind { boolean, integer, real, string, array } kind = integer;
    bool b = false;
    int64_t i = 0;
    double d = 0.0;
    std::string s;
    std::vector<Value> items;

    bool is_number() const { return kind == integer || kind == real || kind == boolean; }
    double number() const { return kind == real ? d : kind == boolean ? (double)b : (double)i; }
    bool truthy() const {
        switch (kind) {
            case boolean: return b;
            case integer: return i != 0;
            case real: return d != 0.0;
            case string: return !s.empty();
            default: return !items.empty();
        }
    }
};

std::string float_repr(double x) {
    if (std::isnan(x)) return "nan";
    if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
    char buf[64];
    std::string s(buf, std::to_chars(buf, buf + sizeof buf, x).ptr);
    // Python writes exponents with a sign and 2+ digits, and integral floats with ".0"
    const size_t e = s.find('e');
    if (e != std::string::npos) {
        std::string mant = s.substr(0, e), exp = s.substr(e + 1);
        const char sign = exp[0] == '-' ? '-' : '+';
        if (exp[0] == '-' || exp[0] == '+') exp = exp.substr(1);
        if (exp.size() < 2) exp = "0" + exp;
        // Python switches to fixed notation for exponents -4 .. 15
        return mant + "e" + sign + exp;
    }
    if (s.find('.') == std::string::npos) s += ".0";
    return s;
}

std::string repr(const Value & v) {
    switch (v.kind) {
        case Value::boolean: return v.b ? "True" : "False";
        case Value::integer: return std::to_string(v.i);
        case Value::real: return float_repr(v.d);
        case Value::string: {
            const bool dq = v.s.find('\'') != std::string::npos && v.s.find('"') == std::string::npos;
            return dq ? "\"" + v.s + "\"" : "'" + v.s + "'";
        }
        default: {
            std::string out = "[";
            for (size_t k = 0; k < v.items.size(); ++k) out += (k ? ", " : "") + repr(v.items[k]);
            return out + "]";
        }
    }
}

// Key id's value of type t, or (element) its array's element `at`, whose data is `arr` (strings: unused).
Value scalar(const gguf_context * g, int64_t id, gguf_type t, bool element = false, size_t at = 0,
             const void * arr = nullptr) {
    Value v;
    auto num = [&](auto x) {
        v.kind = Value::integer;
        v.i = (int64_t)x;
    };
#define DS_GET(T, getter) (element ? ((const T *)arr)[at] : getter(g, id))
    switch (t) {
        case GGUF_TYPE_UINT8: num(DS_GET(uint8_t, gguf_get_val_u8)); break;
        case GGUF_TYPE_INT8: num(DS_GET(int8_t, gguf_get_val_i8)); break;
        case GGUF_TYPE_UINT16: num(DS_GET(uint16_t, gguf_get_val_u16)); break;
        case GGUF_TYPE_INT16: num(DS_GET(int16_t, gguf_get_val_i16)); break;
        case GGUF_TYPE_UINT32: num(DS_GET(uint32_t, gguf_get_val_u32)); break;
        case GGUF_TYPE_INT32: num(DS_GET(int32_t, gguf_get_val_i32)); break;
        case GGUF_TYPE_UINT64: num(DS_GET(uint64_t, gguf_get_val_u64)); break;
        case GGUF_TYPE_INT64: num(DS_GET(int64_t, gguf_get_val_i64)); break;
        case GGUF_TYPE_FLOAT32:
            v.kind = Value::real;
            v.d = DS_GET(float, gguf_get_val_f32);
            break;
        case GGUF_TYPE_FLOAT64:
            v.kind = Value::real;
            v.d = DS_GET(double, gguf_get_val_f64);
            break;
        case GGUF_TYPE_BOOL:
            v.kind = Value::boolean;
            v.b = element ? ((const int8_t *)arr)[at] != 0 : gguf_get_val_bool(g, id);
            break;
        case GGUF_TYPE_STRING:
            v.kind = Value::string;
            v.s = element ? gguf_get_arr_str(g, id, at) : gguf_get_val_str(g, id);
            break;
        default: break;
    }
#undef DS_GET
    return v;
}

Value read_value(const gguf_context * g, int64_t id) {
    const gguf_type t = gguf_get_kv_type(g, id);
    if (t != GGUF_TYPE_ARRAY) return scalar(g, id, t);
    Value v;
    v.kind = Value::array;
    const gguf_type et = gguf_get_arr_type(g, id);
    const size_t n = gguf_get_arr_n(g, id);
    const void * data = et == GGUF_TYPE_STRING ? nullptr : gguf_get_arr_data(g, id);
    v.items.reserve(n);
    for (size_t k = 0; k < n; ++k) {
        v.items.push_back(scalar(g, id, et, /*element =*/true, k, data));
    }
    return v;
}

class Reader {
  public:
    explicit Reader(const std::string & path) : path_(path) {
        gguf_init_params params = {/*no_alloc =*/true, /*ctx =*/&meta_};
        g_ = gguf_init_from_file(path.c_str(), params);
        if (!g_) throw std::runtime_error(path + ": not a readable GGUF file");
    }
    ~Reader() {
        if (meta_) ggml_free(meta_);
        if (g_) gguf_free(g_);
    }

    [[noreturn]] void fail(HParamsError::Kind kind, const std::string & what) const {
        throw HParamsError(kind, path_ + ": " + what);
    }
    [[noreturn]] void bad(const std::string & what) const { fail(HParamsError::hyper_parameter, what); }

    bool has(const std::string & full) const { return gguf_find_key(g_, full.c_str()) >= 0; }
    Value value(const std::string & full) const { return read_value(g_, gguf_find_key(g_, full.c_str())); }
    bool has_tensor(const char * name) const { return gguf_find_tensor(g_, name) >= 0; }
    const ggml_tensor * tensor(const char * name) const { return ggml_get_tensor(meta_, name); }

    // A key of the architecture: absent -> the default (or MissingMetadataError when required);
    // a per-layer array stands for its one nonzero value.
    Value get(const std::string & key, Value::Kind kind, const Value * fallback, bool required = false) const {
        const std::string full = std::string(ARCH) + "." + key;
        if (!has(full)) {
            if (required) fail(HParamsError::missing_metadata, "required metadata key '" + full + "' is missing");
            return *fallback;
        }
        Value v = value(full);
        if (kind == Value::array) {
            if (v.kind != Value::array) bad("metadata key '" + full + "' should be an array, got " + repr(v));
            return v;
        }
        if (v.kind == Value::array) {
            std::vector<Value> distinct;
            for (const Value & x : v.items) {
                if (!x.truthy()) continue;
                const bool seen = std::any_of(distinct.begin(), distinct.end(), [&](const Value & y) {
                    return x.is_number() && y.is_number() ? x.number() == y.number()
                                                          : x.kind == y.kind && x.s == y.s;
                });
                if (!seen) distinct.push_back(x);
            }
            if (distinct.size() != 1) {
                bad("metadata key '" + full + "' varies per layer (" + repr(v) + "); deltaspec needs one value");
            }
            v = distinct[0];
        }
        if (kind == Value::string && v.kind != Value::string) {
            bad("metadata key '" + full + "' should be a string, got " + repr(v));
        }
        if (kind == Value::integer && v.kind != Value::integer) {
            bad("metadata key '" + full + "' should be an integer, got " + repr(v));
        }
        if (kind == Value::real) {
            if (!v.is_number()) bad("metadata key '" + full + "' should be a number, got " + repr(v));
            Value r;
            r.kind = Value::real;
            r.d = v.number();
            return r;
        }
        return v;
    }

    int64_t get_int(const std::string & key, int64_t fallback, bool required = false) const {
        Value f;
        f.i = fallback;
        return get(key, Value::integer, &f, required).i;
    }
    double get_float(const std::string & key, double fallback, bool required = false) const {
        Value f;
        f.kind = Value::real;
        f.d = fallback;
        return get(key, Value::real, &f, required).d;
    }
    std::string get_str(const std::string & key, const std::string & fallback) const {
        Value f;
        f.kind = Value::string;
        f.s = fallback;
        return get(key, Value::string, &f).s;
    }

    int64_t dim(const std::string & key, int64_t value, int64_t lo = 1, int64_t hi = MAX_DIM) const {
        if (value < lo || value > hi) {
            bad("'" + std::string(ARCH) + "." + key + "' = " + std::to_string(value) + " is outside the sane range [" +
                std::to_string(lo) + ", " + std::to_string(hi) + "]");
        }
        return value;
    }

    // An optional float key that must be finite and > lo.
    double number(const std::string & key, double fallback, double lo = 0.0) const {
        const double v = get_float(key, fallback);
        if (!(std::isfinite(v) && v > lo)) {
            bad("'" + std::string(ARCH) + "." + key + "' = " + float_repr(v) + " must be a finite number > " +
                float_repr(lo));
        }
        return v;
    }

    void reject_unless(const std::string & key, double neutral, const std::string & why) const {
        const double v = get_float(key, neutral);
        if (v != neutral) {
            bad("'" + std::string(ARCH) + "." + key + "' = " + float_repr(v) + " is not supported (only " +
                float_repr(neutral) + "): " + why);
        }
    }

    const gguf_context * gguf() const { return g_; }

  private:
    std::string path_;
    gguf_context * g_ = nullptr;
    ggml_context * meta_ = nullptr;
};

std::vector<bool> recurrent_layers(const Reader & f, int64_t n_layer_all, int64_t n_layer) {
    const std::string key = "attention.recurrent_layers";
    if (f.has(std::string(ARCH) + "." + key)) {
        const Value flags = f.get(key, Value::array, nullptr);
        if ((int64_t)flags.items.size() != n_layer_all) {
            f.bad("'" + std::string(ARCH) + "." + key + "' has " + std::to_string(flags.items.size()) +
                  " entries, expected block_count = " + std::to_string(n_layer_all));
        }
        std::vector<bool> out;
        for (int64_t il = 0; il < n_layer; ++il) out.push_back(flags.items[il].truthy());
        return out;
    }
    const int64_t interval = f.dim("full_attention_interval", f.get_int("full_attention_interval", 4), 1, n_layer_all);
    std::vector<bool> out;
    for (int64_t il = 0; il < n_layer; ++il) out.push_back((il + 1) % interval != 0);
    return out;
}

// rope.scaling.* -> ggml_rope_multi's parameters, as llama.cpp derives them for qwen35 (load_hparams,
// then llama_context's constructor) where llama.cpp and transformers agree. A missing type means
// linear, and a missing or zero factor means no scaling (llama.cpp). YaRN's beta_fast / beta_slow /
// attention factor follow the file when it has them, as transformers does with the config they
// were converted from (the pinned llama.cpp ignores these keys for qwen35 and always uses 32 / 1 /
// 1 + 0.1 ln(factor), so files that set them run differently there). Keys that neither reference
// defines for qwen35 are rejected rather than ignored.
void rope_scaling(const Reader & f, HParams & hp) {
    const std::string arch = ARCH;
    const std::string kind = f.get_str("rope.scaling.type", "linear");
    if (kind != "none" && kind != "linear" && kind != "yarn") {
        Value k;
        k.kind = Value::string;
        k.s = kind;
        f.bad("'" + arch + ".rope.scaling.type' = " + repr(k) + " is not supported (none, linear, yarn)");
    }
    f.reject_unless("rope.scaling.attn_factor", 1.0, "transformers has no such scale for qwen35");
    const std::string factor_key = f.has(arch + ".rope.scaling.factor") ? "rope.scaling.factor" : "rope.scale_linear";
    const double factor = f.get_float(factor_key, 0.0);
    if (!(std::isfinite(factor) && factor >= 0.0)) {
        f.bad("'" + arch + "." + factor_key + "' = " + float_repr(factor) + " must be a finite number >= 0");
    }
    hp.rope_n_ctx_orig = hp.n_ctx_train;
    if (kind == "none" || factor == 0.0) return;  // the defaults: plain RoPE
    hp.rope_scaling_type = kind;
    hp.rope_scaling_factor = factor;
    hp.rope_freq_scale = 1.0 / factor;
    if (kind == "linear") return;
    f.reject_unless("rope.scaling.yarn_ext_factor", 1.0, "transformers' YaRN always mixes fully");
    f.reject_unless("rope.scaling.yarn_log_multiplier", 0.0, "a DeepSeek-only YaRN variant");
    hp.rope_n_ctx_orig = f.dim("rope.scaling.original_context_length",
                               f.get_int("rope.scaling.original_context_length", hp.n_ctx_train), 1, 1 << 24);
    // transformers' default attention factor; ggml multiplies 1 + 0.1 ln(factor) in by itself
    // whenever ext_factor != 0, so that part is divided out here (llama.cpp does the same)
    const double ggml_mscale = 1.0 + 0.1 * std::log(factor);
    if (ggml_mscale <= 0.0) f.bad("'" + arch + "." + factor_key + "' = " + float_repr(factor) + " is too small for YaRN");
    const double attention = f.number("rope.scaling.yarn_attn_factor", std::max(ggml_mscale, 1.0));
    hp.rope_ext_factor = 1.0;
    hp.rope_attn_factor = attention / ggml_mscale;
    hp.rope_beta_fast = f.number("rope.scaling.yarn_beta_fast", 32.0);
    hp.rope_beta_slow = f.number("rope.scaling.yarn_beta_slow", 1.0);
}

std::string list_str(const std::vector<int64_t> & xs) {
    std::string out = "[";
    for (size_t k = 0; k < xs.size(); ++k) out += (k ? ", " : "") + std::to_string(xs[k]);
    return out + "]";
}

}  // namespace

std::array<int, 4> mrope_sections(int n_pairs) { return {(n_pairs + 2) / 3, (n_pairs + 1) / 3, n_pairs / 3, 0}; }

// Interleaved M-RoPE (ggml's IMROPE, transformers' mrope_interleaved) gives pair i to section i % 3
// while i < 3 * that section's size. A pair left without a section is rotated by the text position
// in transformers but by the 4th position (0 for text) in llama.cpp and ggml, so such a file has no
// single meaning; real checkpoints never do it, and it is refused rather than silently computed one way.
std::string rope_sections_problem(const std::vector<int64_t> & sections, int64_t n_rot) {
    const int64_t n_pairs = n_rot / 2;
    int64_t sum = 0;
    bool negative = false;
    for (int64_t x : sections) {
        sum += x;
        negative = negative || x < 0;
    }
    if (negative || sum != n_pairs) {
        return list_str(sections) + " must be >= 0 and sum to rope.dimension_count / 2 = " + std::to_string(n_pairs);
    }
    std::vector<int64_t> padded = sections;  // sections past the given ones are empty
    padded.resize(std::max<size_t>(padded.size(), 3), 0);
    std::vector<int64_t> orphans;
    for (int64_t i = 0; i < n_pairs; ++i) {
        if (!(i < 3 * padded[i % 3])) orphans.push_back(i);
    }
    if (!orphans.empty()) {
        const auto want = mrope_sections((int)n_pairs);
        return list_str(sections) + " leave rotary pair(s) " + list_str(orphans) + " of " + std::to_string(n_pairs) +
               " without a section (pair i belongs to section i % 3 while i < 3 * its size); transformers would "
               "rotate them by the text position, llama.cpp by position 0. Expected " +
               list_str({want[0], want[1], want[2], want[3]});
    }
    return "";
}

HParams read_hparams(const std::string & path) {
    Reader f(path);
    const std::string arch_key = "general.architecture";
    if (!f.has(arch_key)) f.fail(HParamsError::missing_metadata, "required metadata key '" + arch_key + "' is missing");
    const Value arch = f.value(arch_key);
    const std::string arch_text = arch.kind == Value::string ? arch.s : repr(arch);
    if (arch.kind != Value::string || arch.s != ARCH) {
        f.fail(HParamsError::unsupported_architecture, "general.architecture is '" + arch_text +
                                                           "', deltaspec runs 'qwen35' (Qwen3.5 / Qwen3.6 dense)");
    }
    HParams hp;
    hp.n_embd = f.dim("embedding_length", f.get_int("embedding_length", 0, true));
    const int64_t n_layer_all = f.dim("block_count", f.get_int("block_count", 0, true), 1, 4096);
    hp.n_layer_nextn = f.dim("nextn_predict_layers", f.get_int("nextn_predict_layers", 0), 0, n_layer_all - 1);
    hp.n_layer = n_layer_all - hp.n_layer_nextn;
    hp.n_head = f.dim("attention.head_count", f.get_int("attention.head_count", 0, true), 1, 4096);
    hp.n_head_kv = f.dim("attention.head_count_kv", f.get_int("attention.head_count_kv", hp.n_head), 1, hp.n_head);
    if (hp.n_head % hp.n_head_kv) {
        f.bad("attention.head_count " + std::to_string(hp.n_head) + " is not a multiple of head_count_kv " +
              std::to_string(hp.n_head_kv));
    }
    hp.head_dim = f.dim("attention.key_length", f.get_int("attention.key_length", hp.n_embd / hp.n_head));
    const int64_t value_dim = f.get_int("attention.value_length", hp.head_dim);
    if (value_dim != hp.head_dim) {
        f.bad("attention.value_length " + std::to_string(value_dim) + " != key_length " + std::to_string(hp.head_dim));
    }
    hp.n_rot = f.dim("rope.dimension_count", f.get_int("rope.dimension_count", hp.head_dim), 2, hp.head_dim);
    if (hp.n_rot % 2) f.bad("rope.dimension_count " + std::to_string(hp.n_rot) + " must be even");
    std::vector<int64_t> sections;
    for (const Value & x : f.get("rope.dimension_sections", Value::array, nullptr, true).items) {
        sections.push_back(x.kind == Value::real ? (int64_t)x.d : x.kind == Value::boolean ? (int64_t)x.b : x.i);
    }
    sections.resize(4, 0);
    const std::string problem = rope_sections_problem(sections, hp.n_rot);
    if (!problem.empty()) f.bad("'" + std::string(ARCH) + ".rope.dimension_sections' = " + problem);
    for (int k = 0; k < 4; ++k) hp.rope_sections[k] = (int)sections[k];
    const double rms_eps = f.get_float("attention.layer_norm_rms_epsilon", 0.0, true);
    if (!(0.0 < rms_eps && rms_eps < 1.0)) {
        f.bad("attention.layer_norm_rms_epsilon " + float_repr(rms_eps) + " is not in (0, 1)");
    }
    hp.rms_eps = (float)rms_eps;
    const double freq_base = f.get_float("rope.freq_base", 10000.0);
    if (!(freq_base > 0.0)) f.bad("rope.freq_base " + float_repr(freq_base) + " must be > 0");
    hp.rope_freq_base = (float)freq_base;

    hp.ssm_conv_kernel = f.dim("ssm.conv_kernel", f.get_int("ssm.conv_kernel", 0, true), 2, 64);
    hp.ssm_state_size = f.dim("ssm.state_size", f.get_int("ssm.state_size", 0, true), 1, 1024);
    hp.ssm_n_k_heads = f.dim("ssm.group_count", f.get_int("ssm.group_count", 0, true), 1, 4096);
    hp.ssm_n_v_heads = f.dim("ssm.time_step_rank", f.get_int("ssm.time_step_rank", 0, true), 1, 4096);
    const int64_t inner = f.get_int("ssm.inner_size", 0, true);
    if (hp.ssm_n_v_heads % hp.ssm_n_k_heads) {
        f.bad("ssm.time_step_rank (value heads) " + std::to_string(hp.ssm_n_v_heads) +
              " is not a multiple of ssm.group_count (key heads) " + std::to_string(hp.ssm_n_k_heads));
    }
    if (inner != hp.ssm_n_v_heads * hp.ssm_state_size) {
        f.bad("ssm.inner_size " + std::to_string(inner) + " != time_step_rank " + std::to_string(hp.ssm_n_v_heads) +
              " * state_size " + std::to_string(hp.ssm_state_size));
    }

    hp.n_ctx_train = f.dim("context_length", f.get_int("context_length", 0, true), 1, 1 << 24);
    hp.recurrent = recurrent_layers(f, n_layer_all, hp.n_layer);

    const ggml_tensor * embd = f.tensor("token_embd.weight");
    if (!embd) f.fail(HParamsError::missing_tensor, "tensor 'token_embd.weight' is missing");
    const int64_t tokens_id = gguf_find_key(f.gguf(), "tokenizer.ggml.tokens");
    const bool has_tokens = tokens_id >= 0 && gguf_get_kv_type(f.gguf(), tokens_id) == GGUF_TYPE_ARRAY;
    const int64_t n_vocab = has_tokens ? (int64_t)gguf_get_arr_n(f.gguf(), tokens_id)
                                       : (ggml_n_dims(embd) > 1 ? embd->ne[1] : 0);
    hp.n_vocab = f.dim("vocab", n_vocab, 1, 1 << 22);
    hp.tied_output = !f.has_tensor("output.weight");
    rope_scaling(f, hp);
    return hp;
}

}  // namespace deltaspec
