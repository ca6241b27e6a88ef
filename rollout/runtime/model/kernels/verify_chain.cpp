// rlspec_kernels::verify_chain_rows: lossless verification of drafted chains at temperature T (no truncation), with
// the emitted tokens' logprobs and each row's finite check, in one op.
//
//   verify_chain_rows(logits [B, K+1, V] float32, tokens [B, K] long, num [B] long, q [B, K, V] float32 or empty
//                     (deterministic drafts: q one-hot at the token), u [B, K] float32, r [B] float32, temperature)
//     -> (accepted [B] long, next_token [B] long, logprob [B, K+1] float32, finite [B] bool)
//
// Row b, p_i = softmax(logits[b, i] / T): accept draft i (i < num[b], in order) while u[b, i] * q_i(x_i) < p_i(x_i);
// at the first rejection a the next token is drawn from norm(max(0, p_a - q_a)) (p_a where that has no mass), after
// all num[b] from p_num, in both cases by inverting the CDF at 1 - r[b] (sampling.sample). That is verify.py's
// verify_chain rule with the same uniforms; the bits may differ (the softmax is this file's own). logprob[b, i]
// is log p_i of the token emitted at i (the accepted drafts, then the next token; 0 after), finite[b] whether every
// logit at positions 0..accepted was finite (if not, the rest of the row is meaningless and the engine raises).
//
// Why (docs/verification.md#chains-on-the-cpu): in torch a chain's verify took ~40 ops over [B, K+1, V] (softmax of
// every position, gathers, the residual, its CDF) and the host transfer's logprobs and finite check another
// log-softmax and sum: ~1.2 ms of a ~12 ms batch-1 step with one draft, here a few passes over the positions used.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <cmath>
#include <tuple>
#include <vector>

namespace rlspec_kernels {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_chain_rows(
    const at::Tensor& logits_, const at::Tensor& tokens_, const at::Tensor& num_, const at::Tensor& q_,
    const at::Tensor& u_, const at::Tensor& r_, double temperature) {
  TORCH_CHECK(logits_.scalar_type() == at::kFloat && logits_.dim() == 3 && logits_.device().is_cpu(),
              "verify_chain_rows: logits [B, K+1, V] float32 on the CPU");
  const int64_t B = logits_.size(0), K = logits_.size(1) - 1, V = logits_.size(2);
  const bool sampled = q_.numel() > 0;
  TORCH_CHECK(K >= 1 && tokens_.numel() == B * K && num_.numel() == B && u_.numel() == B * K && r_.numel() == B &&
                  u_.scalar_type() == at::kFloat && r_.scalar_type() == at::kFloat,
              "verify_chain_rows: tokens [B, K], num [B], u [B, K], r [B] float32, K >= 1");
  TORCH_CHECK(!sampled || (q_.numel() == B * K * V && q_.scalar_type() == at::kFloat),
              "verify_chain_rows: q [B, K, V] float32 or empty");
  TORCH_CHECK(temperature > 0, "verify_chain_rows: temperature > 0");
  const at::Tensor logits = logits_.contiguous(), tokens = tokens_.to(at::kLong).contiguous();
  const at::Tensor num = num_.to(at::kLong).contiguous(), q = q_.contiguous(), u = u_.contiguous(),
                   r = r_.contiguous();
  at::Tensor accepted = at::empty({B}, tokens.options()), next = at::empty({B}, tokens.options());
  at::Tensor logprob = at::zeros({B, K + 1}, logits.options());
  at::Tensor finite = at::empty({B}, tokens.options().dtype(at::kBool));
  const float* xp = logits.data_ptr<float>();
  const float* qp = sampled ? q.data_ptr<float>() : nullptr;
  const int64_t *tp = tokens.data_ptr<int64_t>(), *np = num.data_ptr<int64_t>();
  const float *up = u.data_ptr<float>(), *rp = r.data_ptr<float>();
  const float T = static_cast<float>(temperature);
  const int64_t lanes = (V + kDrawLanes - 1) / kDrawLanes;

  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> e(lanes * kDrawLanes), block(lanes), res(lanes * kDrawLanes), res_block(lanes);
    for (int64_t b = b0; b < b1; b++) {
      const float* row = xp + b * (K + 1) * V;
      float* lp = logprob.data_ptr<float>() + b * (K + 1);
      const int64_t n = std::min(np[b], K);
      int64_t a = 0;
      Softmax s{};
      bool rejected = false;
      for (;; a++) {  // position a: p_a; stop at the first rejection or after the last draft
        s = softmax_row(row + a * V, V, T, e.data(), block.data());
        if (!s.finite || a == n) break;
        const int64_t x = tp[b * K + a];
        const float qx = sampled ? qp[(b * K + a) * V + x] : 1.f;
        lp[a] = row[a * V + x] / T - s.max - std::log(s.total);
        if (!(up[b * K + a] * qx < e[x] / s.total)) {
          rejected = true;
          break;
        }
      }
      accepted.data_ptr<int64_t>()[b] = a;
      finite.data_ptr<bool>()[b] = s.finite;
      if (!s.finite) {
        next.data_ptr<int64_t>()[b] = 0;
        continue;
      }
      const float target = 1.f - rp[b];
      int64_t token = -1;
      if (rejected) {  // the residual max(0, p_a - q_a), unnormalised, with its block sums
        const float* qa = sampled ? qp + (b * K + a) * V : nullptr;
        const int64_t x = tp[b * K + a];
        float mass = 0.f;
        for (int64_t k = 0; k < lanes; k++) {
          float sum = 0.f;
          for (int64_t j = k * kDrawLanes; j < std::min((k + 1) * kDrawLanes, V); j++) {
            const float p = e[j] / s.total;
            const float d = sampled ? p - qa[j] : (j == x ? p - 1.f : p);
            res[j] = d > 0.f ? d : 0.f;
            sum += res[j];
          }
          res_block[k] = sum;
          mass += sum;
        }
        if (mass > 0.f) token = search_row(res.data(), res_block.data(), V, target * mass);
      }
      if (token < 0) token = search_row(e.data(), block.data(), V, target * s.total);  // p_a: the bonus
      next.data_ptr<int64_t>()[b] = token;
      lp[a] = row[a * V + token] / T - s.max - std::log(s.total);
    }
  });
  return {accepted, next, logprob, finite};
}

}  // namespace rlspec_kernels

TORCH_LIBRARY_FRAGMENT(rlspec_kernels, m) {
  m.def(
      "verify_chain_rows(Tensor logits, Tensor tokens, Tensor num, Tensor q, Tensor u, Tensor r, float temperature) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(rlspec_kernels, CPU, m) { m.impl("verify_chain_rows", &rlspec_kernels::verify_chain_rows); }
