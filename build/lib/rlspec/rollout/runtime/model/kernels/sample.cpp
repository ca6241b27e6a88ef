// rlspec_kernels::sample_rows: a plain decode step's draw from softmax(logits / T), the drawn token's logprob and
// the row's finiteness, in one op.
//
//   sample_rows(logits [B, V] float32, r [B] float32 in [0, 1), temperature) -> (token [B] long,
//               logprob [B] float32, finite [B] bool)
//
// The token inverts the CDF of softmax(logits / T) at u = 1 - r, as sampling.sample does: the first token whose cumulative
// (unnormalised) mass reaches u times the total, so a token of probability 0 is never drawn. logprob is
// log softmax(logits / T) at that token (sampling.logprobs_of), finite says every logit of the row is finite
// (nonfinite.finite_flags; the token is then meaningless and the engine raises).
//
// Why (docs/verification.md#plain-steps-on-the-cpu): torch took five passes over each row's 49k logits (softmax,
// cumsum, log_softmax, a sum for the finite check, the CDF search) and ~35 small ops around them, ~0.75 ms of a
// ~11 ms batch-1 step; here three passes in one call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace rlspec_kernels {

using namespace rlspec_simd;

constexpr int64_t W = kDrawLanes;  // lanes: the exponentials' partial sums are kept per block of 16 tokens

Softmax softmax_row(const float* x, int64_t V, float temperature, float* e, float* block) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const __m512 vt = _mm512_set1_ps(temperature);
  // pass 1: the scaled maximum; any NaN or inf among the raw logits
  __m512 vmax = _mm512_set1_ps(ninf);
  __mmask16 bad = 0;
  for (int64_t i = 0; i < V; i += W) {
    const __mmask16 live = V - i >= W ? __mmask16(0xFFFF) : __mmask16((1u << (V - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + i);
    bad |= _mm512_mask_cmp_ps_mask(live, _mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);  // NaN or inf
    vmax = _mm512_mask_max_ps(vmax, live, vmax, _mm512_div_ps(v, vt));
  }
  if (bad) return {0.f, 0.f, false};
  const float m = _mm512_reduce_max_ps(vmax);
  // pass 2: exp(x / T - max), kept, with each block's sum and the total
  const __m512 vm = _mm512_set1_ps(m);
  float total = 0.f;
  for (int64_t i = 0, k = 0; i < V; i += W, k++) {
    const __mmask16 live = V - i >= W ? __mmask16(0xFFFF) : __mmask16((1u << (V - i)) - 1);
    const __m512 s = _mm512_div_ps(_mm512_maskz_loadu_ps(live, x + i), vt);
    const __m512 p = _mm512_maskz_mov_ps(live, exp_nonpos(_mm512_sub_ps(s, vm)));
    _mm512_storeu_ps(e + i, p);
    block[k] = _mm512_reduce_add_ps(p);
    total += block[k];
  }
  return {m, total, true};
}

int64_t search_row(const float* e, const float* block, int64_t V, float target) {
  float c = 0.f;
  int64_t last = 0;
  for (int64_t i = 0, k = 0; i < V; i += W, k++) {
    if (block[k] > 0.f) last = i;
    if (c + block[k] < target) {
      c += block[k];
      continue;
    }
    for (int64_t j = i; j < std::min(i + W, V); j++) {
      c += e[j];
      if (e[j] > 0.f && c >= target) return j;
    }
  }
  // rounding left the running sum just short of the total: the last token of nonzero mass
  int64_t token = last;
  for (int64_t j = last; j < std::min(last + W, V); j++)
    if (e[j] > 0.f) token = j;
  return token;
}

Draw draw_row(const float* x, int64_t V, float u, float temperature, float* e, float* block) {
  const Softmax s = softmax_row(x, V, temperature, e, block);
  if (!s.finite) return {0, std::numeric_limits<float>::quiet_NaN(), false, 0.f};
  const int64_t token = search_row(e, block, V, u * s.total);
  return {token, x[token] / temperature - s.max - std::log(s.total), true, s.total};
}

void check_sample(const at::Tensor& logits, const at::Tensor& r, double temperature) {
  check_tensor("sample_rows", "logits", logits, at::kFloat);
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "sample_rows: logits must be [B, V] with V > 0, got ",
              logits.sizes());
  check_tensor("sample_rows", "r", r, at::kFloat);
  TORCH_CHECK(r.numel() == logits.size(0), "sample_rows: r must be [B] = ", logits.size(0), " uniforms, got ",
              r.sizes());
  TORCH_CHECK(temperature > 0, "sample_rows: temperature must be > 0 (greedy rows take argmax), got ", temperature);
  check_unit("sample_rows", "r", r.contiguous());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits_, const at::Tensor& u_,
                                                           double temperature) {
  check_sample(logits_, u_, temperature);
  const at::Tensor logits = logits_.contiguous(), u = u_.contiguous();
  const int64_t B = logits.size(0), V = logits.size(1);
  at::Tensor token = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor logprob = at::empty({B}, logits.options());
  at::Tensor finite = at::empty({B}, logits.options().dtype(at::kBool));
  const float* xp = logits.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> e((V + W - 1) / W * W), block((V + W - 1) / W);
    for (int64_t b = b0; b < b1; b++) {
      const Draw d = draw_row(xp + b * V, V, 1.f - up[b], static_cast<float>(temperature), e.data(), block.data());
      token.data_ptr<int64_t>()[b] = d.token;
      logprob.data_ptr<float>()[b] = d.logprob;
      finite.data_ptr<bool>()[b] = d.finite;
    }
  });
  return {token, logprob, finite};
}

}  // namespace rlspec_kernels

TORCH_LIBRARY_FRAGMENT(rlspec_kernels, m) {
  m.def("sample_rows(Tensor logits, Tensor r, float temperature) -> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(rlspec_kernels, CPU, m) { m.impl("sample_rows", &rlspec_kernels::sample_rows); }
