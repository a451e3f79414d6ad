// commsched._torch_hooks.copy_tensors_bypassing_cache: a checkpoint capture's host copies.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace commsched {

// Adds copy_tensors_bypassing_cache to `module`.
void register_capture_copies(pybind11::module_& module);

}  // namespace commsched
