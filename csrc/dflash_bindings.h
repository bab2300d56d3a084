// Python bindings of the DFlash drafter (deltaspec._core.DFlash); registered by bindings.cpp, which
// says how to reach a target Engine from its Python object.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>

#include "engine.h"

namespace deltaspec {

void bind_dflash(pybind11::module_ & m, std::function<Engine &(pybind11::handle)> engine_of);

}  // namespace deltaspec
