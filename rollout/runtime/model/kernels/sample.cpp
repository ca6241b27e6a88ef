// rlspec_kernels::sample_rows: a plain decode step's draw from softmax(logits / T), the drawn token's logprob and
// the row's finiteness, in one op.
//
//   sample_rows(logits [B, V] float32, r [B] float32 in [0, 1), temperature) -> (token [B] long,
//               row [B, 3] float64: token, logprob, finite column)
//
// The token inverts the CDF of softmax(logits / T) at u = 1 - r, as sampling.sample does: the first token whose cumulative
// (unnormalised) mass reaches u times the total, so a token of probability 0 is never drawn. logprob is
// log softmax(logits / T) at that token (sampling.logprobs_of), computed in float32; the finite column is 0 where
// every logit of the row is finite and -inf where not (the token is then meaningless and the engine raises). The row
// is the plain step's host transfer as StepLayout lays it out, so the step sends it as it is: the packing and the
// finite column's conversion were three more ops a step.
//
// Why (docs/verification.md#plain-steps-on-the-cpu): torch took five passes over each row's 49k logits (softmax,
// cumsum, log_softmax, a sum for the finite check, the CDF search) and ~35 small ops around them, ~0.75 ms of a
// ~11 ms batch-1 step; here three passes in one call.
//
// Built two ways (kernels/__init__.py): with AVX-512 inside the full library, and portable (no -m flags) in a
// library of the draws alone where the CPU lacks AVX-512 BF16, so that every CPU draws in one op. The two differ
// only in softmax_row's exponential: the same polynomial, 16 lanes at a time or in a loop the compiler vectorises.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd.h"
#endif

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace rlspec_kernels {

constexpr int64_t W = kDrawLanes;  // lanes: the exponentials' partial sums are kept per block of 16 tokens

#if defined(__AVX512F__)
using namespace rlspec_simd;

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
#else
// GCC/Clang vector extensions: W lanes in whatever registers the compiler targets (SSE, AVX2), so the loops below
// are vector code by construction rather than by the auto-vectoriser's leave (which keeps a running maximum or sum
// scalar without fast-math).
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));  // half a block: its sum below assumes W = 16
static_assert(W == 16, "softmax_row sums a block as two halves of 8 lanes");

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// exp(x) for x <= 0 as simd.h's exp_nonpos computes it: 2^n * 2^f, f's degree-7 Taylor polynomial, 0 below -87.
// n rounds by the 1.5 * 2^23 trick and 2^n is built in the exponent field (n >= -126: a normal float).
inline vf exp_nonpos_v(vf x) {
  const vf lo = vf{} - 87.f;
  const vf t = (x > lo ? x : lo) * 1.44269504088896341f;
  const vf n = (t + 12582912.f) - 12582912.f;
  const vf f = (t - n) * 0.69314718055994531f;
  vf p = f * (1.f / 5040) + 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  vi out;
  const vf r = p * scale;
  std::memcpy(&out, &r, sizeof out);
  out &= (x >= lo);  // lanes below -87 (masked: -inf) give 0
  vf res;
  std::memcpy(&res, &out, sizeof res);
  return res;
}

Softmax softmax_row(const float* x, int64_t V, float temperature, float* e, float* block) {
  const int64_t whole = V / W * W;
  // pass 1: the scaled maximum; any NaN or inf among the raw logits (x - x is 0 exactly when x is finite)
  vf vmax = vf{} - std::numeric_limits<float>::infinity(), vbad = vf{};
  for (int64_t i = 0; i < whole; i += W) {
    const vf v = load(x + i);
    vbad += v - v;  // NaN in a lane as soon as one of its logits is NaN or inf
    const vf s = v / temperature;
    vmax = s > vmax ? s : vmax;
  }
  float m = -std::numeric_limits<float>::infinity();
  bool bad = false;
  for (int64_t l = 0; l < W; l++) {
    bad |= !(vbad[l] == 0.f);
    m = std::max(m, vmax[l]);
  }
  for (int64_t i = whole; i < V; i++) {
    bad |= !(x[i] - x[i] == 0.f);
    m = std::max(m, x[i] / temperature);
  }
  if (bad) return {0.f, 0.f, false};
  // pass 2: exp(x / T - max), kept (0 past V, up to the block's end), with each block's sum and the total
  float total = 0.f, tail[W] = {};
  for (int64_t i = 0, k = 0; i < V; i += W, k++) {
    const bool full = i + W <= V;
    if (!full)
      for (int64_t l = 0; i + l < V; l++) tail[l] = x[i + l];
    const vf p = exp_nonpos_v(load(full ? x + i : tail) / temperature - m);
    std::memcpy(e + i, &p, sizeof p);
    if (!full)
      for (int64_t l = V - i; l < W; l++) e[i + l] = 0.f;
    // the block's sum by halves (a running sum would chain 16 dependent additions a block)
    const v8 h8 = load8(e + i) + load8(e + i + 8);
    const float sum = ((h8[0] + h8[4]) + (h8[1] + h8[5])) + ((h8[2] + h8[6]) + (h8[3] + h8[7]));
    block[k] = sum;
    total += sum;
  }
  return {m, total, true};
}
#endif

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

std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits_, const at::Tensor& u_, double temperature) {
  check_sample(logits_, u_, temperature);
  const at::Tensor logits = logits_.contiguous(), u = u_.contiguous();
  const int64_t B = logits.size(0), V = logits.size(1);
  at::Tensor token = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor row = at::empty({B, 3}, logits.options().dtype(at::kDouble));
  const float* xp = logits.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> e((V + W - 1) / W * W), block((V + W - 1) / W);
    for (int64_t b = b0; b < b1; b++) {
      const Draw d = draw_row(xp + b * V, V, 1.f - up[b], static_cast<float>(temperature), e.data(), block.data());
      token.data_ptr<int64_t>()[b] = d.token;
      double* out = row.data_ptr<double>() + 3 * b;
      out[0] = static_cast<double>(d.token);
      out[1] = static_cast<double>(d.logprob);
      out[2] = finite_column(d.finite);
    }
  });
  return {token, row};
}

}  // namespace rlspec_kernels

TORCH_LIBRARY_FRAGMENT(rlspec_kernels, m) {
  m.def("sample_rows(Tensor logits, Tensor r, float temperature) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(rlspec_kernels, CPU, m) { m.impl("sample_rows", &rlspec_kernels::sample_rows); }
