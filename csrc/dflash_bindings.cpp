#include "dflash_bindings.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <memory>

#include "dflash_drafter.h"
#include "token_constraint.h"

namespace py = pybind11;

namespace deltaspec {

namespace {

// A TokenConstraint argument (deltaspec.constraint.GrammarConstraint etc.; the caller keeps it
// alive) or None.
TokenConstraint * constraint_arg(const py::object & constraint) {
    return constraint.is_none() ? nullptr : constraint.cast<TokenConstraint *>();
}

// The target reads ids but the last (a fresh sequence), the drafter the features it tapped: what
// a speculative loop holds before drafting after ids.
// Runs `use` on a drafter of the target's slot 0 that has read ids but the last (the anchor), the
// target's taps set to the drafter's layers meanwhile (then cleared: plain steps need none).
template <class Use>
void draft_after(DFlashModel & d, const SamplingParams & sampling, TokenConstraint * rule,
                 const std::vector<int32_t> & ids, Use use) {
    if (ids.empty()) throw std::invalid_argument("ids must hold at least the anchor token");
    Engine & t = d.target();
    t.use_slot(0);
    t.set_taps(dflash_taps(d.hparams()));
    try {
        DFlashDrafter drafter(d, t, 1.0, sampling, /*slot =*/0);
        drafter.constrain(rule);
        t.reset();
        const std::vector<int32_t> prompt(ids.begin(), ids.end() - 1);
        if (!prompt.empty()) t.eval(prompt.data(), (int64_t)prompt.size(), LogitsWanted::none, nullptr);
        drafter.begin(prompt);
        use(drafter);
    } catch (...) {
        t.set_taps({});
        throw;
    }
    t.set_taps({});
}

}  // namespace

void bind_dflash(py::module_ & m, std::function<Engine &(py::handle)> engine_of) {
    py::class_<DFlashHParams>(m, "DFlashHParams")
        .def(py::init<>())
        .def_readwrite("n_embd", &DFlashHParams::n_embd)
        .def_readwrite("n_layer", &DFlashHParams::n_layer)
        .def_readwrite("n_head", &DFlashHParams::n_head)
        .def_readwrite("n_head_kv", &DFlashHParams::n_head_kv)
        .def_readwrite("head_dim", &DFlashHParams::head_dim)
        .def_readwrite("n_ff", &DFlashHParams::n_ff)
        .def_readwrite("n_rot", &DFlashHParams::n_rot)
        .def_readwrite("rope_freq_base", &DFlashHParams::rope_freq_base)
        .def_readwrite("rms_eps", &DFlashHParams::rms_eps)
        .def_readwrite("block_size", &DFlashHParams::block_size)
        .def_readwrite("mask_token", &DFlashHParams::mask_token)
        .def_readwrite("causal", &DFlashHParams::causal)
        .def_readwrite("target_layers", &DFlashHParams::target_layers);

    using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;
    py::class_<DFlashModel>(m, "DFlash")
        .def(py::init([engine_of](const std::string & path, const DFlashHParams & hp, py::object target, int64_t n_ctx,
                                  int64_t n_slots) {
                 Engine & e = engine_of(target);
                 py::gil_scoped_release release;
                 return std::make_unique<DFlashModel>(path, hp, e, n_ctx, n_slots);
             }),
             py::arg("path"), py::arg("hparams"), py::arg("target"), py::arg("n_ctx"), py::arg("n_slots") = 1,
             py::keep_alive<1, 4>(),  // the target's weights and device serve the drafter
             "A DFlash drafter on the target engine's device, borrowing its embedding and LM head; its "
             "context in n_slots sequence slots (the methods here use slot 0, generate()'s; the others are "
             "generate_batch's and add_request's sequences', allocated when first used).")
        .def("inject", [](DFlashModel & d, F32 features, int64_t pos0) {
                 if (features.ndim() != 2 || features.shape(1) != d.n_feat()) {
                     throw std::invalid_argument("features must have shape (rows, " + std::to_string(d.n_feat()) + ")");
                 }
                 const float * p = features.data();
                 const int64_t n = features.shape(0);
                 py::gil_scoped_release release;
                 d.use_slot(0);
                 d.inject(p, n, pos0);
             }, py::arg("features"), py::arg("pos0"),
             "Target features (rows, len(target_layers) * n_embd) of positions pos0.. become context rows.")
        .def("block_logits", [](DFlashModel & d, int32_t anchor) {
                 py::array_t<float> out({d.hparams().block_size - 1, d.n_vocab()});
                 float * p = out.mutable_data();
                 {
                     py::gil_scoped_release release;
                     DFlashModel::BlockJob job;  // slot 0: generate()'s
                     job.anchor = anchor;
                     job.logits = p;
                     d.blocks({job});
                 }
                 return out;
             }, py::arg("anchor"), "Logits (block_size - 1, n_vocab) of the block [anchor, mask...] after the context.")
        .def("block_top1", [](DFlashModel & d, int32_t anchor) {
                 std::vector<int32_t> out(d.hparams().block_size - 1);
                 {
                     py::gil_scoped_release release;
                     DFlashModel::BlockJob job;
                     job.anchor = anchor;
                     job.top1 = out.data();
                     d.blocks({job});
                 }
                 return out;
             }, py::arg("anchor"), "The argmax of every predicted slot (computed on the device).")
        .def("read_context", [](DFlashModel & d, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids) {
                 const int32_t * p = ids.data();
                 const int64_t n = ids.shape(0);
                 py::gil_scoped_release release;
                 Engine & t = d.target();
                 d.use_slot(0);
                 t.reset();
                 t.set_taps(dflash_taps(d.hparams()));
                 try {
                     if (n > 0) t.eval(p, n, LogitsWanted::none, nullptr);
                     d.truncate(0);
                     d.inject(t.tapped().data(), t.n_tapped_rows(), t.tapped_pos());
                 } catch (...) {
                     t.set_taps({});
                     throw;
                 }
                 t.set_taps({});
             }, py::arg("ids"),
             "The target reads ids (a fresh sequence) and its tapped features become the whole context.")
        .def("tree", [](DFlashModel & d, std::vector<int32_t> ids, int64_t budget, int64_t max_depth, float temperature,
                        uint64_t seed, py::object constraint) {
                 TokenConstraint * rule = constraint_arg(constraint);
                 DraftTree tree;
                 {
                     py::gil_scoped_release release;
                     SamplingParams sp;
                     sp.temperature = temperature;
                     sp.seed = seed;
                     draft_after(d, sp, rule, ids, [&](DFlashDrafter & drafter) {
                         tree = drafter.propose_tree(ids, budget, max_depth);
                     });
                 }
                 py::dict out;
                 out["token"] = tree.token;
                 out["parent"] = tree.parent;
                 out["depth"] = tree.depth;
                 out["child_q"] = tree.child_q;
                 out["root_child_q"] = tree.root_child_q;
                 py::list dists;
                 for (const Distribution & q : tree.dists) dists.append(py::make_tuple(q.ids, q.probs));
                 out["dists"] = dists;
                 return out;
             }, py::arg("ids"), py::arg("budget"), py::arg("max_depth"), py::arg("temperature") = 0.0f,
             py::arg("seed") = 0, py::arg("constraint") = py::none(),
             "The DDTree tree the speculative loop would verify after ids (the target reads all but the "
             "last, the anchor): DFlashDrafter::propose_tree, greedy (temperature <= 0) or sampled, within "
             "a TokenConstraint (its state: after ids) or not.")
        .def("chain", [](DFlashModel & d, std::vector<int32_t> ids, int64_t n_max, py::object constraint) {
                 TokenConstraint * rule = constraint_arg(constraint);
                 Draft draft;
                 {
                     py::gil_scoped_release release;
                     draft_after(d, SamplingParams{}, rule, ids, [&](DFlashDrafter & drafter) {
                         draft = drafter.propose(ids, n_max);
                     });
                 }
                 return draft.tokens;
             }, py::arg("ids"), py::arg("n_max"), py::arg("constraint") = py::none(),
             "The chain the speculative loop would verify after ids (the target reads all but the last, "
             "the anchor): DFlashDrafter::propose, within a TokenConstraint (its state: after ids) or not.")
        .def("truncate", [](DFlashModel & d, int64_t n) {
                 d.use_slot(0);
                 d.truncate(n);
             }, py::arg("n"), "Forget context rows at positions >= n.")
        .def_property_readonly("n_cached", [](const DFlashModel & d) { return d.n_cached_of(0); })
        .def_property_readonly("n_slots", &DFlashModel::n_slots)
        .def_property_readonly("block_stats", [](const DFlashModel & d) {
                 py::dict out;
                 out["passes"] = d.block_stats().passes;
                 out["blocks"] = d.block_stats().blocks;
                 out["max_blocks"] = d.block_stats().max_blocks;
                 return out;
             }, "Block passes run, blocks in them, the most blocks in one pass (several sequences' blocks share a pass).")
        .def_property_readonly("n_feat", &DFlashModel::n_feat)
        .def_property_readonly("weight_bytes", &DFlashModel::weight_bytes);
}

}  // namespace deltaspec
