// The kernels' entry points, for the ops that call them directly (decoder_layer.cpp, draft_chain.cpp) rather than
// through torch's dispatcher.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

namespace rlspec_kernels {

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& blocks, const at::Tensor& mask, double scale);
// paged_attention without its checks, for a caller that made them (decoder_layer, through check_layer).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& blocks,
                  const at::Tensor& mask, double scale);
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

// Argument checks. Every op validates shapes, dtypes and index ranges before it touches memory: a bad input (an
// upstream bug) is a RuntimeError naming the op and the argument, never a read or write outside a tensor. They
// cost O(1) a tensor plus one pass over the small index tensors (slots, block ids, token ids) a call.

// t is defined, on the CPU, of this dtype (and contiguous where the op reads it through a raw pointer as it is).
inline void check_tensor(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                         bool contiguous = false) {
  TORCH_CHECK(t.defined() && t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(!contiguous || t.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous())");
}

// An index tensor: integers of any width (the op reads them as int64), on the CPU.
inline void check_index_dtype(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && at::isIntegralType(t.scalar_type(), /*includeBool=*/false), op,
              ": ", name, " must be an integer CPU tensor, got ", t.scalar_type());
}

// Every element of idx (int64, contiguous) in [0, limit): one branch-free pass (the largest id read as unsigned,
// so a negative one is huge; it vectorises), then a second only to name the first bad element.
inline void check_range(const char* op, const char* name, const at::Tensor& idx, int64_t limit, const char* what) {
  const int64_t* p = idx.data_ptr<int64_t>();
  const int64_t n = idx.numel();
  uint64_t top = 0;
  for (int64_t i = 0; i < n; i++) top = std::max(top, static_cast<uint64_t>(p[i]));
  if (n == 0 || top < static_cast<uint64_t>(limit)) return;
  int64_t i = 0;
  while (p[i] >= 0 && p[i] < limit) i++;
  TORCH_CHECK(false, op, ": ", name, " holds ", p[i], " at flat index ", i, ", outside [0, ", limit, ") (", what,
              "): the caller's index tensor is corrupt");
}

// Every uniform of u (float32, contiguous) in [0, 1), as torch.rand draws them (a NaN fails too): outside, a draw
// inverts the CDF at a point that is not a probability.
inline void check_unit(const char* op, const char* name, const at::Tensor& u) {
  const float* p = u.data_ptr<float>();
  const int64_t n = u.numel();
  bool bad = false;
  for (int64_t i = 0; i < n; i++) bad |= !(p[i] >= 0.f && p[i] < 1.f);
  if (!bad) return;
  int64_t i = 0;
  while (p[i] >= 0.f && p[i] < 1.f) i++;
  TORCH_CHECK(false, op, ": ", name, " holds ", p[i], " at flat index ", i, ", outside [0, 1) (uniforms)");
}

// A norm weight [n], bf16, contiguous.
inline void check_vector(const char* op, const char* name, const at::Tensor& w, int64_t n) {
  check_tensor(op, name, w, at::kBFloat16, true);
  TORCH_CHECK(w.numel() == n, op, ": ", name, " must have ", n, " elements, got ", w.numel());
}

// wp = pack(w) of a weight [N, K]: [ceil(N/8), ceil(K/32), 8, 32] bf16, contiguous (kernels/__init__.py `pack`).
inline void check_packed(const char* op, const char* name, const at::Tensor& wp, int64_t N, int64_t K) {
  check_tensor(op, name, wp, at::kBFloat16);
  TORCH_CHECK(N > 0 && K > 0, op, ": ", name, " of a [", N, ", ", K, "] weight: both sizes must be positive");
  TORCH_CHECK(wp.dim() == 4 && wp.size(0) == (N + 7) / 8 && wp.size(1) == (K + 31) / 32 && wp.size(2) == 8 &&
                  wp.size(3) == 32 && wp.is_contiguous(),
              op, ": ", name, " must be pack(w) of a [", N, ", ", K, "] weight: [", (N + 7) / 8, ", ", (K + 31) / 32,
              ", 8, 32], contiguous; got ", wp.sizes());
}

inline void check_bias(const char* op, const char* name, const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return;
  check_tensor(op, name, *bias, at::kBFloat16);
  TORCH_CHECK(bias->numel() == N, op, ": ", name, " must have ", N, " elements, got ", bias->numel());
}

// The paged KV pools [NB, bs, KV, D] and a step's blocks [B, n] long and mask [B, 1, T, n * bs] bool for
// queries of H heads of D (paged_attention.cpp); every block id in [0, NB).
void check_paged(const char* op, int64_t B, int64_t H, int64_t T, int64_t D, const at::Tensor& k_pool,
                 const at::Tensor& v_pool, const at::Tensor& blocks, const at::Tensor& mask);
// Everything decoder_layer reads or writes (decoder_layer.cpp): shapes, dtypes, and the slots inside the pool.
void check_layer(const char* op, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& slots,
                 const at::Tensor& blocks, const at::Tensor& mask, const at::Tensor& norm1, const at::Tensor& qkv,
                 const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o,
                 const c10::optional<at::Tensor>& o_bias, const at::Tensor& norm2, const at::Tensor& gate_up,
                 const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                 const c10::optional<at::Tensor>& down_bias, int64_t heads, int64_t kv_heads, int64_t inter,
                 const c10::optional<at::Tensor>& embeds, const c10::optional<at::Tensor>& embed_norm);
// final_head's x [..., H], norm [H], lm_head pack(w [vocab, H]).
void check_head(const char* op, const at::Tensor& x, const at::Tensor& norm, const at::Tensor& lm_head,
                int64_t vocab);
// sample_rows' logits [B, V] float32 (V > 0), r [B] float32, temperature > 0 (sample.cpp).
void check_sample(const at::Tensor& logits, const at::Tensor& r, double temperature);
// verify_chain_rows' arguments (verify_chain.cpp): shapes and dtypes, draft ids in [0, V), counts >= 0. Returns the
// ids and counts as int64, contiguous: what it checked, as the op reads them.
std::pair<at::Tensor, at::Tensor> check_verify(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& num,
                                               const at::Tensor& q, const at::Tensor& u, const at::Tensor& r,
                                               double temperature);
// Everything draft_chain reads or writes, before its first draw (draft_chain.cpp): the layer's and the head's
// arguments (every draft step's cos, sin, slots and mask are slices of one tensor each), every step's slots inside
// the pool, the id map inside the embedding table, the uniforms.
void check_chain(const at::Tensor& h0, const at::Tensor& embed, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& slots,
                 const at::Tensor& blocks, const at::Tensor& masks, const at::Tensor& hidden_norm,
                 const at::Tensor& qkv, const at::Tensor& o, const at::Tensor& norm2, const at::Tensor& gate_up,
                 const at::Tensor& down, const at::Tensor& embed_norm, int64_t heads, int64_t kv_heads, int64_t inter,
                 const at::Tensor& head_norm, const at::Tensor& lm_head, int64_t vocab, const at::Tensor& ids,
                 const at::Tensor& r, double temperature);

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
// A row's finite column in the step's host transfer (rollout/step_layout.py): 0 where finite, -inf where not.
inline double finite_column(bool finite) { return finite ? 0.0 : -std::numeric_limits<double>::infinity(); }

}  // namespace rlspec_kernels
