// rlspec_kernels::verify_chain_rows: lossless verification of drafted chains at temperature T (no truncation), with
// the emitted tokens' logprobs and each row's finite check, in one op.
//
//   verify_chain_rows(logits [B, K+1, V] float32, tokens [B, K] long, num [B] long, q [B, K, V] float32 or empty
//                     (deterministic drafts: q one-hot at the token), u [B, K] float32, r [B] float32, temperature)
//     -> (accepted [B] long, next_token [B] long,
//         row [B, 2K+4] float64: accepted, emitted (K+1), logprob (K+1), finite column)
//
// Row b, p_i = softmax(logits[b, i] / T): accept draft i (i < num[b], in order) while u[b, i] * q_i(x_i) < p_i(x_i);
// at the first rejection a the next token is drawn from norm(max(0, p_a - q_a)) (p_a where that has no mass), after
// all num[b] from p_num, in both cases by inverting the CDF at 1 - r[b] (sampling.sample). That is verify.py's
// verify_chain rule with the same uniforms; the bits may differ (the softmax is this file's own). The row is the chain
// step's host transfer as rollout/step_layout.py lays it out: the accepted count a, the emitted tokens (the accepted
// drafts, then the next token at column a; 0 after), log p_i of the token emitted at i (0 after), and the finite
// column: 0 where every logit at positions 0..a was finite and -inf where not (then the rest of the row is
// meaningless and the engine raises). The step sends it as it is: no op packs it.
//
// Why (docs/verification.md#chains-on-the-cpu): in torch a chain's verify took ~40 ops over [B, K+1, V] (softmax of
// every position, gathers, the residual, its CDF) and the host transfer's logprobs and finite check another
// log-softmax and sum: ~1.2 ms of a ~12 ms batch-1 step with one draft, here a few passes over the positions used;
// packing the transfer took eight more small ops a step (docs/runtime.md#host-step-budget).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <cmath>
#include <tuple>
#include <vector>

namespace rlspec_kernels {

std::pair<at::Tensor, at::Tensor> check_verify(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& num,
                                               const at::Tensor& q, const at::Tensor& u, const at::Tensor& r,
                                               double temperature) {
  constexpr const char* op = "verify_chain_rows";
  check_tensor(op, "logits", logits, at::kFloat);
  TORCH_CHECK(logits.dim() == 3 && logits.size(1) >= 2 && logits.size(2) > 0, op,
              ": logits must be [B, K+1, V] with K >= 1 and V > 0, got ", logits.sizes());
  const int64_t B = logits.size(0), K = logits.size(1) - 1, V = logits.size(2);
  check_index_dtype(op, "tokens", tokens);
  check_index_dtype(op, "num", num);
  check_tensor(op, "u", u, at::kFloat);
  check_tensor(op, "r", r, at::kFloat);
  TORCH_CHECK(tokens.numel() == B * K && num.numel() == B && u.numel() == B * K && r.numel() == B, op,
              ": tokens [B, K], num [B], u [B, K] and r [B] with B = ", B, ", K = ", K, "; got ", tokens.sizes(),
              ", ", num.sizes(), ", ", u.sizes(), ", ", r.sizes());
  if (q.numel() > 0) {
    check_tensor(op, "q", q, at::kFloat);
    TORCH_CHECK(q.numel() == B * K * V, op, ": q must be [B, K, V] = [", B, ", ", K, ", ", V, "] or empty, got ",
                q.sizes());
  }
  TORCH_CHECK(temperature > 0, op, ": temperature must be > 0 (greedy chains take argmax), got ", temperature);
  check_unit(op, "u", u.contiguous());
  check_unit(op, "r", r.contiguous());
  const at::Tensor ids = tokens.to(at::kLong).contiguous(), counts = num.to(at::kLong).contiguous();
  check_range(op, "tokens", ids, V, "the vocabulary");
  const int64_t* np = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++)  // a count past K means all K (verify_chain's rule); a negative one is a bug
    TORCH_CHECK(np[b] >= 0, op, ": num[", b, "] = ", np[b], " is a negative draft count");
  return {ids, counts};  // as the op reads them (the drafts come as a slice of the step's layout: copied once)
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_chain_rows(
    const at::Tensor& logits_, const at::Tensor& tokens_, const at::Tensor& num_, const at::Tensor& q_,
    const at::Tensor& u_, const at::Tensor& r_, double temperature) {
  const auto [tokens, num] = check_verify(logits_, tokens_, num_, q_, u_, r_, temperature);
  const int64_t B = logits_.size(0), K = logits_.size(1) - 1, V = logits_.size(2);
  const bool sampled = q_.numel() > 0;
  const at::Tensor logits = logits_.contiguous(), q = q_.contiguous(), u = u_.contiguous(), r = r_.contiguous();
  at::Tensor accepted = at::empty({B}, tokens.options()), next = at::empty({B}, tokens.options());
  at::Tensor out = at::zeros({B, 2 * K + 4}, logits.options().dtype(at::kDouble));  // the rows (this file's header)
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
      double* o = out.data_ptr<double>() + b * (2 * K + 4);
      double* emitted = o + 1;
      double* lp = o + K + 2;  // float32 values (the softmax's), as the torch path's
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
        emitted[a] = static_cast<double>(x);
        if (!(up[b * K + a] * qx < e[x] / s.total)) {
          rejected = true;
          break;
        }
      }
      accepted.data_ptr<int64_t>()[b] = a;
      o[0] = static_cast<double>(a);
      o[2 * K + 3] = finite_column(s.finite);
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
      emitted[a] = static_cast<double>(token);
      lp[a] = row[a * V + token] / T - s.max - std::log(s.total);
    }
  });
  return {accepted, next, out};
}

}  // namespace rlspec_kernels

TORCH_LIBRARY_FRAGMENT(rlspec_kernels, m) {
  m.def(
      "verify_chain_rows(Tensor logits, Tensor tokens, Tensor num, Tensor q, Tensor u, Tensor r, float temperature) "
      "-> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(rlspec_kernels, CPU, m) { m.impl("verify_chain_rows", &rlspec_kernels::verify_chain_rows); }
