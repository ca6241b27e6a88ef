// The kernels' entry points, for the ops that call them directly (decoder_layer.cpp, draft_chain.cpp) rather than
// through torch's dispatcher.
#pragma once
#include <ATen/ATen.h>

namespace rlspec_kernels {

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& blocks, const at::Tensor& mask, double scale);
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool,
                         at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& blocks, const at::Tensor& mask,
                         const at::Tensor& norm1, const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias,
                         const at::Tensor& o, const c10::optional<at::Tensor>& o_bias, const at::Tensor& norm2,
                         const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_bias,
                         const at::Tensor& down, const c10::optional<at::Tensor>& down_bias, int64_t heads,
                         int64_t kv_heads, int64_t inter, double eps, double scale,
                         const c10::optional<at::Tensor>& embeds, const c10::optional<at::Tensor>& embed_norm);
at::Tensor final_head(const at::Tensor& x, const at::Tensor& norm, const at::Tensor& lm_head, int64_t vocab,
                      double eps);

// A row's softmax(x / temperature), unnormalised (sample.cpp): e = exp(x / T - max) and each block of kDrawLanes
// tokens' sum in block (e: the row's length rounded up to kDrawLanes floats; block: one float per kDrawLanes
// tokens); -> the max, the total of e, and whether every logit is finite (if not, nothing else is meaningful).
constexpr int64_t kDrawLanes = 16;
struct Softmax {
  float max;
  float total;
  bool finite;
};
Softmax softmax_row(const float* x, int64_t V, float temperature, float* e, float* block);
// The first token whose cumulative mass of e (block sums in block) reaches target, never one of mass 0.
int64_t search_row(const float* e, const float* block, int64_t V, float target);
// One row's draw from softmax(x / temperature) at u in (0, 1]: the token, its logprob, the finite flag and the total
// of e, which holds exp(x / T - max) on return.
struct Draw {
  int64_t token;
  float logprob;
  bool finite;
  float total;
};
Draw draw_row(const float* x, int64_t V, float u, float temperature, float* e, float* block);

}  // namespace rlspec_kernels
