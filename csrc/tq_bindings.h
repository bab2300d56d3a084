// Test-only Python bindings of the tq KV cache types (ggml/deltaspec_tq.h): the host codec and the
// two graph nodes on numpy arrays. Registered on deltaspec._core by bindings.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace deltaspec {

void bind_tq(pybind11::module_ & m);

}  // namespace deltaspec
