// Test-only Python bindings of single ggml ops: the rows ops (ggml/deltaspec_rows.h) and the ggml ops
// they must agree with. Registered on deltaspec._core by bindings.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace deltaspec {

void bind_rows_ops(pybind11::module_ & m);

}  // namespace deltaspec
