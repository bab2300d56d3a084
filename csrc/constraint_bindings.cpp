#include "constraint_bindings.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "drafters.h"
#include "token_constraint.h"

namespace py = pybind11;

namespace deltaspec {

namespace {

// Forwards the virtual calls of the decode loops (which run without the GIL) to the Python
// subclass's methods, taking the GIL for each.
class PyTokenConstraint : public TokenConstraint {
  public:
    void fill_masks(uint32_t * masks, int64_t n_words, const std::vector<int32_t> & drafts) override {
        py::gil_scoped_acquire gil;
        const py::function f = method("fill_masks");
        // a view of the loop's buffer, no copy: the Python side writes the bits in place
        const int64_t rows = (int64_t)drafts.size() + 1;
        py::array_t<uint32_t> view({rows, n_words}, masks, py::capsule(masks, [](void *) {}));
        f(view, drafts);
    }
    void fill_mask_after(uint32_t * mask, int64_t n_words, const std::vector<int32_t> & path) override {
        {
            py::gil_scoped_acquire gil;
            const py::function f = py::get_override(static_cast<const TokenConstraint *>(this), "fill_mask_after");
            if (f) {
                py::array_t<uint32_t> view({n_words}, mask, py::capsule(mask, [](void *) {}));
                f(view, path);
                return;
            }
        }
        TokenConstraint::fill_mask_after(mask, n_words, path);  // through fill_masks, which takes the GIL itself
    }
    void commit(int32_t token) override {
        py::gil_scoped_acquire gil;
        method("commit")(token);
    }
    int64_t check_draft(const std::vector<int32_t> & tokens) override {
        py::gil_scoped_acquire gil;
        const int64_t n = method("check_draft")(tokens).cast<int64_t>();
        if (n < 0 || n > (int64_t)tokens.size()) {
            throw std::out_of_range("TokenConstraint.check_draft returned " + std::to_string(n) + " for " +
                                    std::to_string(tokens.size()) + " tokens");
        }
        return n;
    }

    std::vector<int32_t> forced_tokens() override {
        py::gil_scoped_acquire gil;
        const py::function f = py::get_override(static_cast<const TokenConstraint *>(this), "forced_tokens");
        return f ? f().cast<std::vector<int32_t>>() : std::vector<int32_t>{};
    }
    bool allows_every_token(const std::vector<int32_t> & along) override {
        py::gil_scoped_acquire gil;
        const py::function f = py::get_override(static_cast<const TokenConstraint *>(this), "allows_every_token");
        return f ? f(along).cast<bool>() : false;
    }

  private:
    py::function method(const char * name) const {
        py::function f = py::get_override(static_cast<const TokenConstraint *>(this), name);
        if (!f) throw std::runtime_error(std::string("TokenConstraint subclass must implement ") + name + "()");
        return f;
    }
};

using F32 = py::array_t<float, py::array::c_style>;

DraftTree tree_of(const std::vector<int32_t> & tokens, const std::vector<int32_t> & parents, bool sampled) {
    if (parents.size() != tokens.size()) throw std::invalid_argument("tokens and parents must have one entry per node");
    DraftTree t;
    if (sampled) {  // one q shared by every node's children: only whether they were drawn matters here
        t.dists.emplace_back();
        t.root_child_q = 0;
    }
    for (size_t i = 0; i < tokens.size(); ++i) t.add(tokens[i], parents[i], sampled ? 0 : -1);
    return t;
}

}  // namespace

void bind_token_constraint(py::module_ & m) {
    py::class_<TokenConstraint, PyTokenConstraint>(m, "TokenConstraint",
        "Base class of a rule on which tokens may come next (a grammar), for generate(constraint=...). "
        "Subclasses implement fill_masks(masks, drafts), commit(token), check_draft(tokens) -> int and "
        "optionally forced_tokens() -> list, allows_every_token(along) -> bool and fill_mask_after(mask, path) "
        "(one row of fill_masks after the drafted `path`, for a draft model drafting within the rule); "
        "the decode loops call them without holding the GIL otherwise.")
        .def(py::init<>())
        .def("allows_every_token", &TokenConstraint::allows_every_token, py::arg("along") = std::vector<int32_t>{},
             "Whether every token is allowed at every row after the committed tokens and a prefix of any path "
             "through `along` (drafts; a tree's nodes as a set) (the base class: False, unsure); a subclass "
             "that knows may say True, and those rows then skip the mask.")
        .def_readonly("n_masked_rows", &TokenConstraint::n_masked_rows, "Logit rows masked so far.")
        .def_readonly("n_cut_tokens", &TokenConstraint::n_cut_tokens,
                      "Draft tokens cut before verification so far (speculative decoding).")
        .def_readonly("n_forced_tokens", &TokenConstraint::n_forced_tokens,
                      "Tokens the grammar forced, proposed as drafts so far (speculative decoding).")
        .def_readonly("n_draft_rows", &TokenConstraint::n_draft_rows,
                      "A draft model's logit rows masked so far (it drafts within the rule).")
        .def("mask_draft_row", [](TokenConstraint & c, std::vector<int32_t> path, F32 logits) {
                 if (logits.ndim() != 1) throw std::invalid_argument("logits must be 1-D (n_vocab,)");
                 return c.mask_draft_row(path, logits.mutable_data(), logits.shape(0));
             }, py::arg("path"), py::arg("logits"),
             "Mask a draft model's float32 logit row in place with the rule's state after the committed tokens "
             "and `path`; False when the rule allows nothing there.")
        // the loops' own helpers on numpy arrays, for tests of the masking and cutting rules alone
        .def("mask_row", [](TokenConstraint & c, F32 logits) {
                 if (logits.ndim() != 1) throw std::invalid_argument("logits must be 1-D (n_vocab,)");
                 c.mask_row(logits.mutable_data(), logits.shape(0));
             }, py::arg("logits"), "Mask a float32 logit row in place (forbidden tokens -> -inf).")
        .def("mask_verify_rows", [](TokenConstraint & c, std::vector<int32_t> drafts, F32 rows) {
                 if (rows.ndim() != 2 || rows.shape(0) != (py::ssize_t)drafts.size() + 1) {
                     throw std::invalid_argument("rows must be float32 (len(drafts) + 1, n_vocab)");
                 }
                 Draft d;
                 d.tokens = std::move(drafts);
                 c.mask_verify_rows(d, rows.mutable_data(), rows.shape(1));
             }, py::arg("drafts"), py::arg("rows"),
             "Mask verify rows in place: row i with the rule's state after drafts[:i].")
        .def("cut_draft", [](TokenConstraint & c, std::vector<int32_t> drafts, bool sampled) {
                 Draft d;
                 d.tokens = std::move(drafts);
                 if (sampled) d.dists.resize(d.tokens.size());
                 c.cut_draft(d);
                 return d.tokens;
             }, py::arg("drafts"), py::arg("sampled") = false,
             "The draft as verification gets it (sampled: drawn from a distribution q, not deterministic).")
        .def("prune_tree", [](TokenConstraint & c, std::vector<int32_t> tokens, std::vector<int32_t> parents, bool sampled) {
                 DraftTree t = tree_of(tokens, parents, sampled);
                 c.prune_tree(t);
                 return py::make_tuple(t.token, t.parent);
             }, py::arg("tokens"), py::arg("parents"), py::arg("sampled") = false,
             "A draft tree (node i: tokens[i], parent node parents[i] or -1) as verification gets it: "
             "(tokens, parents). sampled: every node's children drawn from a distribution q.")
        .def("mask_tree_rows", [](TokenConstraint & c, std::vector<int32_t> tokens, std::vector<int32_t> parents, F32 rows) {
                 if (rows.ndim() != 2 || rows.shape(0) != (py::ssize_t)tokens.size() + 1) {
                     throw std::invalid_argument("rows must be float32 (len(tokens) + 1, n_vocab)");
                 }
                 c.mask_tree_rows(tree_of(tokens, parents, false), rows.mutable_data(), rows.shape(1));
             }, py::arg("tokens"), py::arg("parents"), py::arg("rows"),
             "Mask a tree's verify rows in place: row 0 with the rule's state now, row 1 + i with its state "
             "after node i's path.");
}

}  // namespace deltaspec
