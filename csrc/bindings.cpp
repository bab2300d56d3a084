// pybind11 surface of the engine: `deltaspec._core`. The GIL is released for every call that computes.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "engine.h"
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

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "deltaspec native engine (ggml)";
    m.attr("ggml_version") = ggml_version();
    m.attr("ggml_commit") = ggml_commit();

    py::class_<HParams>(m, "HParams")
        .def(py::init<>())
        .def_readwrite("n_vocab", &HParams::n_vocab)
        .def_readwrite("n_embd", &HParams::n_embd)
        .def_readwrite("n_layer", &HParams::n_layer)
        .def_readwrite("n_ctx_train", &HParams::n_ctx_train)
        .def_readwrite("rms_eps", &HParams::rms_eps)
        .def_readwrite("n_head", &HParams::n_head)
        .def_readwrite("n_head_kv", &HParams::n_head_kv)
        .def_readwrite("head_dim", &HParams::head_dim)
        .def_readwrite("n_rot", &HParams::n_rot)
        .def_readwrite("rope_freq_base", &HParams::rope_freq_base)
        .def_readwrite("rope_sections", &HParams::rope_sections)
        .def_readwrite("ssm_conv_kernel", &HParams::ssm_conv_kernel)
        .def_readwrite("ssm_state_size", &HParams::ssm_state_size)
        .def_readwrite("ssm_n_k_heads", &HParams::ssm_n_k_heads)
        .def_readwrite("ssm_n_v_heads", &HParams::ssm_n_v_heads)
        .def_readwrite("recurrent", &HParams::recurrent);

    py::class_<Engine>(m, "Engine")
        .def(py::init([](const std::string & path, const HParams & hp, int64_t n_ctx, int64_t n_ubatch, int n_threads,
                         const std::string & device, const std::string & type_k, const std::string & type_v) {
                 EngineOptions o;
                 o.n_ctx = n_ctx;
                 o.n_ubatch = n_ubatch;
                 o.n_threads = n_threads;
                 o.device = device;
                 o.type_k = type_k;
                 o.type_v = type_v;
                 py::gil_scoped_release release;
                 return new Engine(path, hp, o);
             }),
             py::arg("path"), py::arg("hparams"), py::arg("n_ctx"), py::arg("n_ubatch"), py::arg("n_threads"),
             py::arg("device"), py::arg("type_k"), py::arg("type_v"))
        .def("eval", &eval, py::arg("tokens"), py::arg("logits") = "last",
             "Append tokens to the sequence; returns float32 logits of shape (rows, n_vocab).")
        .def("reset", &Engine::reset, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("n_past", &Engine::n_past)
        .def_property_readonly("n_ctx", &Engine::n_ctx)
        .def_property_readonly("backend", &Engine::backend_name);
}
