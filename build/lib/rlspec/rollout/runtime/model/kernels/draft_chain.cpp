// rlspec_kernels::draft_chain: a learned drafter's whole chain proposal after its catch-up, in one call.
//
//   draft_chain(h [R, H], embed [V, H], cos, sin [S, R, 1, 1, D], k_pool, v_pool, slots [S, R], blocks [R, n],
//               masks [S, R, 1, 1, n * bs], <EAGLE-3's layer: hidden_norm, qkv, o, norm2, gate_up, down, embed_norm,
//               heads, kv_heads, inter, eps, scale>, head_norm, lm_head, vocab, ids [vocab], r [S + 1, R], temperature)
//     -> (tokens [R, S + 1] long, q [R, S + 1, V] float32, logits [R, S + 1, vocab] float32, finite [R, S + 1])
//
// Draw j of a row: logits = final_head(h) over the draft vocabulary; its token from q = softmax(logits / T) at
// u = 1 - r[j] (draw_row, the CDF inversion sample_rows uses), or the first maximum when temperature is 0 (q is
// then empty); tokens hold target ids (ids[draft id]), and q is spread over the target's vocabulary (V, the
// embedding's rows; zero outside the draft vocabulary), as verification takes it. Before draw j + 1, draft step
// j + 1 runs decoder_layer on [embedding of token j | h] with cos[j], sin[j], slots[j] (where its key goes) and
// masks[j] (what it attends), as drafters/eagle3.py's eager and fused steps do. finite[r, j] is false where a
// logit of that draw was NaN or inf: its token is meaningless, and so is what follows it in the row.
//
// Why (docs/drafters.md#the-chain-as-one-op): with the layer and head fused, a 4-token proposal still spent about
// half its ~2.1 ms in ~25 small torch ops a draw (the head's softmax, the CDF search, the id map, the embedding)
// and the Python between them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace rlspec_kernels {

void check_chain(const at::Tensor& h0, const at::Tensor& embed, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& slots,
                 const at::Tensor& blocks, const at::Tensor& masks, const at::Tensor& hidden_norm,
                 const at::Tensor& qkv, const at::Tensor& o, const at::Tensor& norm2, const at::Tensor& gate_up,
                 const at::Tensor& down, const at::Tensor& embed_norm, int64_t heads, int64_t kv_heads, int64_t inter,
                 const at::Tensor& head_norm, const at::Tensor& lm_head, int64_t vocab, const at::Tensor& ids,
                 const at::Tensor& r, double temperature) {
  constexpr const char* op = "draft_chain";
  check_tensor(op, "h", h0, at::kBFloat16);
  check_tensor(op, "embed", embed, at::kBFloat16, true);
  TORCH_CHECK(h0.dim() == 2 && embed.dim() == 2 && embed.size(1) == h0.size(1), op,
              ": h [R, H] and an embedding table [V, H]; got ", h0.sizes(), " and ", embed.sizes());
  const int64_t R = h0.size(0), H = h0.size(1);
  check_head(op, h0, head_norm, lm_head, vocab);
  check_index_dtype(op, "slots", slots);
  TORCH_CHECK(slots.dim() == 2 && slots.size(1) == R, op, ": slots must be [S, R] with R = ", R, ", got ",
              slots.sizes());
  const int64_t S = slots.size(0);
  // a chain of one draw (S = 0) takes no step inputs: the caller passes empty tensors of any shape
  TORCH_CHECK(S == 0 ? cos.numel() == 0 && sin.numel() == 0 && masks.numel() == 0 :
                  cos.dim() >= 1 && sin.dim() >= 1 && masks.dim() == 5 && cos.size(0) == S && sin.size(0) == S &&
                  masks.size(0) == S, op, ": cos, sin [S, R, 1, 1, D] and masks [S, R, 1, 1, n * bs] with S = ", S,
              " (one per draft step); got ", cos.sizes(), ", ", sin.sizes(), ", ", masks.sizes());
  if (S > 0) {  // step 0's arguments as decoder_layer takes them stand for every step's (same shapes)
    check_layer(op, h0.reshape({R, 1, H}), cos[0], sin[0], k_pool, v_pool, slots[0].view({R, 1}), blocks, masks[0],
                hidden_norm, qkv, c10::nullopt, o, c10::nullopt, norm2, gate_up, c10::nullopt, down, c10::nullopt,
                heads, kv_heads, inter, h0, embed_norm);
    check_range(op, "slots", slots.to(at::kLong).contiguous(), k_pool.size(0) * k_pool.size(1),
                "the KV pool's NB * bs slots");
  }
  check_index_dtype(op, "ids", ids);
  TORCH_CHECK(ids.numel() == vocab, op, ": ids must be [vocab] = ", vocab, " target ids, got ", ids.sizes());
  check_range(op, "ids", ids.to(at::kLong).contiguous(), embed.size(0), "the embedding table's rows");
  check_tensor(op, "r", r, at::kFloat);
  TORCH_CHECK(r.numel() == (S + 1) * R, op, ": r must be [S + 1, R] = [", S + 1, ", ", R, "] uniforms, got ",
              r.sizes());
  check_unit(op, "r", r.contiguous());
  TORCH_CHECK(!std::isnan(temperature), op, ": temperature is NaN");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_chain(
    const at::Tensor& h0, const at::Tensor& embed, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool,
    at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& blocks, const at::Tensor& masks,
    const at::Tensor& hidden_norm, const at::Tensor& qkv, const at::Tensor& o, const at::Tensor& norm2,
    const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& embed_norm, int64_t heads, int64_t kv_heads,
    int64_t inter, double eps, double scale, const at::Tensor& head_norm, const at::Tensor& lm_head, int64_t vocab,
    const at::Tensor& ids_, const at::Tensor& r_, double temperature) {
  check_chain(h0, embed, cos, sin, k_pool, v_pool, slots, blocks, masks, hidden_norm, qkv, o, norm2, gate_up, down,
              embed_norm, heads, kv_heads, inter, head_norm, lm_head, vocab, ids_, r_, temperature);
  const int64_t R = h0.size(0), H = h0.size(1), S = slots.size(0), depth = S + 1;
  const bool greedy = temperature <= 0;
  const at::Tensor ids = ids_.to(at::kLong).contiguous(), r = r_.contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* rp = r.data_ptr<float>();
  const int64_t V = embed.size(0);

  at::Tensor tokens = at::empty({R, depth}, ids.options());
  at::Tensor logits = at::empty({R, depth, vocab}, h0.options().dtype(at::kFloat));
  at::Tensor q = greedy ? at::empty({0}, logits.options()) : at::zeros({R, depth, V}, logits.options());
  at::Tensor finite = at::empty({R, depth}, ids.options().dtype(at::kBool));
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logits.data_ptr<float>();
  bool* fp = finite.data_ptr<bool>();
  std::vector<float> e((vocab + kDrawLanes - 1) / kDrawLanes * kDrawLanes), block(e.size() / kDrawLanes);

  at::Tensor h = h0.contiguous().view({R, 1, H});
  at::Tensor embeds = at::empty({R, 1, H}, h0.options());
  const auto* table = reinterpret_cast<const uint16_t*>(embed.data_ptr());
  auto* ep = reinterpret_cast<uint16_t*>(embeds.data_ptr());
  for (int64_t j = 0; j < depth; j++) {
    const at::Tensor x = final_head(h, head_norm, lm_head, vocab, eps).contiguous();  // [R, 1, vocab]
    const float* xp = x.data_ptr<float>();
    for (int64_t b = 0; b < R; b++) {
      const float* row = xp + b * vocab;
      float* out = lp + (b * depth + j) * vocab;
      std::memcpy(out, row, vocab * sizeof(float));
      int64_t tok;
      bool ok;
      if (greedy) {
        tok = std::max_element(row, row + vocab) - row;
        ok = std::all_of(row, row + vocab, [](float v) { return v - v == 0.f; });  // NaN or inf fail
      } else {
        const Draw d = draw_row(row, vocab, 1.f - rp[j * R + b], static_cast<float>(temperature), e.data(),
                                block.data());
        tok = d.token;
        ok = d.finite;
        float* qr = q.data_ptr<float>() + (b * depth + j) * V;
        const float inv = ok ? 1.f / d.total : 0.f;
        for (int64_t i = 0; i < vocab; i++) qr[idp[i]] = e[i] * inv;
      }
      tp[b * depth + j] = idp[tok];
      fp[b * depth + j] = ok;
      if (j + 1 < depth) std::memcpy(ep + b * H, table + tp[b * depth + j] * H, H * sizeof(uint16_t));
    }
    if (j + 1 == depth) break;
    h = decoder_layer(h, cos[j], sin[j], k_pool, v_pool, slots[j].view({R, 1}), blocks, masks[j], hidden_norm, qkv,
                      c10::nullopt, o, c10::nullopt, norm2, gate_up, c10::nullopt, down, c10::nullopt, heads,
                      kv_heads, inter, eps, scale, embeds, embed_norm);
  }
  return {tokens, q, logits, finite};
}

}  // namespace rlspec_kernels

TORCH_LIBRARY_FRAGMENT(rlspec_kernels, m) {
  m.def(
      "draft_chain(Tensor h, Tensor embed, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, "
      "Tensor slots, Tensor blocks, Tensor masks, Tensor hidden_norm, Tensor qkv, Tensor o, Tensor norm2, "
      "Tensor gate_up, Tensor down, Tensor embed_norm, int heads, int kv_heads, int inter, float eps, float scale, "
      "Tensor head_norm, Tensor lm_head, int vocab, Tensor ids, Tensor r, float temperature) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(rlspec_kernels, CPU, m) { m.impl("draft_chain", &rlspec_kernels::draft_chain); }
