// Test-only Python bindings of the draft-tree builders (draft_tree.h, the n-gram drafter's tree)
// and the tree walks (tree_walk.h). Registered on deltaspec._core by bindings.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace deltaspec {

void bind_trees(pybind11::module_ & m);

}  // namespace deltaspec
