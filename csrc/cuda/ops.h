// CUDA twins of csrc/cpu/ops.h, same contracts; compiled only when torch has CUDA.
#pragma once

#include <ATen/ATen.h>

namespace pyserve::cuda {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping);

}  // namespace pyserve::cuda
