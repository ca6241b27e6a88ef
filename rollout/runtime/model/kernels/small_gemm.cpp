// rlspec_kernels::small_linear: y = x @ w^T (+ bias) for bf16 x [M, K] with few rows (M <= 16) and bf16 w [N, K],
// float32 accumulation, rounded once to bf16 (round to nearest even), as torch's matmul rounds.
//
// Why (docs/runtime.md#verify-steps-on-the-cpu): a speculative verify step at batch 1 multiplies every weight by
// 2-16 rows. oneDNN reorders the weight on every unpacked call (~8 GB/s), and inside a compiled step inductor
// cannot use pre-packed weights, so a compiled verify step ran at a third of the memory bandwidth. This kernel
// reads each weight once per call, straight from its row-major layout, and multiplies it by every row while it
// sits in L1: bandwidth-bound like a decode step for M up to ~8. AVX-512 BF16 (vdpbf16ps: 32 bf16 products into
// 16 float32 lanes per instruction); built on first use only where the CPU has it (kernels/__init__.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int NB = 8;  // weight rows per block: 8 independent accumulator chains hide vdpbf16ps's latency
constexpr int MB = 2;  // input rows per pass over a block (2 x 8 accumulators + 8 weight registers fit 32)
constexpr int PREFETCH = 2;  // blocks ahead

inline __mmask32 tail_mask(int64_t rest) { return rest >= 32 ? ~__mmask32(0) : (__mmask32(1) << rest) - 1; }

inline __m512bh load(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }
inline __m512bh load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// Sum each of four accumulators' 16 lanes: out[j] = sum(a_j).
inline void hsum4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  auto half = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  __m256 ab = _mm256_hadd_ps(half(a), half(b)), cd = _mm256_hadd_ps(half(c), half(d));
  __m256 abcd = _mm256_hadd_ps(ab, cd);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

inline uint16_t store_bf16(float v) { return c10::BFloat16(v).x; }  // round to nearest even, NaN kept

// One weight row n against every input row (the N % NB tail).
void row(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N, int64_t K,
         int64_t n) {
  for (int64_t m = 0; m < M; m++) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __mmask32 mk = tail_mask(K - k);
      acc = _mm512_dpbf16_ps(acc, load(x + m * K + k, mk), load(w + n * K + k, mk));
    }
    float s = _mm512_reduce_add_ps(acc) + (bias ? bf16_to_float(bias[n]) : 0.f);
    y[m * N + n] = store_bf16(s);
  }
}

// Weight rows n0 .. n0 + NB - 1 against every input row, MB input rows at a time.
void block(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N, int64_t K,
           int64_t n0) {
  const uint16_t* w0 = w + n0 * K;
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mm = M - m0 < MB ? M - m0 : MB;
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; i++)
      for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    // whole 32-element steps with plain loads (masked loads in the main loop cost ~20% of the bandwidth),
    // then one masked step for K % 32
    auto step = [&](int64_t k, __mmask32 mk, bool masked) {
      __m512bh wv[NB];
      for (int j = 0; j < NB; j++) wv[j] = masked ? load(w0 + j * K + k, mk) : load(w0 + j * K + k);
      // the block after next, on the first pass over this one: +7% bandwidth (a prefetch past the end of the
      // weight does not fault)
      if (m0 == 0)
        for (int j = 0; j < NB; j++) _mm_prefetch(reinterpret_cast<const char*>(w0 + (PREFETCH * NB + j) * K + k), _MM_HINT_T0);
      for (int i = 0; i < MB; i++) {
        if (i >= mm) break;
        __m512bh xv = masked ? load(x + (m0 + i) * K + k, mk) : load(x + (m0 + i) * K + k);
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
      }
    };
    const int64_t whole = K / 32 * 32;
    for (int64_t k = 0; k < whole; k += 32) step(k, 0, false);
    if (whole < K) step(whole, tail_mask(K - whole), true);
    for (int i = 0; i < mm; i++) {
      float s[NB];
      for (int q = 0; q < NB; q += 4) hsum4(acc[i][q], acc[i][q + 1], acc[i][q + 2], acc[i][q + 3], s + q);
      for (int j = 0; j < NB; j++)
        y[(m0 + i) * N + n0 + j] = store_bf16(s[j] + (bias ? bf16_to_float(bias[n0 + j]) : 0.f));
    }
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "small_linear: bf16 only");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "small_linear: x [..., K], w [N, K]");
  const int64_t K = w.size(1), N = w.size(0);
  at::Tensor xc = x.reshape({-1, K}).contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N, "small_linear: bias bf16 [N]");
    bc = bias->contiguous();
  }
  auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  auto* bp = bc.defined() ? reinterpret_cast<const uint16_t*>(bc.data_ptr()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t blocks = N / NB;
  // at least ~64 KB of weights per task, so small layers do not pay for waking threads
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (NB * K * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) block(xp, wp, bp, yp, M, N, K, b * NB);
  });
  for (int64_t n = blocks * NB; n < N; n++) row(xp, wp, bp, yp, M, N, K, n);
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY(rlspec_kernels, m) { m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(rlspec_kernels, CPU, m) { m.impl("small_linear", &small_linear); }
