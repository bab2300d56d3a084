// Python side of TokenConstraint (token_constraint.h): `deltaspec._core.TokenConstraint`, a base
// class that Python subclasses (deltaspec.constraint.GrammarConstraint) to constrain generate().
// Registered on deltaspec._core by bindings.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace deltaspec {

void bind_token_constraint(pybind11::module_ & m);

}  // namespace deltaspec
