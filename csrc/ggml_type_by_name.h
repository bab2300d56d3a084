// A ggml type from its name as ggml_type_name gives it ("q4_K", "f16"), for the test-only bindings
// that take types as strings.
#pragma once

#include <string>

#include "ggml.h"

namespace deltaspec {

// GGML_TYPE_COUNT when no type has that name.
inline ggml_type ggml_type_by_name(const std::string & name) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * type_name = ggml_get_type_traits((ggml_type)t)->type_name;
        if (type_name != nullptr && name == type_name) return (ggml_type)t;
    }
    return GGML_TYPE_COUNT;
}

}  // namespace deltaspec
