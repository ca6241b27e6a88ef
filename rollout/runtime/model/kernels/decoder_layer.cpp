// rlspec_kernels::decoder_layer and final_head: a CPU decode or verify step's Llama layer, and its head, each in
// one call.
//
//   decoder_layer(x [B, T, H], cos, sin [B, T, 1, D], k_pool, v_pool [NB, bs, KV, D], slots [B, T], blocks [B, n],
//                 mask [B, 1, T, n * bs], norm1, qkv, qkv_bias?, o, o_bias?, norm2, gate_up, gate_up_bias?, down,
//                 down_bias?, heads, kv_heads, inter, eps, scale, embeds?, embed_norm?) -> [B, T, H]
//   final_head(x [B, T, H], norm, lm_head, vocab, eps) -> float32 logits [B, T, vocab]
//
// With embeds [B, T, H] (EAGLE-3's layer, drafters/eagle3_model.py) q, k and v are products of
// [norm(embeds; embed_norm) | norm1(x)] (2H wide); the residual stream is x either way.
//
// The products are packed_linear's (weights in `pack`'s blocked layout), attention is paged_attention's; every
// other op is done here in float32 and rounded to bf16 where the eager layer (llama.py) rounds: RMSNorm as HF's
// (x * rsqrt(mean(x^2) + eps) rounded, times the weight, rounded), RoPE as q * cos + rotate_half(q) * sin with each
// product and the sum rounded (sin signed, as the model's tables hold it: llama.rope), silu(gate) rounded before it
// multiplies up, each residual sum rounded. The new keys and values are written to their pool slots before
// attention reads the pool, as the eager layer does.
//
// Why (docs/runtime.md#the-fused-cpu-step): a batch-1 step spends about as long around its kernels as in them. A
// compiled layer is a Python call into dynamo's and inductor's wrappers (guards, size asserts, allocations, five
// op dispatches), ~150 us a layer on this CPU, 30 times a step; here a layer is one op call.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

#include <cmath>
#include <cstdint>

namespace {

using namespace rlspec_simd;

using bf16 = uint16_t;
inline float f(bf16 v) { return bf16_to_float(v); }
inline float rnd(float v) { return f(store_bf16(v)); }  // v rounded to bf16, as a float

const bf16* ptr(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
bf16* mut(at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

// HF's LlamaRMSNorm in bf16: w * bf16(x * rsqrt(mean(x^2) + eps)), M rows of H.
void rms_norm(const bf16* x, const bf16* w, bf16* y, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; m++) {
    const bf16* xr = x + m * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; i++) ss += f(xr[i]) * f(xr[i]);
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; i++) y[m * H + i] = store_bf16(f(w[i]) * rnd(f(xr[i]) * r));
  }
}

// out = x * cos + rotate_half(x) * sin for one head of D, as the eager bf16 ops round it; s is the signed sin
// (first half negated), which the half-rotated x multiplies (llama.rope).
void rope(const bf16* x, const bf16* c, const bf16* s, bf16* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; d++) {
    const float rot = f(x[d < half ? d + half : d - half]);
    out[d] = store_bf16(rnd(f(x[d]) * f(c[d])) + rnd(rot * f(s[d])));
  }
}

// act = bf16(silu(gate)) * up, rounded, for one row [gate | up] of n each: silu(g) = g / (1 + exp(-g)), with
// exp of -|g| only (exp_nonpos): g * 1 / (1 + e) for g >= 0, g * e / (1 + e) below. 16 lanes at a time; the
// scalar libm exp this replaced took half of a batch-8 layer's time outside its products.
void silu_mul(const bf16* gu, bf16* act, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 g = bf16x16_to_f32(gu + j), u = bf16x16_to_f32(gu + n + j);
    const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), e,
                                            _mm512_set1_ps(1.f));
    const __m512 s = _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    alignas(64) float sv[16], uv[16];
    _mm512_store_ps(sv, s);
    _mm512_store_ps(uv, u);
    for (int i = 0; i < 16; i++) act[j + i] = store_bf16(rnd(sv[i]) * uv[i]);
  }
  for (; j < n; j++) {
    const float g = f(gu[j]);
    act[j] = store_bf16(rnd(g / (1.f + std::exp(-g))) * f(gu[n + j]));
  }
}

// y = x + r, each sum rounded (a residual connection)
void add(const bf16* x, const bf16* r, bf16* y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = store_bf16(f(x[i]) + f(r[i]));
}

at::Tensor rows(const at::Tensor& like, int64_t M, int64_t N) { return at::empty({M, N}, like.options()); }

}  // namespace

namespace rlspec_kernels {

void check_layer(const char* op, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& slots,
                 const at::Tensor& blocks, const at::Tensor& mask, const at::Tensor& norm1, const at::Tensor& qkv,
                 const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o,
                 const c10::optional<at::Tensor>& o_bias, const at::Tensor& norm2, const at::Tensor& gate_up,
                 const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                 const c10::optional<at::Tensor>& down_bias, int64_t heads, int64_t kv_heads, int64_t inter,
                 const c10::optional<at::Tensor>& embeds, const c10::optional<at::Tensor>& embed_norm) {
  check_tensor(op, "x", x, at::kBFloat16);
  TORCH_CHECK(x.dim() == 3 && x.size(2) > 0, op, ": x must be [B, T, H] with H > 0, got ", x.sizes());
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T;
  TORCH_CHECK(k_pool.dim() == 4, op, ": k_pool must be [NB, bs, KV, D], got ", k_pool.sizes());
  const int64_t D = k_pool.size(3);
  TORCH_CHECK(heads > 0 && kv_heads == k_pool.size(2) && inter > 0, op, ": heads > 0, kv_heads = the pool's KV (",
              k_pool.size(2), ") and inter > 0; got heads = ", heads, ", kv_heads = ", kv_heads, ", inter = ", inter);
  // the pools, blocks and mask before anything is written to the pools
  check_paged(op, B, heads, T, D, k_pool, v_pool, blocks, mask);
  check_tensor(op, "cos", cos, at::kBFloat16);
  check_tensor(op, "sin", sin, at::kBFloat16);
  TORCH_CHECK(cos.numel() == M * D && sin.numel() == M * D, op, ": cos and sin must be [B, T, 1, D] = ", M * D,
              " elements each, got ", cos.sizes(), " and ", sin.sizes());
  check_index_dtype(op, "slots", slots);
  TORCH_CHECK(slots.numel() == M, op, ": slots must be [B, T] = ", M, " elements, got ", slots.sizes());
  check_range(op, "slots", slots.to(at::kLong).contiguous(), k_pool.size(0) * k_pool.size(1),
              "the KV pool's NB * bs slots");
  check_vector(op, "norm1", norm1, H);
  check_vector(op, "norm2", norm2, H);
  const bool eagle = embeds.has_value() && embeds->defined();
  if (eagle) {
    check_tensor(op, "embeds", *embeds, at::kBFloat16);
    TORCH_CHECK(embeds->numel() == M * H, op, ": embeds must be [B, T, H] like x, got ", embeds->sizes());
    TORCH_CHECK(embed_norm.has_value() && embed_norm->defined(), op, ": embeds need embed_norm [H]");
    check_vector(op, "embed_norm", *embed_norm, H);
  }
  const int64_t QKV = (heads + 2 * kv_heads) * D;
  check_packed(op, "qkv", qkv, QKV, eagle ? 2 * H : H);
  check_bias(op, "qkv_bias", qkv_bias, QKV);
  check_packed(op, "o", o, H, heads * D);
  check_bias(op, "o_bias", o_bias, H);
  check_packed(op, "gate_up", gate_up, 2 * inter, H);
  check_bias(op, "gate_up_bias", gate_up_bias, 2 * inter);
  check_packed(op, "down", down, H, inter);
  check_bias(op, "down_bias", down_bias, H);
}

at::Tensor decoder_layer(const at::Tensor& x_, const at::Tensor& cos_, const at::Tensor& sin_, at::Tensor& k_pool,
                         at::Tensor& v_pool, const at::Tensor& slots_, const at::Tensor& blocks,
                         const at::Tensor& mask, const at::Tensor& norm1, const at::Tensor& qkv,
                         const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o,
                         const c10::optional<at::Tensor>& o_bias, const at::Tensor& norm2, const at::Tensor& gate_up,
                         const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                         const c10::optional<at::Tensor>& down_bias, int64_t heads, int64_t kv_heads, int64_t inter,
                         double eps_, double scale, const c10::optional<at::Tensor>& embeds_,
                         const c10::optional<at::Tensor>& embed_norm) {
  check_layer("decoder_layer", x_, cos_, sin_, k_pool, v_pool, slots_, blocks, mask, norm1, qkv, qkv_bias, o, o_bias,
              norm2, gate_up, gate_up_bias, down, down_bias, heads, kv_heads, inter, embeds_, embed_norm);
  const int64_t B = x_.size(0), T = x_.size(1), H = x_.size(2), M = B * T, D = k_pool.size(3);
  const int64_t KV = k_pool.size(2), QKV = (heads + 2 * kv_heads) * D;
  const at::Tensor x = x_.contiguous(), cos = cos_.contiguous(), sin = sin_.contiguous();
  const at::Tensor slots = slots_.to(at::kLong).contiguous();
  const float eps = static_cast<float>(eps_);

  at::Tensor h = rows(x, M, H);
  at::Tensor proj;  // [M, q | k | v]
  if (embeds_.has_value() && embeds_->defined()) {  // EAGLE-3: [norm(embedding) | norm(hidden)] -> q, k, v
    const at::Tensor embeds = embeds_->contiguous();
    at::Tensor both = rows(x, M, 2 * H);
    for (int64_t m = 0; m < M; m++) {
      rms_norm(ptr(embeds) + m * H, ptr(*embed_norm), mut(both) + m * 2 * H, 1, H, eps);
      rms_norm(ptr(x) + m * H, ptr(norm1), mut(both) + m * 2 * H + H, 1, H, eps);
    }
    proj = packed_linear(both, qkv, qkv_bias, QKV);
  } else {
    rms_norm(ptr(x), ptr(norm1), mut(h), M, H, eps);
    proj = packed_linear(h, qkv, qkv_bias, QKV);
  }
  // RoPE: queries into [B, heads, T, D] (paged_attention's layout), keys and values into their pool slots
  at::Tensor q = at::empty({B, heads, T, D}, x.options());
  const bf16 *pp = ptr(proj), *cp = ptr(cos), *sp = ptr(sin);
  const int64_t* sl = slots.data_ptr<int64_t>();
  bf16 *kp = mut(k_pool), *vp = mut(v_pool), *qp = mut(q);
  for (int64_t m = 0; m < M; m++) {
    const int64_t b = m / T, t = m % T;
    const bf16* row = pp + m * QKV;
    for (int64_t hh = 0; hh < heads; hh++)
      rope(row + hh * D, cp + m * D, sp + m * D, qp + ((b * heads + hh) * T + t) * D, D);
    for (int64_t kh = 0; kh < KV; kh++) {
      const int64_t dst = (sl[m] * KV + kh) * D;
      rope(row + (heads + kh) * D, cp + m * D, sp + m * D, kp + dst, D);
      std::copy(row + (heads + KV + kh) * D, row + (heads + KV + kh + 1) * D, vp + dst);
    }
  }
  const at::Tensor att = attend(q, k_pool, v_pool, blocks, mask, scale);  // [B, heads, T, D], checked above
  at::Tensor flat = rows(x, M, heads * D);  // [B, T, heads * D], o_proj's input
  const bf16* ap = ptr(att);
  bf16* fp = mut(flat);
  for (int64_t m = 0; m < M; m++)
    for (int64_t hh = 0; hh < heads; hh++)
      std::copy_n(ap + ((m / T * heads + hh) * T + m % T) * D, D, fp + (m * heads + hh) * D);
  at::Tensor x2 = rows(x, M, H);
  add(ptr(x), ptr(packed_linear(flat, o, o_bias, H)), mut(x2), M * H);

  rms_norm(ptr(x2), ptr(norm2), mut(h), M, H, eps);
  const at::Tensor gu = packed_linear(h, gate_up, gate_up_bias, 2 * inter);  // [M, gate | up]
  at::Tensor act = rows(x, M, inter);
  for (int64_t m = 0; m < M; m++) silu_mul(ptr(gu) + m * 2 * inter, mut(act) + m * inter, inter);
  at::Tensor y = at::empty_like(x);
  add(ptr(x2), ptr(packed_linear(act, down, down_bias, H)), mut(y), M * H);
  return y;
}

void check_head(const char* op, const at::Tensor& x, const at::Tensor& norm, const at::Tensor& lm_head,
                int64_t vocab) {
  check_tensor(op, "x", x, at::kBFloat16);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must be [..., H] with H > 0, got ", x.sizes());
  const int64_t H = x.size(-1);
  check_vector(op, "norm", norm, H);
  TORCH_CHECK(vocab > 0, op, ": vocab must be positive, got ", vocab);
  check_packed(op, "lm_head", lm_head, vocab, H);
}

at::Tensor final_head(const at::Tensor& x_, const at::Tensor& norm, const at::Tensor& lm_head, int64_t vocab,
                      double eps) {
  check_head("final_head", x_, norm, lm_head, vocab);
  const at::Tensor x = x_.contiguous();
  const int64_t H = x.size(-1), M = x.numel() / H;
  at::Tensor h = rows(x, M, H);
  rms_norm(ptr(x), ptr(norm), mut(h), M, H, static_cast<float>(eps));
  auto shape = x.sizes().vec();
  shape.back() = vocab;
  return packed_linear(h, lm_head, c10::nullopt, vocab).to(at::kFloat).view(shape);
}

}  // namespace rlspec_kernels

TORCH_LIBRARY_FRAGMENT(rlspec_kernels, m) {
  m.def(
      "decoder_layer(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, "
      "Tensor blocks, Tensor mask, Tensor norm1, Tensor qkv, Tensor? qkv_bias, Tensor o, Tensor? o_bias, "
      "Tensor norm2, Tensor gate_up, Tensor? gate_up_bias, Tensor down, Tensor? down_bias, int heads, int kv_heads, "
      "int inter, float eps, float scale, Tensor? embeds=None, Tensor? embed_norm=None) -> Tensor");
  m.def("final_head(Tensor x, Tensor norm, Tensor lm_head, int vocab, float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(rlspec_kernels, CPU, m) {
  m.impl("decoder_layer", &rlspec_kernels::decoder_layer);
  m.impl("final_head", &rlspec_kernels::final_head);
}
