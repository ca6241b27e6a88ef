// rlspec_kernels::paged_attention: a CPU step's attention read straight from the paged KV pool.
//
//   paged_attention(q [B, H, T, D], k_pool [NB, bs, KV, D], v_pool, blocks [B, n] long, mask [B, 1, T, n * bs] bool,
//                   scale) -> [B, H, T, D]
//
// Row b's position s lives in pool block blocks[b, s / bs] at offset s % bs; query (h, t) of row b sees position s
// where mask[b, 0, t, s]. Query head h reads KV head h / (H / KV) (grouped-query attention). bf16 in and out,
// float32 inside: scores q.k (exact bf16 products summed in float32) times scale, softmax, the weighted sum of
// values, rounded once to bf16.
//
// Why (docs/runtime.md#attention-on-the-cpu): inside a compiled step inductor's fused gather/softmax kernel read a
// row's cached keys and values at ~5 GB/s (0.57 ms a layer at 4000 positions, against 0.12 ms of bandwidth), so a
// long rollout's steps were half attention, and every query of a verify step read the cache again. Here each
// (row, KV head, chunk of positions) task reads its keys and values once for all G * T queries that share them
// (flash-decoding's split over positions, so a batch-1 step keeps both cores busy), skips positions no query of
// the row sees (the cache past the row's own length), and the chunks' partial softmaxes are merged at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace rlspec_simd;

constexpr int64_t CHUNK = 256;  // positions per task: ~100 KB of keys and values at SmolLM2's shape

struct Shapes {
  int64_t B, H, T, D, KV, G, bs, n, S, chunks;
};

// Unnormalised outputs o[r, :] = sum_i p[r, i] v_i for queries r0 .. r0 + RG - 1, each query's D / 16 float32
// accumulators held in registers while the chunk's values (in L1/L2 after the first query group) stream past.
template <int DV, int RG>
void weigh_values(const float* p, int64_t stride, int64_t len, const uint16_t* const* vrow, float* o, int64_t r0,
                  int64_t rg) {
  __m512 acc[RG][DV];
  for (int r = 0; r < RG; r++)
    for (int d = 0; d < DV; d++) acc[r][d] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i++) {
    __m512 vv[DV];
    for (int d = 0; d < DV; d++) vv[d] = bf16x16_to_f32(vrow[i] + 16 * d);
    for (int r = 0; r < RG; r++) {
      if (r >= rg) break;
      const __m512 w = _mm512_set1_ps(p[(r0 + r) * stride + i]);
      for (int d = 0; d < DV; d++) acc[r][d] = _mm512_fmadd_ps(w, vv[d], acc[r][d]);
    }
  }
  for (int r = 0; r < rg; r++)
    for (int d = 0; d < DV; d++) _mm512_storeu_ps(o + (r0 + r) * DV * 16 + 16 * d, acc[r][d]);
}

template <int DV>
void weigh_all(const float* p, int64_t stride, int64_t R, int64_t len, const uint16_t* const* vrow, float* o) {
  constexpr int RG = 24 / DV;  // accumulators for RG queries plus DV value registers fit AVX-512's 32
  for (int64_t r0 = 0; r0 < R; r0 += RG) weigh_values<DV, RG>(p, stride, len, vrow, o, r0, std::min<int64_t>(RG, R - r0));
}

// One task: row b, KV head kvh, positions [s0, s1). Writes per query r = g * T + t (query head kvh * G + g, token
// t): the chunk's maximum score m[r], sum of exp(score - m) l[r], and unnormalised output o[r, :].
void chunk_task(const Shapes& z, const uint16_t* q, const uint16_t* kp, const uint16_t* vp, const int64_t* blocks,
                const bool* mask, float scale, int64_t b, int64_t kvh, int64_t s0, int64_t s1, float* m, float* l,
                float* o) {
  const int64_t R = z.G * z.T, D = z.D, len = s1 - s0, len4 = (len + 3) / 4 * 4;
  const float ninf = -std::numeric_limits<float>::infinity();
  // where each position's key and value live, and the scores: this thread's buffers, kept between tasks (three
  // allocations a task were a few percent of a short chunk's time)
  thread_local std::vector<const uint16_t*> krow, vrow;
  thread_local std::vector<float> scores;
  krow.resize(len4);
  vrow.resize(len);
  scores.resize(R * len4);
  for (int64_t i = 0; i < len; i++) {
    const int64_t s = s0 + i, slot = blocks[b * z.n + s / z.bs] * z.bs + s % z.bs;
    krow[i] = kp + (slot * z.KV + kvh) * D;
    vrow[i] = vp + (slot * z.KV + kvh) * D;
  }
  for (int64_t i = len; i < len4; i++) krow[i] = krow[0];  // a whole last group of four (its scores dropped)
  // scores: each query against the chunk's keys four at a time (they stay in L1/L2 after the first query)
  for (int64_t r = 0; r < R; r++) {
    const int64_t g = r / z.T, t = r % z.T;
    const uint16_t* qr = q + (((b * z.H) + kvh * z.G + g) * z.T + t) * D;
    float* sc = scores.data() + r * len4;
    for (int64_t i = 0; i < len4; i += 4) {
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qr + d);
        a0 = _mm512_dpbf16_ps(a0, qv, (__m512bh)_mm512_loadu_si512(krow[i] + d));
        a1 = _mm512_dpbf16_ps(a1, qv, (__m512bh)_mm512_loadu_si512(krow[i + 1] + d));
        a2 = _mm512_dpbf16_ps(a2, qv, (__m512bh)_mm512_loadu_si512(krow[i + 2] + d));
        a3 = _mm512_dpbf16_ps(a3, qv, (__m512bh)_mm512_loadu_si512(krow[i + 3] + d));
      }
      hsum4(a0, a1, a2, a3, sc + i);
    }
    // scaled, -inf where the query may not look, and the chunk's max, 16 positions at a time (one by one, these
    // two passes cost about as much as the products above)
    const bool* seen = mask + (b * z.T + t) * z.S + s0;
    const __m512 vscale = _mm512_set1_ps(scale), vninf = _mm512_set1_ps(ninf);
    __m512 vmax = vninf;
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 live = len - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - i)) - 1);
      const __m128i bytes = _mm_maskz_loadu_epi8(live, seen + i);
      const __mmask16 vis = _mm_test_epi8_mask(bytes, bytes);  // lanes past len: 0 (masked load)
      const __m512 v = _mm512_mask_mul_ps(vninf, vis, _mm512_maskz_loadu_ps(live, sc + i), vscale);
      _mm512_mask_storeu_ps(sc + i, live, v);
      vmax = _mm512_max_ps(vmax, v);
    }
    m[r] = _mm512_reduce_max_ps(vmax);
  }
  // per query: exp(score - the chunk's max) in place and its sum
  for (int64_t r = 0; r < R; r++) {
    float* sc = scores.data() + r * len4;
    const float mx = m[r];
    if (mx == ninf) {  // no key of this chunk is visible to this query
      l[r] = 0.f;
      std::fill(sc, sc + len, 0.f);
      continue;
    }
    __m512 sum = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(mx);
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 live = len - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - i)) - 1);
      const __m512 p = _mm512_maskz_mov_ps(live, exp_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + i), mv)));
      _mm512_mask_storeu_ps(sc + i, live, p);
      sum = _mm512_add_ps(sum, p);
    }
    l[r] = _mm512_reduce_add_ps(sum);
  }
  // values: weighed into every query's output
  if (D == 64) {
    weigh_all<4>(scores.data(), len4, R, len, vrow.data(), o);
  } else if (D == 128) {
    weigh_all<8>(scores.data(), len4, R, len, vrow.data(), o);
  } else {  // other head sizes (multiples of 32): accumulate in memory
    std::fill(o, o + R * D, 0.f);
    for (int64_t i = 0; i < len; i++)
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 vv = bf16x16_to_f32(vrow[i] + d);
        for (int64_t r = 0; r < R; r++)
          _mm512_storeu_ps(o + r * D + d, _mm512_fmadd_ps(_mm512_set1_ps(scores[r * len4 + i]), vv,
                                                          _mm512_loadu_ps(o + r * D + d)));
      }
  }
}

}  // namespace

namespace rlspec_kernels {

void check_paged(const char* op, int64_t B, int64_t H, int64_t T, int64_t D, const at::Tensor& k_pool,
                 const at::Tensor& v_pool, const at::Tensor& blocks, const at::Tensor& mask) {
  check_tensor(op, "k_pool", k_pool, at::kBFloat16, true);
  check_tensor(op, "v_pool", v_pool, at::kBFloat16, true);
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(), op,
              ": k_pool and v_pool must be [NB, bs, KV, D] of one shape; got ", k_pool.sizes(), " and ",
              v_pool.sizes());
  const int64_t NB = k_pool.size(0), bs = k_pool.size(1), KV = k_pool.size(2);
  TORCH_CHECK(bs > 0 && KV > 0 && D > 0 && D % 32 == 0 && k_pool.size(3) == D && H % KV == 0, op,
              ": pools [NB, bs, KV, D] with bs, KV > 0, the queries' head size D (a multiple of 32) and H = ", H,
              " query heads a multiple of KV; got pools ", k_pool.sizes(), " for D = ", D);
  check_tensor(op, "blocks", blocks, at::kLong);
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == B, op, ": blocks must be [B, n] with B = ", B, ", got ",
              blocks.sizes());
  check_tensor(op, "mask", mask, at::kBool);
  const int64_t S = blocks.size(1) * bs;
  TORCH_CHECK(mask.dim() == 4 && mask.size(0) == B && mask.size(1) == 1 && mask.size(2) == T && mask.size(3) == S,
              op, ": mask must be [B, 1, T, n * bs] = [", B, ", 1, ", T, ", ", S, "], got ", mask.sizes());
  check_range(op, "blocks", blocks.contiguous(), NB, "the KV pool's blocks");
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& blocks, const at::Tensor& mask, double scale) {
  check_tensor("paged_attention", "q", q, at::kBFloat16);
  TORCH_CHECK(q.dim() == 4, "paged_attention: q must be [B, H, T, D], got ", q.sizes());
  check_paged("paged_attention", q.size(0), q.size(1), q.size(2), q.size(3), k_pool, v_pool, blocks, mask);
  return attend(q, k_pool, v_pool, blocks, mask, scale);
}

at::Tensor attend(const at::Tensor& q_, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& blocks_,
                  const at::Tensor& mask_, double scale) {
  Shapes z{};
  z.B = q_.size(0), z.H = q_.size(1), z.T = q_.size(2), z.D = q_.size(3);
  z.bs = k_pool.size(1), z.KV = k_pool.size(2), z.n = blocks_.size(1), z.S = z.n * z.bs;
  z.G = z.H / z.KV;
  z.chunks = (z.S + CHUNK - 1) / CHUNK;
  const at::Tensor q = q_.contiguous(), blocks = blocks_.contiguous(), mask = mask_.contiguous();
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_pool.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_pool.data_ptr());
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  const int64_t R = z.G * z.T;
  // each row's live length: one past the last position any of its queries sees (the rest is never read)
  std::vector<int64_t> live(z.B, 0);
  for (int64_t b = 0; b < z.B; b++)
    for (int64_t t = 0; t < z.T; t++)
      for (int64_t s = z.S - 1; s >= live[b]; s--)
        if (mp[(b * z.T + t) * z.S + s]) {
          live[b] = s + 1;
          break;
        }
  std::vector<float> m(z.B * z.KV * z.chunks * R), l(m.size()), o(m.size() * z.D);
  at::parallel_for(0, z.B * z.KV * z.chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t c = i % z.chunks, kvh = i / z.chunks % z.KV, b = i / z.chunks / z.KV;
      const int64_t s0 = c * CHUNK, s1 = std::min(live[b], s0 + CHUNK);
      if (s0 >= s1) {  // past the row's live length: nothing seen
        std::fill(m.begin() + i * R, m.begin() + (i + 1) * R, -std::numeric_limits<float>::infinity());
        std::fill(l.begin() + i * R, l.begin() + (i + 1) * R, 0.f);
        continue;
      }
      chunk_task(z, qp, kp, vp, bp, mp, static_cast<float>(scale), b, kvh, s0, s1, m.data() + i * R, l.data() + i * R,
                 o.data() + i * R * z.D);
    }
  });
  // merge the chunks: softmax over all positions = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c
  at::Tensor out = at::empty({z.B, z.H, z.T, z.D}, q.options());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  std::vector<float> acc(z.D);
  for (int64_t b = 0; b < z.B; b++)
    for (int64_t kvh = 0; kvh < z.KV; kvh++)
      for (int64_t r = 0; r < R; r++) {
        const int64_t base = (b * z.KV + kvh) * z.chunks;
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < z.chunks; c++) M = std::max(M, m[(base + c) * R + r]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float L = 0.f;
        for (int64_t c = 0; c < z.chunks; c++) {
          const float lc = l[(base + c) * R + r];
          if (lc == 0.f) continue;
          const float w = std::exp(m[(base + c) * R + r] - M);
          L += w * lc;
          const float* oc = o.data() + ((base + c) * R + r) * z.D;
          for (int64_t d = 0; d < z.D; d++) acc[d] += w * oc[d];
        }
        const int64_t g = r / z.T, t = r % z.T;
        uint16_t* dst = op + ((b * z.H + kvh * z.G + g) * z.T + t) * z.D;
        for (int64_t d = 0; d < z.D; d++) dst[d] = store_bf16(L > 0.f ? acc[d] / L : 0.f);
      }
  return out;
}

}  // namespace rlspec_kernels

TORCH_LIBRARY_FRAGMENT(rlspec_kernels, m) {
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor blocks, Tensor mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(rlspec_kernels, CPU, m) { m.impl("paged_attention", &rlspec_kernels::paged_attention); }
