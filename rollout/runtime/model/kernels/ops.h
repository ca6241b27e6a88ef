// The kernels' entry points, for the ops that call them directly (decoder_layer.cpp) rather than through torch's
// dispatcher.
#pragma once
#include <ATen/ATen.h>

namespace rlspec_kernels {

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& blocks, const at::Tensor& mask, double scale);

}  // namespace rlspec_kernels
