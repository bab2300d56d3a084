// pybind11 surface of the engine: `deltaspec._core`. The GIL is released for every call that computes.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>

#include "constraint_bindings.h"
#include "cuda_kernels.h"
#include "dflash_bindings.h"
#include "dflash_drafter.h"
#include "engine.h"
#include "generate.h"
#include "grammar_drafter.h"
#include "mtp_drafter.h"
#include "scheduler.h"
#include "ggml_log.h"
#include "rows_op_bindings.h"
#include "tree_bindings.h"
#include "tq_bindings.h"
#include "deltaspec_tq.h"
#include "speculative.h"
#include "ggml-backend.h"
#include "ggml.h"

namespace py = pybind11;
using namespace deltaspec;

namespace {

LogitsWanted parse_wanted(const std::string & s) {
    if (s == "all") return LogitsWanted::all;
    if (s == "last") return LogitsWanted::last;
    if (s == "none") return LogitsWanted::none;
    throw std::invalid_argument("logits must be 'all', 'last' or 'none', got '" + s + "'");
}

// The engine plus what generation needs from Python once: the detokenizer's piece table (for stop
// strings), a cancel flag that another thread may set, and the scheduler of add_request / step.
struct Runner {
    std::unique_ptr<Engine> engine;
    PieceTable pieces;
    std::atomic<bool> cancel{false};
    std::unique_ptr<Scheduler> scheduler;  // created by the first add_request
    int64_t prefill_budget = 0;            // its set_prefill_budget
    bool prefill_rows = true;              // its and generate_batch's set_prefill_rows
    std::map<int64_t, py::object> constraints;  // add_request's grammars, kept alive until their request ends
    std::unique_ptr<MtpHead> mtp;          // the MTP head run on its own (mtp_eval), made on first use
    BatchSpecStats batch_spec;             // the last generate_batch's speculation across sequences

    // The engine for a one-sequence call (slot 0); refused while scheduled requests hold slots.
    Engine & single() {
        if (scheduler && !scheduler->idle()) {
            throw std::runtime_error("requests added with add_request() are still running; step() them to the end "
                                     "or cancel them before a one-sequence call");
        }
        if (scheduler) scheduler->forget_histories();  // the call may change slot 0
        engine->use_slot(0);
        return *engine;
    }
};

const char * finish_name(FinishReason f) {
    switch (f) {
        case FinishReason::stop: return "stop";
        case FinishReason::length: return "length";
        default: return "cancelled";
    }
}

GenerateRequest make_request(std::vector<int32_t> prompt, int32_t max_tokens, const SamplingParams & sampling,
                             std::vector<int32_t> eog_ids, std::vector<std::string> stop) {
    GenerateRequest req;
    req.prompt = std::move(prompt);
    req.max_tokens = max_tokens;
    req.sampling = sampling;
    req.eog_ids = std::move(eog_ids);
    req.stop = std::move(stop);
    return req;
}

// A Python callable -> the loop's token callback (which runs without the GIL, so it takes it).
TokenCallback make_callback(const py::object & callback) {
    if (callback.is_none()) return {};
    // callback(token, entry): entry (logprob, [(token, logprob)] * n_logprobs) of that token, or None
    // for a request without logprobs
    return [&callback](int32_t token, const GenerateResult & res) {
        py::gil_scoped_acquire gil;
        py::object entry = py::none();
        if (!res.logprobs.empty() && res.logprobs.size() == res.tokens.size()) {
            const size_t at = res.logprobs.size() - 1, k = res.top_ids.size() / res.logprobs.size();
            py::list top;
            for (size_t i = at * k; i < (at + 1) * k; ++i) top.append(py::make_tuple(res.top_ids[i], res.top_logprobs[i]));
            entry = py::make_tuple(res.logprobs.back(), top);
        }
        return callback(token, entry).cast<bool>();
    };
}

// generate(constraint=...): a deltaspec._core.TokenConstraint (the caller keeps it alive) or None.
TokenConstraint * constraint_of(const py::object & constraint) {
    return constraint.is_none() ? nullptr : constraint.cast<TokenConstraint *>();
}

// A scored prompt's entries as prompt_logprobs / prompt_top_ids / prompt_top_logprobs (none: no keys).
void put_prompt_entries(py::dict & d, const std::optional<LogprobEntries> & prompt) {
    if (!prompt) return;
    d["prompt_logprobs"] = prompt->logprobs;
    d["prompt_top_ids"] = prompt->top_ids;
    d["prompt_top_logprobs"] = prompt->top_logprobs;
}

py::dict result_dict(const GenerateResult & res) {
    py::dict out;
    out["tokens"] = res.tokens;
    out["finish_reason"] = finish_name(res.finish);
    out["stop_offset"] = res.stop_offset;
    out["prefill_seconds"] = res.prefill_seconds;
    out["decode_seconds"] = res.decode_seconds;
    out["n_prefilled"] = res.n_prefilled;
    if (!res.logprobs.empty()) {
        out["logprobs"] = res.logprobs;
        out["top_ids"] = res.top_ids;
        out["top_logprobs"] = res.top_logprobs;
    }
    if (!res.hidden.empty()) {  // flat: n_embd floats per prompt token (the caller knows n_embd)
        out["hidden"] = py::array_t<float>((py::ssize_t)res.hidden.size(), res.hidden.data());
    }
    put_prompt_entries(out, res.prompt);
    return out;
}

py::dict generate_py(Runner & r, std::vector<int32_t> prompt, int32_t max_tokens, const SamplingParams & sampling,
                     std::vector<int32_t> eog_ids, std::vector<std::string> stop, py::object callback,
                     py::object constraint, int64_t n_cached, int32_t n_logprobs) {
    if (r.pieces.empty()) throw std::runtime_error("set_pieces() must be called before generate()");
    GenerateRequest req = make_request(std::move(prompt), max_tokens, sampling, std::move(eog_ids), std::move(stop));
    req.constraint = constraint_of(constraint);
    req.n_cached = n_cached;
    req.n_logprobs = n_logprobs;
    const TokenCallback on_token = make_callback(callback);
    GenerateResult res;
    {
        py::gil_scoped_release release;
        res = generate(r.single(), r.pieces, req, r.cancel, on_token);
    }
    return result_dict(res);
}

// One DFlash block pass in target decode steps: it reads the drafter's weights and the target's LM head.
double dflash_pass_cost(const DFlashModel & dm, const Engine & target) {
    return (double)(dm.weight_bytes() + ggml_nbytes(target.weights().output)) / (double)target.step_weight_bytes();
}

// A request's speculation from Python: None, or (draft_n_max, draft_n_min, ngram_max[, reference
// token ids]) for prompt lookup (SeqSpec).
SeqSpec seq_spec_of(const py::object & spec) {
    SeqSpec out;
    if (spec.is_none()) return out;
    auto t = spec.cast<py::tuple>();
    if (t.size() < 3 || t.size() > 8) {
        throw std::invalid_argument("speculation: (draft_n_max, draft_n_min, ngram_max[, reference[, tree_budget[, "
                                    "draft_model[, dflash[, mtp]]]]])");
    }
    out.n_max = t[0].cast<int64_t>();
    out.n_min = t[1].cast<int64_t>();
    out.ngram_max = t[2].cast<int64_t>();
    if (t.size() > 3) out.reference = t[3].cast<std::vector<int32_t>>();
    if (t.size() > 4) out.tree_budget = t[4].cast<int64_t>();
    if (t.size() > 5) out.draft_model = t[5].cast<bool>();
    if (t.size() > 6) out.dflash = t[6].cast<bool>();
    if (t.size() > 7) out.mtp = t[7].cast<bool>();
    if (out.n_max < 1) throw std::invalid_argument("speculation: draft_n_max must be >= 1");
    return out;
}

void add_spec_stats(py::dict & out, const SpecStats & stats) {
    out["n_steps"] = stats.n_steps;
    out["n_drafted"] = stats.n_drafted;
    out["n_accepted"] = stats.n_accepted;
    out["n_tree_nodes"] = stats.n_tree_nodes;
    out["accepted_lengths"] = stats.accepted_lengths;
    out["draft_seconds"] = stats.draft_seconds;
    out["verify_seconds"] = stats.verify_seconds;
    out["rollback_seconds"] = stats.rollback_seconds;
    out["sampler_radix_sorts"] = stats.sampler_radix_sorts;
    out["sampler_comparison_sorts"] = stats.sampler_comparison_sorts;
}

py::dict batch_spec_dict(const BatchSpecStats & s) {
    py::dict d;
    d["verify_passes"] = s.verify_passes;
    d["multi_draft_passes"] = s.multi_draft_passes;
    d["mixed_passes"] = s.mixed_passes;
    d["max_drafting"] = s.max_drafting;
    return d;
}

// Requests (prompt, max_tokens, sampling, stop[, constraint[, speculation]]) run concurrently on the
// engine's slots (speculation: seq_spec_of's).
// The scheduler's draft model (requests with SeqSpec::draft_model): `draft`'s engine, its forward
// costing what the weight bytes each reads per step say (draft over target; batch_draft.h).
void set_draft(Scheduler & scheduler, Runner & r, Runner * draft) {
    if (draft == nullptr) return;
    if (draft == &r) throw std::invalid_argument("the draft model must be a separate Model instance");
    const double step_cost = (double)draft->engine->step_weight_bytes() / (double)r.engine->step_weight_bytes();
    scheduler.set_draft_model(*draft->engine, step_cost);
}

// The DFlash drafter a Python argument names (None: none).
DFlashModel * dflash_of(const py::object & dflash) { return dflash.is_none() ? nullptr : &dflash.cast<DFlashModel &>(); }

// The scheduler's DFlash drafter (requests with SeqSpec::dflash), if any.
void set_dflash(Scheduler & scheduler, Runner & r, DFlashModel * dm) {
    if (dm) scheduler.set_dflash(*dm, dflash_pass_cost(*dm, *r.engine));
}

// generate() with speculation: the scheduler with one sequence that drafts (seq_spec_of's fields).
py::dict generate_spec_py(Runner & r, Runner * draft, int64_t ngram_max, std::vector<int32_t> prompt,
                          int32_t max_tokens, const SamplingParams & sampling, std::vector<int32_t> eog_ids,
                          std::vector<std::string> stop, int64_t n_max, int64_t n_min, py::object callback,
                          int64_t tree_budget, py::object constraint, bool mtp, py::object dflash, int32_t n_logprobs) {
    if (r.pieces.empty()) throw std::runtime_error("set_pieces() must be called before generate()");
    if (n_max < 1 || n_min < 0 || n_min > n_max) throw std::invalid_argument("need 0 <= draft_n_min <= draft_n_max, 1 <= draft_n_max");
    if (tree_budget < 0) throw std::invalid_argument("tree_budget must be >= 0 (0: chains)");
    if (draft == &r) throw std::invalid_argument("the draft model must be a separate Model instance");
    GenerateRequest req = make_request(std::move(prompt), max_tokens, sampling, std::move(eog_ids), std::move(stop));
    req.constraint = constraint_of(constraint);
    req.n_logprobs = n_logprobs;
    const TokenCallback on_token = make_callback(callback);
    SeqSpec spec;
    spec.n_max = n_max;
    spec.n_min = n_min;
    spec.ngram_max = ngram_max;
    spec.tree_budget = tree_budget;
    spec.draft_model = draft != nullptr;
    spec.mtp = mtp;
    DFlashModel * dm = dflash_of(dflash);
    spec.dflash = dm != nullptr;
    if (dm && &dm->target() != r.engine.get()) throw std::invalid_argument("the DFlash drafter belongs to another target");
    SpecStats stats;
    GenerateResult res;
    {
        py::gil_scoped_release release;
        // the scheduler with one sequence, drafting: generate_batch's loop, on slot 0
        Scheduler scheduler(r.single(), r.pieces);
        scheduler.set_max_sequences(1);  // slot 0: a draft model or DFlash drafter needs one slot
        if (draft) draft->single();  // its slots are the scheduler's now
        set_draft(scheduler, r, draft);
        set_dflash(scheduler, r, dm);
        res = scheduler.run_one(req, r.cancel, on_token, spec, &stats);
    }
    py::dict out = result_dict(res);
    add_spec_stats(out, stats);
    if (mtp) out["n_mtp_steps"] = stats.n_mtp_steps;
    return out;
}

py::list generate_batch_py(Runner & r, py::list requests, std::vector<int32_t> eog_ids, Runner * draft,
                           py::object dflash) {
    if (r.pieces.empty()) throw std::runtime_error("set_pieces() must be called before generate_batch()");
    std::vector<GenerateRequest> reqs;
    std::vector<SeqSpec> specs;
    for (py::handle h : requests) {
        auto t = h.cast<py::tuple>();
        reqs.push_back(make_request(t[0].cast<std::vector<int32_t>>(), t[1].cast<int32_t>(),
                                    t[2].cast<SamplingParams>(), eog_ids, t[3].cast<std::vector<std::string>>()));
        if (t.size() > 4) reqs.back().constraint = constraint_of(t[4]);  // `requests` keeps it alive
        specs.push_back(t.size() > 5 ? seq_spec_of(t[5]) : SeqSpec{});
        if (t.size() > 6) reqs.back().n_logprobs = t[6].cast<int32_t>();
    }
    r.single();  // no step()-driven requests in the slots
    DFlashModel * dm = dflash_of(dflash);
    std::vector<GenerateResult> results;
    std::vector<SpecStats> stats;
    {
        py::gil_scoped_release release;
        Scheduler scheduler(*r.engine, r.pieces);
        scheduler.set_prefill_rows(r.prefill_rows);
        if (draft) draft->single();  // its slots are the scheduler's now
        set_draft(scheduler, r, draft);
        set_dflash(scheduler, r, dm);
        results = scheduler.run(reqs, r.cancel, specs, &stats);
        r.batch_spec = scheduler.spec_stats();
    }
    py::list out;
    for (size_t i = 0; i < results.size(); ++i) {
        py::dict d = result_dict(results[i]);
        if (specs[i].n_max > 0) add_spec_stats(d, stats[i]);
        out.append(d);
    }
    return out;
}

py::list step_py(Runner & r) {
    py::list out;
    if (!r.scheduler) return out;
    std::vector<StepEvent> events;
    {
        py::gil_scoped_release release;
        events = r.scheduler->step();
    }
    for (const StepEvent & ev : events) {
        py::dict d;
        d["id"] = ev.id;
        d["tokens"] = ev.tokens;
        if (!ev.logprobs.empty()) {
            d["logprobs"] = ev.logprobs;
            d["top_ids"] = ev.top_ids;
            d["top_logprobs"] = ev.top_logprobs;
        }
        put_prompt_entries(d, ev.prompt);
        d["finished"] = ev.finished;
        if (ev.finished) {
            py::dict res = result_dict(ev.result);
            if (ev.speculative) add_spec_stats(res, ev.spec);
            d["result"] = res;
        } else {
            d["result"] = py::none();
        }
        out.append(d);
        if (ev.finished) r.constraints.erase(ev.id);
    }
    return out;
}

// Live recurrent and KV state of the sequence, for tests comparing rollback with plain decoding.
py::dict state_arrays(Runner & r) {
    py::dict out;
    const SequenceState & st = r.single().state();
    auto grab = [](ggml_tensor * t) {
        py::array_t<uint8_t> a((py::ssize_t)ggml_nbytes(t));
        ggml_backend_tensor_get(t, a.mutable_data(), 0, ggml_nbytes(t));
        return a;
    };
    for (size_t il = 0; il < st.conv.size(); ++il) {
        const std::string i = std::to_string(il);
        if (st.conv[il]) {
            out[("conv." + i).c_str()] = grab(st.conv[il]);
            out[("ssm." + i).c_str()] = grab(st.ssm[il]);
        } else {
            out[("k." + i).c_str()] = grab(st.k[il]);
            out[("v." + i).c_str()] = grab(st.v[il]);
        }
    }
    return out;
}

py::array_t<float> eval(Engine & e, py::array_t<int32_t, py::array::c_style | py::array::forcecast> tokens,
                        const std::string & logits) {
    const LogitsWanted wanted = parse_wanted(logits);
    if (tokens.ndim() != 1) throw std::invalid_argument("tokens must be a 1-D sequence of token ids");
    const int64_t n = tokens.shape(0);
    const int64_t rows = wanted == LogitsWanted::all ? n : wanted == LogitsWanted::last ? 1 : 0;
    py::array_t<float> out({rows, e.hparams().n_vocab});
    const int32_t * ids = tokens.data();
    float * dst = out.mutable_data();
    {
        py::gil_scoped_release release;
        e.eval(ids, n, wanted, dst);
    }
    return out;
}

// Rows of float32 -> ggml's own quantized bytes (gguf-py cannot quantize k-quants).
py::array_t<uint8_t> quantize(py::array_t<float, py::array::c_style | py::array::forcecast> rows, int type_id) {
    if (rows.ndim() != 2) throw std::invalid_argument("quantize expects a 2-D float32 array (rows, n_per_row)");
    if (type_id < 0 || type_id >= GGML_TYPE_COUNT || ggml_get_type_traits((ggml_type)type_id)->blck_size == 0) {
        throw std::invalid_argument("unknown ggml type id " + std::to_string(type_id));
    }
    const auto type = (ggml_type)type_id;
    const int64_t n_rows = rows.shape(0), n_per_row = rows.shape(1);
    if (n_per_row % ggml_blck_size(type) != 0) {
        throw std::invalid_argument(std::string(ggml_type_name(type)) + " needs rows that are a multiple of " +
                                    std::to_string(ggml_blck_size(type)) + " values, got " +
                                    std::to_string(n_per_row));
    }
    if (ggml_quantize_requires_imatrix(type)) {
        throw std::invalid_argument(std::string(ggml_type_name(type)) + " needs an importance matrix");
    }
    const size_t row_bytes = ggml_row_size(type, n_per_row);
    py::array_t<uint8_t> out({n_rows, (int64_t)row_bytes});
    const float * src = rows.data();
    uint8_t * dst = out.mutable_data();
    {
        py::gil_scoped_release release;
        ggml_quantize_init(type);
        ggml_quantize_chunk(type, src, dst, 0, n_rows, n_per_row, nullptr);
    }
    return out;
}

// ggml's own quantized bytes -> float32 rows (the inverse of quantize, through ggml's to_float).
py::array_t<float> dequantize(py::array_t<uint8_t, py::array::c_style> data, int type_id, int64_t n_per_row) {
    if (type_id < 0 || type_id >= GGML_TYPE_COUNT || ggml_get_type_traits((ggml_type)type_id)->blck_size == 0) {
        throw std::invalid_argument("unknown ggml type id " + std::to_string(type_id));
    }
    const auto type = (ggml_type)type_id;
    const auto * traits = ggml_get_type_traits(type);
    if (!traits->to_float || n_per_row % ggml_blck_size(type) != 0) {
        throw std::invalid_argument(std::string("cannot dequantize ") + ggml_type_name(type) + " rows of " +
                                    std::to_string(n_per_row));
    }
    const size_t row_bytes = ggml_row_size(type, n_per_row);
    if (data.size() % row_bytes != 0) throw std::invalid_argument("data is not a whole number of rows");
    const int64_t n_rows = data.size() / row_bytes;
    py::array_t<float> out({n_rows, n_per_row});
    const uint8_t * src = data.data();
    float * dst = out.mutable_data();
    {
        py::gil_scoped_release release;
        for (int64_t r = 0; r < n_rows; ++r) traits->to_float(src + r * row_bytes, dst + r * n_per_row, n_per_row);
    }
    return out;
}

// The CPU backend's registry entry point `name` (ggml exposes its extras by name only), or null.
void * cpu_proc(const char * name) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    return cpu ? ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu), name) : nullptr;
}

// ggml's extra CPU buffer types usable in this build on this CPU ("AMX", "CPU_REPACK", ...): the
// buffers weights would have to live in for ggml to take those matmul paths.
std::vector<std::string> cpu_extra_buffer_types() {
    std::vector<std::string> names;
    auto get = (ggml_backend_dev_get_extra_bufts_t)cpu_proc("ggml_backend_dev_get_extra_bufts");
    if (!get) return names;
    for (ggml_backend_buffer_type_t * b = get(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)); b && *b; ++b) {
        names.emplace_back(ggml_backend_buft_name(*b));
    }
    return names;
}

// Instruction-set features ggml-cpu was compiled with (e.g. "AVX2", "AMX_INT8") -> value.
std::map<std::string, std::string> cpu_features() {
    std::map<std::string, std::string> out;
    auto get = (ggml_backend_get_features_t)cpu_proc("ggml_backend_get_features");
    if (!get) return out;
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    for (ggml_backend_feature * f = get(ggml_backend_dev_backend_reg(cpu)); f && f->name; ++f) out[f->name] = f->value;
    return out;
}

}  // namespace

using Tokens = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// A verify batch through `fn` (logits or argmax of every row), the GIL released while it runs.
template <typename T, typename Fn>  // Fn: void(Engine &, const int32_t * ids, int64_t n, T * out)
py::array_t<T> verify(Runner & r, const Tokens & tokens, std::vector<py::ssize_t> shape, Fn fn) {
    py::array_t<T> out(shape);
    const int32_t * ids = tokens.data();
    T * dst = out.mutable_data();
    const int64_t n = tokens.shape(0);
    Engine & e = r.single();
    {
        py::gil_scoped_release release;
        fn(e, ids, n, dst);
    }
    return out;
}

// A tree batch's rows: row i at its slot's length + its depth (parents[i] an earlier row of the
// slot, or -1). A parent that is not an earlier row gets depth 0 here: the engine names it.
template <typename SlotOf, typename LengthOf>
RowBatch tree_rows(const Tokens & tokens, const Tokens & parents, SlotOf slot_of, LengthOf length_of) {
    const int64_t T = tokens.shape(0);
    RowBatch rows;
    std::vector<int32_t> depth(T, 0);
    for (int64_t i = 0; i < T; ++i) {
        const int32_t p = parents.at(i), s = slot_of(i);
        if (p >= 0 && p < i) depth[i] = depth[p] + 1;
        rows.add(tokens.at(i), (int32_t)(length_of(s) + depth[i]), s, p);
    }
    return rows;
}

PYBIND11_MODULE(_core, m) {
    m.doc() = "deltaspec native engine (ggml)";
    install_ggml_log();  // before anything makes ggml-cuda start up and log
    m.attr("ggml_version") = ggml_version();
    m.attr("ggml_commit") = ggml_commit();
    m.attr("kv_pad") = SequenceState::kv_pad;  // n_ctx is rounded up to a multiple of this

    m.def("has_device", [](const std::string & device) {
              try {
                  return backend_device(device) != nullptr;
              } catch (const std::runtime_error &) {  // absent; a bad name (invalid_argument) is the caller's error
                  return false;
              }
          }, py::arg("device"), "Whether this build can run on `device` ('cpu', 'cuda', 'cuda:N') here "
                                "(that GPU is present and compiled in).");

    m.def("layer_devices", &layer_devices, py::arg("n_blocks"), py::arg("tensor_split"),
          "The device index of blocks 0 .. n_blocks-1 and of the output layer (last) under a layer split with these "
          "shares: llama.cpp's -sm layer -ts rule (csrc/layer_split.h).");

    m.def("rpc_available", &rpc_available, "Whether this build has ggml's RPC backend (devices 'rpc:HOST:PORT').");
    m.def("start_rpc_server", [](const std::string & endpoint, int n_threads) {
              py::gil_scoped_release release;
              start_rpc_server(endpoint, n_threads);
          }, py::arg("endpoint"), py::arg("n_threads") = 1,
          "Serve this process's CPU as ggml RPC device 'rpc:<endpoint>' from a thread of its own until the process "
          "ends (tests: a layer split over two backends without a GPU).");

    m.def("cuda_kernels_available", &cuda_kernels_available,
          "Whether ggml-cuda here carries deltaspec's own kernels (on by default on CUDA; "
          "DELTASPEC_CUDA_KERNELS=0 keeps ggml's).");

    m.def("cuda_set_mma_max_columns", &cuda_set_mma_max_columns, py::arg("n"),
          "The widest product (columns; 0: 32) deltaspec's tensor-core kernels take, in launches of up to 32 "
          "columns, wider ones going to ggml's mmq (benches' A/B runs; DELTASPEC_MMA_MAX_COLUMNS at start). False "
          "without deltaspec's CUDA kernels.");
    m.def("cuda_deltanet_launches", &cuda_deltanet_launches,
          "Host-side launches of deltaspec's DeltaNet kernel for verify batches so far (-1: not in this build).");
    m.def("cuda_pair_count", &cuda_pair_count,
          "Pairs of products (a layer's two input projections of one x) deltaspec's tensor-core kernels computed "
          "from one quantization of x so far (-1: not in this build).");
    m.def("cuda_invariant_count", &cuda_invariant_count, py::arg("which"),
          "How many times batch-invariant CUDA models ran each route so far: 0 products on deltaspec's tensor-core "
          "kernels, 1 products column by column, 2 attention nodes, 3 misses (nodes that went to ggml's "
          "batch-shaped kernels); -1 without the mode (a CPU build).");

    m.def("cpu_extra_buffer_types", &cpu_extra_buffer_types,
          "ggml's extra CPU buffer types available here (AMX, repacking): weights placed in one select its matmuls.");
    m.def("cpu_features", &cpu_features, "Instruction-set features ggml-cpu was compiled with, name -> value.");

    bind_rows_ops(m);  // test-only: single ops on numpy arrays
    bind_trees(m);     // test-only: draft trees and tree walks
    bind_token_constraint(m);
    bind_tq(m);        // test-only: the tq KV cache codec and nodes

    m.def("quantize", &quantize, py::arg("rows"), py::arg("type_id"),
          "Quantize float32 rows with ggml's reference quantizer; returns (rows, row_bytes) uint8.");

    m.def("dequantize", &dequantize, py::arg("data"), py::arg("type_id"), py::arg("n_per_row"),
          "Dequantize ggml-quantized rows to float32 with ggml's own to_float.");

    // deltaspec.errors' class for each kind of HParamsError (read_hparams)
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const HParamsError & e) {
            static const char * names[] = {"MissingMetadataError", "HyperParameterError", "UnsupportedArchitectureError",
                                           "MissingTensorError"};
            py::object cls = py::module_::import("deltaspec.errors").attr(names[e.kind]);
            PyErr_SetObject(cls.ptr(), py::str(e.what()).ptr());
        }
    });

    // The values come from read_hparams; the setters let a test build its own (HParams()).
    py::class_<HParams> hparams(m, "HParams", "qwen35 hyper-parameters, as read_hparams reads and checks them.");
    hparams.def(py::init<>())
        .def_readwrite("n_vocab", &HParams::n_vocab)
        .def_readwrite("n_embd", &HParams::n_embd)
        .def_readwrite("n_layer", &HParams::n_layer, "trunk layers (block_count - nextn_predict_layers)")
        .def_readwrite("n_layer_nextn", &HParams::n_layer_nextn, "MTP layers stored after the trunk (not run yet)")
        .def_readwrite("n_ctx_train", &HParams::n_ctx_train)
        .def_readwrite("rms_eps", &HParams::rms_eps)
        .def_readwrite("tied_output", &HParams::tied_output)
        .def_readwrite("n_head", &HParams::n_head)
        .def_readwrite("n_head_kv", &HParams::n_head_kv)
        .def_readwrite("head_dim", &HParams::head_dim)
        .def_readwrite("n_rot", &HParams::n_rot)
        .def_readwrite("rope_freq_base", &HParams::rope_freq_base)
        .def_readwrite("rope_sections", &HParams::rope_sections)
        .def_readwrite("rope_scaling_type", &HParams::rope_scaling_type)
        .def_readwrite("rope_scaling_factor", &HParams::rope_scaling_factor)
        .def_readwrite("rope_freq_scale", &HParams::rope_freq_scale)
        .def_readwrite("rope_ext_factor", &HParams::rope_ext_factor)
        .def_readwrite("rope_attn_factor", &HParams::rope_attn_factor)
        .def_readwrite("rope_beta_fast", &HParams::rope_beta_fast)
        .def_readwrite("rope_beta_slow", &HParams::rope_beta_slow)
        .def_readwrite("rope_n_ctx_orig", &HParams::rope_n_ctx_orig)
        .def_readwrite("ssm_conv_kernel", &HParams::ssm_conv_kernel)
        .def_readwrite("ssm_state_size", &HParams::ssm_state_size)
        .def_readwrite("ssm_n_k_heads", &HParams::ssm_n_k_heads)
        .def_readwrite("ssm_n_v_heads", &HParams::ssm_n_v_heads)
        .def_readwrite("recurrent", &HParams::recurrent, "per trunk layer: True = Gated DeltaNet, False = attention")
        .def_property_readonly("conv_channels", &HParams::conv_channels)
        .def_property_readonly("n_attention_layers", &HParams::n_attention_layers)
        .def_property_readonly("recurrent_state_bytes", &HParams::recurrent_state_bytes,
                               "F32 DeltaNet states plus conv windows of every recurrent layer, for one sequence")
        .def_property_readonly("rope_scaling", [](const HParams & h) {
                 return py::module_::import("deltaspec.qwen35").attr("RopeScaling")(
                     h.rope_scaling_type, h.rope_scaling_factor, h.rope_freq_scale, h.rope_ext_factor,
                     h.rope_attn_factor, h.rope_beta_fast, h.rope_beta_slow, h.rope_n_ctx_orig);
             }, "The RoPE scaling fields as a deltaspec.qwen35.RopeScaling.")
        .def("__repr__", [](const HParams & h) {
                 return "HParams(n_vocab=" + std::to_string(h.n_vocab) + ", n_embd=" + std::to_string(h.n_embd) +
                        ", n_layer=" + std::to_string(h.n_layer) + ", n_head=" + std::to_string(h.n_head) +
                        ", n_head_kv=" + std::to_string(h.n_head_kv) + ", head_dim=" + std::to_string(h.head_dim) +
                        ", ssm_state_size=" + std::to_string(h.ssm_state_size) + ")";
             });

    m.def("read_hparams", &read_hparams, py::arg("path"), py::call_guard<py::gil_scoped_release>(),
          "The qwen35 hyper-parameters of the GGUF at path, checked (deltaspec.errors' exceptions name the key).");
    m.def("mrope_sections", &mrope_sections, py::arg("n_pairs"));
    m.def("rope_sections_problem", &rope_sections_problem, py::arg("sections"), py::arg("n_rot"));

    py::class_<SamplingParams>(m, "SamplingParams")
        .def(py::init<>())
        .def_readwrite("temperature", &SamplingParams::temperature)
        .def_readwrite("top_k", &SamplingParams::top_k)
        .def_readwrite("top_p", &SamplingParams::top_p)
        .def_readwrite("min_p", &SamplingParams::min_p)
        .def_readwrite("repeat_penalty", &SamplingParams::repeat_penalty)
        .def_readwrite("presence_penalty", &SamplingParams::presence_penalty)
        .def_readwrite("frequency_penalty", &SamplingParams::frequency_penalty)
        .def_readwrite("penalty_last_n", &SamplingParams::penalty_last_n)
        .def_readwrite("seed", &SamplingParams::seed)
        .def_readwrite("logit_bias", &SamplingParams::logit_bias,
                       "[(token, bias)] added to the logits after the penalties; -inf bans a token");

    py::class_<Runner>(m, "Engine")
        .def(py::init([](const std::string & path, const HParams & hp, int64_t n_ctx, int64_t n_ubatch, int n_threads,
                         const std::string & device, int type_k, int type_v,
                         py::object progress, int64_t n_seq_max, int kv_format_k, int kv_format_v,
                         const std::vector<std::string> & devices, const std::vector<float> & tensor_split,
                         bool batch_invariant) {
                 EngineOptions o;
                 o.batch_invariant = batch_invariant;
                 o.devices = devices;
                 o.tensor_split = tensor_split;
                 o.n_ctx = n_ctx;
                 o.n_seq_max = n_seq_max;
                 o.n_ubatch = n_ubatch;
                 o.n_threads = n_threads;
                 o.device = device;
                 for (int t : {type_k, type_v}) {
                     if (t < 0 || t >= GGML_TYPE_COUNT) throw std::invalid_argument("unknown ggml type id " + std::to_string(t));
                 }
                 o.type_k = (ggml_type)type_k;
                 o.type_v = (ggml_type)type_v;
                 o.kv_format_k = kv_format_k;
                 o.kv_format_v = kv_format_v;
                 if (!progress.is_none()) {
                     // Captured by reference: copies of the std::function made without the GIL must not
                     // touch the Python object's reference count. An exception it raises aborts the load.
                     o.progress = [&progress](size_t done, size_t total) {
                         py::gil_scoped_acquire gil;
                         progress(done, total);
                     };
                 }
                 auto r = std::make_unique<Runner>();
                 py::gil_scoped_release release;
                 r->engine = std::make_unique<Engine>(path, hp, o);
                 return r;
             }),
             py::arg("path"), py::arg("hparams"), py::arg("n_ctx"), py::arg("n_ubatch"), py::arg("n_threads"),
             py::arg("device"), py::arg("type_k"), py::arg("type_v"), py::arg("progress") = py::none(),
             py::arg("n_seq_max") = 1, py::arg("kv_format_k") = 0, py::arg("kv_format_v") = 0,
             py::arg("devices") = std::vector<std::string>(), py::arg("tensor_split") = std::vector<float>(),
             py::arg("batch_invariant") = false,
             "batch_invariant: each row computed as in any batch (EngineOptions): ggml-cpu's reference paths on the "
             "CPU, deltaspec's invariant routes on CUDA. "
             "devices / tensor_split: a layer split over these devices (csrc/layer_split.h; `device` then unused). "
             "kv_format_k / kv_format_v (ggml/deltaspec_tq.h): 1 stores rotated rows of type_k / type_v, 3 or 4 "
             "makes that cache tq3 / tq4 (type_k / type_v then unused). "
             "progress: None or a callable(done_bytes, total_bytes), called with the GIL held at most ~100 "
             "times while the weights are copied to the device, last with done == total.")
        .def("eval", [](Runner & r, py::array_t<int32_t, py::array::c_style | py::array::forcecast> tokens,
                        const std::string & logits) { return eval(r.single(), tokens, logits); },
             py::arg("tokens"), py::arg("logits") = "last",
             "Append tokens to the sequence; returns float32 logits of shape (rows, n_vocab).")
        .def("reset", [](Runner & r) {
                 Engine & e = r.single();
                 py::gil_scoped_release release;
                 e.reset();
             })
        .def("set_pieces", [](Runner & r, std::vector<py::bytes> pieces) {
                 r.pieces.clear();
                 for (const auto & p : pieces) r.pieces.emplace_back(p);
             }, py::arg("pieces"), "The detokenizer's bytes for every token id (used to find stop strings).")
        .def("generate", &generate_py, py::arg("prompt"), py::arg("max_tokens"), py::arg("sampling"),
             py::arg("eog_ids"), py::arg("stop"), py::arg("callback") = py::none(), py::arg("constraint") = py::none(),
             py::arg("n_cached") = 0,
             py::arg("n_logprobs") = -1,
             "Prefill a fresh sequence with prompt (or, n_cached > 0, only what follows the first n_cached "
             "tokens, which the state holds), then sample until a stop condition. n_logprobs >= 0 adds "
             "logprobs / top_ids / top_logprobs to the result.")
        .def("eval_hidden", [](Runner & r, Tokens tokens) {
                 Engine & e = r.single();
                 py::array_t<float> out({(int64_t)tokens.shape(0), e.hparams().n_embd});
                 const int32_t * ids = tokens.data();
                 float * dst = out.mutable_data();
                 const int64_t n = tokens.shape(0);
                 py::gil_scoped_release release;
                 e.eval_hidden(ids, n, dst);
                 return out;
             }, py::arg("tokens"), "Append tokens; their final hidden states (after the output norm), (n, n_embd).")
        .def("save_sequence", [](Runner & r) {
                 Engine & e = r.single();
                 std::vector<std::pair<std::string, std::string>> saved;
                 {
                     py::gil_scoped_release release;
                     saved = e.save_sequence();
                 }
                 py::list out;
                 for (auto & [name, bytes] : saved) out.append(py::make_tuple(name, py::bytes(bytes)));
                 return out;
             }, "The sequence's state: [(tensor name, bytes)] (KV rows up to n_past, recurrent state).")
        .def("load_sequence", [](Runner & r, int64_t n_past, const std::vector<std::pair<std::string, std::string>> & t) {
                 Engine & e = r.single();
                 py::gil_scoped_release release;
                 e.load_sequence(n_past, t);
             }, py::arg("n_past"), py::arg("tensors"), "Restore a save_sequence() result into the sequence.")
        .def("generate_speculative", &generate_spec_py, py::arg("draft"), py::arg("ngram_max"), py::arg("prompt"),
             py::arg("max_tokens"), py::arg("sampling"), py::arg("eog_ids"), py::arg("stop"), py::arg("n_max"),
             py::arg("n_min"), py::arg("callback") = py::none(), py::arg("tree_budget") = 0,
             py::arg("constraint") = py::none(), py::arg("mtp") = false, py::arg("dflash") = py::none(),
             py::arg("n_logprobs") = -1,
             "Draft-verify generation with a draft model (draft), the model's MTP head (mtp=True), a DFlash "
             "drafter (dflash) or prompt lookup (draft=None); draft trees of up to tree_budget nodes when > 0, "
             "chains otherwise. n_logprobs >= 0 adds logprobs / top_ids / top_logprobs (those of the target's "
             "rows that predicted the committed tokens) to the result.")
        .def("set_taps", [](Runner & r, std::vector<int> layers) { r.single().set_taps(layers); }, py::arg("layers"),
             "Hidden states to return per row (layer ids; n_layer = the final normed hidden): see tapped.")
        .def_property_readonly("tapped", [](Runner & r) {
                 const Engine & e = *r.engine;
                 const int64_t n_taps = (int64_t)e.taps().size(), E = e.hparams().n_embd;
                 py::array_t<float> out({e.n_tapped_rows(), n_taps, E});
                 std::copy(e.tapped().begin(), e.tapped().end(), out.mutable_data());
                 return out;
             }, "(rows, taps, n_embd) float32: the tapped hidden states of positions tapped_pos ..")
        .def_property_readonly("tapped_pos", [](Runner & r) { return r.engine->tapped_pos(); })
        .def("clear_tapped", [](Runner & r) { r.single().clear_tapped(); })
        .def_property_readonly("has_mtp", [](Runner & r) { return r.engine->weights().mtp.present(); },
                               "Whether the file has an MTP layer (loaded with the model).")
        .def("mtp_reset", [](Runner & r) {
                 if (!r.mtp) r.mtp = std::make_unique<MtpHead>(*r.engine, r.engine->n_ctx());
                 r.mtp->set_n_past(0);
             }, "Start the MTP head's own sequence (mtp_eval) empty.")
        .def("mtp_eval", [](Runner & r, Tokens tokens,
                            py::array_t<float, py::array::c_style | py::array::forcecast> hidden) {
                 const int64_t T = tokens.shape(0), E = r.engine->hparams().n_embd;
                 if (tokens.ndim() != 1 || hidden.ndim() != 2 || hidden.shape(0) != T || hidden.shape(1) != E) {
                     throw std::invalid_argument("mtp_eval: tokens (T,) and hidden (T, n_embd) float32");
                 }
                 if (!r.mtp) r.mtp = std::make_unique<MtpHead>(*r.engine, r.engine->n_ctx());
                 py::array_t<float> logits({T, r.engine->hparams().n_vocab});
                 py::array_t<float> h_out({T, E});
                 const int32_t * ids = tokens.data();
                 const float * h = hidden.data();
                 float * lp = logits.mutable_data();
                 float * hp = h_out.mutable_data();
                 {
                     py::gil_scoped_release release;
                     r.mtp->eval(ids, h, T, LogitsWanted::all, lp, hp);
                 }
                 return py::make_tuple(logits, h_out);
             }, py::arg("tokens"), py::arg("hidden"),
             "MTP head rows (token, hidden of the position before it) appended to its own sequence: "
             "(logits (T, n_vocab), the head's output hidden (T, n_embd)).")
        .def("state_arrays", &state_arrays, "Raw bytes of every conv, DeltaNet and KV state tensor.")
        .def("eval_verify", [](Runner & r, Tokens tokens) {
                 return verify<float>(r, tokens, {tokens.shape(0), r.engine->hparams().n_vocab},
                                      [](Engine & e, const int32_t * ids, int64_t n, float * out) { e.eval_verify(ids, n, out); });
             }, py::arg("tokens"),
             "Append a verify batch (logits of every row); keep(n) then keeps its first n tokens, anything "
             "else all of them.")
        .def("eval_verify_argmax", [](Runner & r, Tokens tokens) {
                 return verify<int32_t>(r, tokens, {tokens.shape(0)}, [](Engine & e, const int32_t * ids, int64_t n, int32_t * out) {
                     e.eval_verify_argmax(ids, n, out);
                 });
             }, py::arg("tokens"), "eval_verify returning the argmax of every row (computed on the device).")
        .def("eval_argmax", [](Runner & r, py::array_t<int32_t, py::array::c_style | py::array::forcecast> tokens) {
                 const int32_t * ids = tokens.data();
                 const int64_t n = tokens.shape(0);
                 Engine & e = r.single();
                 py::gil_scoped_release release;
                 return e.eval_argmax(ids, n);
             }, py::arg("tokens"), "Append tokens; the argmax of the last row's logits (computed on the device).")
        .def("reserve_slots", [](Runner & r, int64_t n) { r.single().ensure_slots(n); }, py::arg("n"),
             "Room for chain verify batches (eval_verify) of n tokens.")
        .def("keep", [](Runner & r, int64_t n) {
                 Engine & e = r.single();
                 py::gil_scoped_release release;  // replays n tokens' recurrence (a launch on CUDA)
                 e.keep(n);
             }, py::arg("n_keep"),
             "After eval_verify, keep only the batch's first n_keep tokens (without re-running the target).")
        .def("cancel", [](Runner & r) { r.cancel = true; }, "Ask a running generate() to stop (thread-safe).")
        .def("clear_cancel", [](Runner & r) { r.cancel = false; },
             "Re-arm before a generate(); cleared by the caller so a cancel that races the start still counts.")
        .def_property_readonly("n_past", [](const Runner & r) { return r.engine->slot_n_past(0); })
        .def_property_readonly("n_seq_max", [](const Runner & r) { return r.engine->n_seq_max(); })
        .def("generate_batch", &generate_batch_py, py::arg("requests"), py::arg("eog_ids"), py::arg("draft") = nullptr,
             py::arg("dflash") = py::none(),
             "Run (prompt, max_tokens, sampling, stop[, constraint[, speculation[, n_logprobs]]]) requests "
             "concurrently to the end; result dicts in order.")
        .def("add_request", [](Runner & r, std::vector<int32_t> prompt, int32_t max_tokens, const SamplingParams & sampling,
                               std::vector<int32_t> eog_ids, std::vector<std::string> stop, py::object constraint,
                               py::object speculation, Runner * draft, py::object dflash, int32_t n_logprobs,
                               bool prompt_logprobs, bool hidden_states) {
                 if (r.pieces.empty()) throw std::runtime_error("set_pieces() must be called before add_request()");
                 if (!r.scheduler) {
                     r.scheduler = std::make_unique<Scheduler>(*r.engine, r.pieces, /*keep_histories=*/true);
                     r.scheduler->set_prefill_budget(r.prefill_budget);
                     r.scheduler->set_prefill_rows(r.prefill_rows);
                 }
                 if (draft && r.scheduler->draft_engine() != draft->engine.get()) {
                     draft->single();
                     set_draft(*r.scheduler, r, draft);
                 }
                 DFlashModel * dm = dflash_of(dflash);
                 if (dm && r.scheduler->dflash_model() != dm) set_dflash(*r.scheduler, r, dm);
                 GenerateRequest req = make_request(std::move(prompt), max_tokens, sampling, std::move(eog_ids), std::move(stop));
                 req.constraint = constraint_of(constraint);
                 req.n_logprobs = n_logprobs;
                 req.prompt_logprobs = prompt_logprobs;
                 req.hidden_states = hidden_states;
                 const int64_t id = r.scheduler->add_request(req, {}, seq_spec_of(speculation));
                 if (!constraint.is_none()) r.constraints[id] = constraint;
                 return id;
             }, py::arg("prompt"), py::arg("max_tokens"), py::arg("sampling"), py::arg("eog_ids"), py::arg("stop"),
             py::arg("constraint") = py::none(), py::arg("speculation") = py::none(), py::arg("draft") = nullptr,
             py::arg("dflash") = py::none(), py::arg("n_logprobs") = -1, py::arg("prompt_logprobs") = false,
             py::arg("hidden_states") = false,
             "Queue a request for step(); returns its id. n_logprobs >= 0: its result has logprobs as generate()'s "
             "(prompt_logprobs: the prompt's too, as prompt_logprobs / prompt_top_ids / prompt_top_logprobs of the "
             "result and of the step that completes the prompt). hidden_states (max_tokens 0): the prompt's final "
             "hidden states, flat in the result's 'hidden'. speculation: None or (draft_n_max, draft_n_min, "
             "ngram_max[, reference token ids[, tree_budget[, draft_model[, dflash[, mtp]]]]]): prompt lookup drafts (trees of up to tree_budget nodes when > 0) (searching the reference text, then the "
             "request's own) verified with the other requests' rows in one pass.")
        .def_property_readonly("batch_spec_stats", [](const Runner & r) {
                 return batch_spec_dict(r.scheduler ? r.scheduler->spec_stats() : r.batch_spec);
             }, "Speculation across sequences (add_request's scheduler, else the last generate_batch): verify "
                "passes, those with drafts of 2+ sequences, those that also accepted and rejected drafts, the most "
                "sequences drafting in one pass.")
        .def_property_readonly("mtp_group_stats", [](const Runner &) {
                 const MtpHead::GroupStats g = MtpHead::group_stats();
                 py::dict d;
                 d["calls"] = g.calls;
                 d["max_heads"] = g.max_heads;
                 return d;
             }, "MTP head graphs over several sequences' heads (in this process): graphs run, the most heads in one.")
        .def_property_readonly("rows_stats", [](const Runner & r) {
                 const auto & s = r.engine->rows_stats();
                 py::dict d;
                 d["calls"] = s.calls;
                 d["multi_slot_calls"] = s.multi_slot_calls;
                 d["rows"] = s.rows;
                 d["padded_rows"] = s.padded_rows;
                 d["max_slots"] = s.max_slots;
                 d["keep_calls"] = s.keep_calls;
                 d["kept_rows"] = s.kept_rows;
                 d["branched_calls"] = s.branched_calls;
                 d["kv_rows_moved"] = s.kv_rows_moved;
                 d["keep_graph_builds"] = s.keep_graph_builds;
                 d["kernel_commits"] = s.kernel_commits;
                 return d;
             }, "What verify_rows (rows of several slots in one verify pass) has run.")
        .def("set_prefill_budget", [](Runner & r, int64_t n) {
                 if (n < 0) throw std::invalid_argument("prefill budget must be >= 0 (0: no limit), got " + std::to_string(n));
                 r.prefill_budget = n;
                 if (r.scheduler) r.scheduler->set_prefill_budget(n);
             }, py::arg("n_tokens"), "Prompt tokens one step() prefills at most (0: no limit).")
        .def("set_prefill_rows", [](Runner & r, bool on) {
                 r.prefill_rows = on;
                 if (r.scheduler) r.scheduler->set_prefill_rows(on);
             }, py::arg("on"),
             "Prompt chunks of several requests evaluated in one pass (on, the default), or each alone in turn.")
        .def_property_readonly("prefill_stats", [](const Runner & r) {
                 const auto & s = r.engine->prefill_stats();
                 py::dict d;
                 d["passes"] = s.passes;
                 d["multi_slot_passes"] = s.multi_slot_passes;
                 d["rows"] = s.rows;
                 d["max_slots"] = s.max_slots;
                 return d;
             }, "What prefill_rows (prompt chunks of several slots in one pass) has run.")
        .def("step", &step_py, "One scheduler step: a list of {id, tokens, finished, result (dict or None)}.")
        .def("eval_in_slot", [](Runner & r, int64_t slot, Tokens tokens, const std::string & logits) {
                 Engine & e = r.single();
                 e.use_slot(slot);
                 try {
                     py::array_t<float> out = eval(e, tokens, logits);
                     e.use_slot(0);
                     return out;
                 } catch (...) {
                     e.use_slot(0);
                     throw;
                 }
             }, py::arg("slot"), py::arg("tokens"), py::arg("logits") = "last",
             "eval() on sequence slot `slot` (reset_slot starts it empty).")
        .def("reset_slot", [](Runner & r, int64_t slot) {
                 Engine & e = r.single();
                 e.use_slot(slot);
                 e.reset();
                 e.use_slot(0);
             }, py::arg("slot"))
        .def("slot_n_past", [](Runner & r, int64_t slot) { return r.engine->slot_n_past(slot); }, py::arg("slot"))
        .def("decode_slots", [](Runner & r, Tokens tokens) {
                 Engine & e = r.single();
                 RowBatch rows;
                 for (py::ssize_t i = 0; i < tokens.shape(0); ++i) {
                     rows.add(tokens.at(i), (int32_t)e.slot_n_past(i), (int32_t)i);
                 }
                 py::array_t<float> out({(int64_t)rows.size(), e.hparams().n_vocab});
                 float * dst = out.mutable_data();
                 py::gil_scoped_release release;
                 e.decode(rows, LogitsWanted::all, dst);
                 return out;
             }, py::arg("tokens"),
             "One row per slot 0 .. len(tokens)-1, each appending its token to its slot, in one batch: "
             "logits (len(tokens), n_vocab).")
        .def("prefill_slots", [](Runner & r, std::vector<std::vector<int32_t>> chunks) {
                 Engine & e = r.single();
                 RowBatch rows;
                 for (size_t i = 0; i < chunks.size(); ++i) {
                     const int32_t p0 = (int32_t)e.slot_n_past((int64_t)i);
                     for (size_t j = 0; j < chunks[i].size(); ++j) {
                         rows.add(chunks[i][j], p0 + (int32_t)j, (int32_t)i, j == 0 ? -1 : (int32_t)rows.size() - 1);
                     }
                 }
                 py::array_t<float> out({(int64_t)chunks.size(), e.hparams().n_vocab});
                 float * dst = out.mutable_data();
                 py::gil_scoped_release release;
                 e.prefill_rows(rows, LogitsWanted::all, dst);
                 return out;
             }, py::arg("chunks"),
             "Prompt chunks of equal length appended to slots 0 .. len(chunks)-1 in one pass (Engine::prefill_rows): "
             "each slot's last row's logits (len(chunks), n_vocab).")
        .def_property_readonly("decode_stats", [](const Runner & r) {
                 const auto & s = r.engine->decode_stats();
                 py::dict d;
                 d["calls"] = s.calls;
                 d["rows"] = s.rows;
                 d["max_rows"] = s.max_rows;
                 d["top_rows"] = s.top_rows;
                 d["masked_rows"] = s.masked_rows;
                 return d;
             }, "What batched decoding has run: calls, rows in all, the most rows of one call; rows that "
                "returned their top candidates instead of whole logits (top_rows); rows whose argmax or top "
                "candidates a grammar's mask limited on the device (masked_rows).")
        .def_property_readonly("graph_stats", [](const Runner & r) {
                 const auto s = r.engine->graph_stats();
                 py::dict d;
                 d["builds"] = s.builds;
                 d["reuses"] = s.reuses;
                 d["switches"] = s.switches;
                 d["evictions"] = s.evictions;
                 d["kept"] = s.kept;
                 d["kept_bytes"] = s.kept_bytes;
                 d["max_graphs"] = s.max_graphs;
                 d["max_kept_bytes"] = s.max_kept_bytes;
                 d["build_seconds"] = s.build_seconds;
                 d["alloc_seconds"] = s.alloc_seconds;
                 return d;
             }, "The target's step graphs: built and allocated (builds, and the host seconds they took) vs "
                "steps that ran a kept graph (reuses; switches: those whose graph was not the previous "
                "step's); kept graphs evicted; graphs kept now and their compute buffers' bytes; the limits "
                "(graphs; bytes of the graphs kept besides the last step's).")
        .def_property("top_rows_enabled", [](const Runner & r) { return r.engine->top_rows_enabled(); },
                      [](Runner & r, bool on) { r.engine->enable_top_rows(on); },
                      "Whether sequences whose sampler allows it take their rows' top candidates from the "
                      "device instead of whole logits rows (on; off compares both ways).")
        .def_property("device_masks_enabled", [](const Runner & r) { return r.engine->device_masks_enabled(); },
                      [](Runner & r, bool on) { r.engine->enable_device_masks(on); },
                      "Whether a grammar's masked rows (plain decoding, no logprobs) take their argmax or top "
                      "candidates from the device, the mask applied there (on), or cross over whole to be masked "
                      "on the host (off compares both ways).")
        .def("verify_tree", [](Runner & r, Tokens tokens, Tokens parents, bool argmax) {
                 Engine & e = r.single();
                 const int64_t T = tokens.shape(0);
                 if (parents.ndim() != 1 || parents.shape(0) != T) {
                     throw std::invalid_argument("verify_tree: parents must be one entry per token");
                 }
                 const RowBatch rows = tree_rows(tokens, parents, [&](int64_t) { return (int32_t)e.current_slot(); },
                                                 [&](int32_t) { return e.n_past(); });
                 py::array out = argmax ? py::array(py::array_t<int32_t>({T}))
                                        : py::array(py::array_t<float>({T, e.hparams().n_vocab}));
                 void * dst = out.mutable_data();
                 py::gil_scoped_release release;
                 e.verify_tree(rows, argmax ? LogitsWanted::argmax_all : LogitsWanted::all, dst);
                 return out;
             }, py::arg("tokens"), py::arg("parents"), py::arg("argmax") = false,
             "Verify a tree of tokens (parents[i] = an earlier row, or -1 to continue the committed sequence; "
             "position = length + depth): logits (T, n_vocab), or the argmax (T,), of every row, nothing "
             "committed until keep_path().")
        .def("keep_path", [](Runner & r, Tokens path) {
                 Engine & e = r.single();
                 const int32_t * p = path.data();
                 const int64_t n = path.shape(0);
                 py::gil_scoped_release release;
                 e.keep_path(p, n);
             }, py::arg("path"),
             "After verify_tree, keep one root-to-leaf path of rows (KV rows compacted, recurrent state after "
             "the leaf committed; the target is not re-run).")
        .def("verify_rows", [](Runner & r, Tokens tokens, Tokens parents, Tokens slots) {
                 Engine & e = r.single();
                 const int64_t R = tokens.shape(0);
                 if (parents.ndim() != 1 || parents.shape(0) != R || slots.ndim() != 1 || slots.shape(0) != R) {
                     throw std::invalid_argument("verify_rows: parents and slots must be one entry per token");
                 }
                 const RowBatch rows = tree_rows(tokens, parents, [&](int64_t i) { return slots.at(i); },
                                                 [&](int32_t s) {  // a bad slot: verify_rows names it
                                                     return s >= 0 && s < e.n_seq_max() ? e.slot_n_past(s) : int64_t(0);
                                                 });
                 py::array_t<float> out({R, e.hparams().n_vocab});
                 float * dst = out.mutable_data();
                 py::gil_scoped_release release;
                 e.verify_rows(rows, LogitsWanted::all, dst);
                 return out;
             }, py::arg("tokens"), py::arg("parents"), py::arg("slots"),
             "Verify rows of several slots in one pass (grouped by slot, slots consecutive; parents[i] = an "
             "earlier row of the same slot, or -1; position = the slot's length + depth): every row's logits, "
             "nothing committed until keep_paths().")
        .def("keep_paths", [](Runner & r, const std::vector<std::vector<int32_t>> & paths) {
                 py::gil_scoped_release release;
                 r.single().keep_paths(paths);
             }, py::arg("paths"),
             "After verify_rows, keep one root-to-leaf path of rows per verified slot (row indices; empty: "
             "the slot keeps nothing).")
        .def("capture_nodes", [](Runner & r, bool on) { r.engine->set_node_capture(on); }, py::arg("on"),
             "Debugging: copy every contiguous F32 node of each step graph to the host as it is computed "
             "(slow: node by node); captured_nodes() then gives the last graph's.")
        .def("captured_nodes", [](const Runner & r) {
                 py::list out;
                 for (const auto & n : r.engine->captured_nodes()) {
                     py::array_t<float> data(std::vector<py::ssize_t>{n.ne[3], n.ne[2], n.ne[1], n.ne[0]});
                     std::memcpy(data.mutable_data(), n.data.data(), n.data.size() * sizeof(float));
                     out.append(py::make_tuple(n.op, n.source, data));
                 }
                 return out;
             },
             "The last step graph's captured nodes, in graph order: (op, its first source's name or op, array in "
             "numpy order).")
        .def_property_readonly("tree_stats", [](const Runner & r) {
                 const auto & s = r.engine->tree_stats();
                 py::dict d;
                 d["verify_calls"] = s.verify_calls;
                 d["rows"] = s.rows;
                 d["max_rows"] = s.max_rows;
                 d["branched_calls"] = s.branched_calls;
                 d["rows_op_nodes"] = s.rows_op_nodes;
                 d["split_walks"] = s.split_walks;
                 d["keep_calls"] = s.keep_calls;
                 d["kept_rows"] = s.kept_rows;
                 d["kv_rows_moved"] = s.kv_rows_moved;
                 d["keep_graph_builds"] = s.keep_graph_builds;
                 d["kernel_commits"] = s.kernel_commits;
                 return d;
             }, "What tree verification has run: verify calls, rows, the most rows of one call, calls with "
                "a branch, rows-op graph nodes run, keep_path calls, rows kept, KV rows moved, keep_path "
                "calls that built their commit graph, keep_path calls whose recurrent states our CUDA kernels "
                "committed.")
        .def("cancel_request", [](Runner & r, int64_t id) {
                 if (r.scheduler) r.scheduler->cancel(id);
             }, py::arg("id"), "Cancel a request added with add_request (finishes at the next step).")
        .def_property_readonly("n_requests", [](const Runner & r) {
                 return r.scheduler ? r.scheduler->n_running() + r.scheduler->n_waiting() : 0;
             }, "Requests added with add_request() that have not finished.")
        .def_property_readonly("n_ctx", [](const Runner & r) { return r.engine->n_ctx(); })
        .def_property_readonly("backend", [](const Runner & r) { return r.engine->backend_name(); })
        .def_property_readonly("state_info", [](const Runner & r) {
                 py::list out;
                 for (const StateTensorInfo & t : r.engine->state_info()) {
                     py::dict d;
                     d["kind"] = t.kind;
                     d["layer"] = t.layer;
                     d["slot"] = t.slot;
                     d["type"] = t.kv_format >= DELTASPEC_KV_TQ3 ? "tq" + std::to_string(t.kv_format)
                                 : std::string(ggml_type_name(t.type)) + (t.kv_format == DELTASPEC_KV_ROTATED ? "+rot" : "");
                     d["nbytes"] = t.nbytes;
                     d["shape"] = py::make_tuple(t.ne0, t.ne1);
                     d["buffer"] = t.buffer;
                     out.append(d);
                 }
                 return out;
             },
             "The state's tensors as allocated, one dict each: kind ('k', 'v', 'conv', 'ssm'), layer, type (ggml's name), nbytes, shape (ne0, ne1), buffer.")
        .def_property_readonly("device_layers", [](const Runner & r) {
                 py::list out;
                 for (const DeviceLayers & d : r.engine->device_layers()) {
                     py::dict e;
                     e["device"] = d.device;
                     e["backend"] = d.backend;
                     e["layers"] = d.layers;
                     e["input"] = d.input;
                     e["output"] = d.output;
                     e["weight_bytes"] = d.weight_bytes;
                     e["kv_bytes"] = d.kv_bytes;
                     e["state_bytes"] = d.state_bytes;
                     out.append(e);
                 }
                 return out;
             },
             "What each device holds (layer_split.h DeviceLayers): device, backend, layers, input, output, "
             "weight_bytes, kv_bytes, state_bytes; one entry on one device.")
        .def_property_readonly("tensor_split", [](const Runner & r) { return r.engine->layer_split().tensor_split; },
                               "The shares a layer split used (empty on one device).")
        .def_property_readonly("weight_buffer_types", [](const Runner & r) { return r.engine->weight_buffer_types(); },
                               "Names of the ggml buffer types the weights live in (plain 'CPU' on a CPU engine).")
        .def_property_readonly("weight_stacks", [](const Runner & r) { return r.engine->weight_stacks(); },
                               "Weights stored as one stack (a one-token step multiplies each stack once): "
                               "their names, per stack, in row order.");

    bind_dflash(m, [](py::handle target) -> Engine & { return *target.cast<Runner &>().engine; });
}
