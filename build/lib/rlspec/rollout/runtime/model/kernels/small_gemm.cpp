// rlspec_kernels: y = x @ w^T (+ bias) for bf16 x [M, K] with few rows (M <= 16) and bf16 w [N, K], float32
// accumulation, rounded once to bf16 (round to nearest even), as torch's matmul rounds. Two entry points:
//   small_linear(x, w, bias)          w row-major [N, K], as a module holds it;
//   packed_linear(x, wp, bias, N)     w in the blocked layout of `pack`: [ceil(N/8), ceil(K/32), 8, 32], zero-padded.
// Both compute the same products in the same order, so they agree bit for bit.
//
// Why (docs/runtime.md#verify-steps-on-the-cpu): a speculative verify step at batch 1 multiplies every weight by
// 2-16 rows. oneDNN reorders the weight on every unpacked call (~8 GB/s), and inside a compiled step inductor
// cannot use pre-packed weights, so a compiled verify step ran at a third of the memory bandwidth. This kernel
// reads each weight once per call and multiplies it by every row while it sits in L1. Row-major, a block of 8
// weight rows is 8 strided streams; blocked, each thread reads one contiguous stream, which the hardware
// prefetcher follows better: 1.15-1.35x the bandwidth at 1-4 rows (docs/runtime.md). AVX-512 BF16
// (vdpbf16ps: 32 bf16 products into 16 float32 lanes per instruction); built on first use only where the CPU
// has it (kernels/__init__.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>

namespace {

using namespace rlspec_simd;

constexpr int NB = 8;  // weight rows per block: 8 independent accumulator chains hide vdpbf16ps's latency
constexpr int MB = 2;  // input rows per pass over a block (2 x 8 accumulators + 8 weight registers fit 32)
constexpr int PREFETCH = 2;  // row-major: blocks ahead
constexpr int BLOCKED_AHEAD = 4096;  // blocked: bytes ahead in the stream

inline __mmask32 tail_mask(int64_t rest) { return rest >= 32 ? ~__mmask32(0) : (__mmask32(1) << rest) - 1; }

inline __m512bh load(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }
inline __m512bh load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }


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

// Where weight row n0 + j's elements k .. k + 31 live. RowMajor: the module's [N, K]; its last 32-element step is
// read masked, and a software prefetch two blocks ahead helps its strided streams (+7%). Blocked: `pack`'s layout,
// one contiguous stream per block, zero-padded (so never masked), no prefetch (the hardware's is better).
struct RowMajor {
  const uint16_t* w;
  int64_t K;
  static constexpr bool padded = false;
  const uint16_t* at(int64_t n0, int j, int64_t k) const { return w + (n0 + j) * K + k; }
};
struct Blocked {
  const uint16_t* w;
  int64_t KC;  // 32-element steps per row, K rounded up
  static constexpr bool padded = true;
  const uint16_t* at(int64_t n0, int j, int64_t k) const { return w + ((n0 / NB * KC + k / 32) * NB + j) * 32; }
};

// Weight rows n0 .. n0 + valid - 1 (valid <= NB) against every input row, MB input rows at a time.
template <typename W>
void block(const uint16_t* x, W w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N, int64_t K, int64_t n0,
           int valid) {
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mm = M - m0 < MB ? M - m0 : MB;
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; i++)
      for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    // whole 32-element steps with plain loads (masked loads in the main loop cost ~20% of the bandwidth),
    // then one masked step for K % 32
    auto step = [&](int64_t k, __mmask32 mk, bool masked) {
      __m512bh wv[NB];
      for (int j = 0; j < NB; j++) wv[j] = masked && !W::padded ? load(w.at(n0, j, k), mk) : load(w.at(n0, j, k));
      if (m0 == 0) {  // a prefetch past the end of the weight does not fault
        if (W::padded)  // the stream BLOCKED_AHEAD bytes on, into L2
          for (int j = 0; j < NB; j++)
            _mm_prefetch(reinterpret_cast<const char*>(w.at(n0, j, k) + BLOCKED_AHEAD / 2), _MM_HINT_T1);
        else
          for (int j = 0; j < NB; j++)
            _mm_prefetch(reinterpret_cast<const char*>(w.at(n0 + PREFETCH * NB, j, k)), _MM_HINT_T0);
      }
      for (int i = 0; i < MB; i++) {
        if (i >= mm) break;
        __m512bh xv = masked ? load(x + (m0 + i) * K + k, mk) : load(x + (m0 + i) * K + k);
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
      }
    };
    const int64_t whole = K / 32 * 32;
    for (int64_t k = 0; k < whole; k += 32) step(k, 0, false);
    if (whole < K) step(whole, tail_mask(K - whole), true);
    // the 8 sums of each row at once, rounded and stored together: done one by one, this epilogue was a third of
    // a several-row product's instructions at K = 576
    const __mmask8 live = valid >= NB ? __mmask8(0xFF) : __mmask8((1u << valid) - 1);
    const __m256 b = bias ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                _mm256_cvtepu16_epi32(_mm_maskz_loadu_epi16(live, bias + n0)), 16))
                          : _mm256_setzero_ps();
    for (int i = 0; i < mm; i++)
      _mm_mask_storeu_epi16(y + (m0 + i) * N + n0, live, store_bf16x8(_mm256_add_ps(hsum8(acc[i]), b)));
  }
}

// The bias as a raw pointer (nullptr: none; checked against N by the caller).
const uint16_t* bias_ptr(const c10::optional<at::Tensor>& bias, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  return reinterpret_cast<const uint16_t*>(keep.data_ptr());
}

// Blocks [0, blocks) over torch's thread pool: at least ~64 KB of weights per task, so that small layers do not
// pay for waking threads.
template <typename F>
void over_blocks(int64_t blocks, int64_t K, const F& f) {
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (NB * K * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) f(b);
  });
}

// What both ops do around the weight: x as M contiguous rows of K, the [M, N] output, the bias; `result` gives y
// back in x's leading shape.
struct Call {
  at::Tensor xc, y, bc;
  const uint16_t *x, *bias;
  uint16_t* out;
  int64_t M, N;
  Call(const at::Tensor& x_, const c10::optional<at::Tensor>& bias_, int64_t K, int64_t N_)
      : xc(x_.reshape({-1, K}).contiguous()), y(at::empty({xc.size(0), N_}, x_.options())),
        x(reinterpret_cast<const uint16_t*>(xc.data_ptr())), bias(bias_ptr(bias_, bc)),
        out(reinterpret_cast<uint16_t*>(y.data_ptr())), M(xc.size(0)), N(N_) {}
  at::Tensor result(const at::Tensor& x_) const {
    auto shape = x_.sizes().vec();
    shape.back() = N;
    return y.view(shape);
  }
};

}  // namespace

namespace rlspec_kernels {

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_tensor("small_linear", "x", x, at::kBFloat16);
  check_tensor("small_linear", "w", w, at::kBFloat16);
  TORCH_CHECK(w.dim() == 2 && w.size(1) > 0 && x.dim() >= 1 && x.size(-1) == w.size(1),
              "small_linear: x [..., K] and w [N, K] with K > 0; got x ", x.sizes(), ", w ", w.sizes());
  const int64_t K = w.size(1), N = w.size(0), blocks = N / NB;
  check_bias("small_linear", "bias", bias, N);
  const at::Tensor wc = w.contiguous();
  const RowMajor wl{reinterpret_cast<const uint16_t*>(wc.data_ptr()), K};
  const Call c(x, bias, K, N);
  over_blocks(blocks, K, [&](int64_t b) { block(c.x, wl, c.bias, c.out, c.M, N, K, b * NB, NB); });
  for (int64_t n = blocks * NB; n < N; n++) row(c.x, wl.w, c.bias, c.out, c.M, N, K, n);  // past the last block
  return c.result(x);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                         int64_t N) {
  check_tensor("packed_linear", "x", x, at::kBFloat16);
  TORCH_CHECK(x.dim() >= 1, "packed_linear: x [..., K], got a 0-dim tensor");
  const int64_t K = x.size(-1), KC = (K + 31) / 32, blocks = (N + NB - 1) / NB;
  check_packed("packed_linear", "wp", wp, N, K);
  check_bias("packed_linear", "bias", bias, N);
  const Blocked wl{reinterpret_cast<const uint16_t*>(wp.data_ptr()), KC};
  const Call c(x, bias, K, N);
  over_blocks(blocks, K, [&](int64_t b) {  // the last block zero-padded: only its first N - b * NB rows are stored
    block(c.x, wl, c.bias, c.out, c.M, N, K, b * NB, static_cast<int>(std::min<int64_t>(NB, N - b * NB)));
  });
  return c.result(x);
}

}  // namespace rlspec_kernels

TORCH_LIBRARY(rlspec_kernels, m) {
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor wp, Tensor? bias, int N) -> Tensor");
}
TORCH_LIBRARY_IMPL(rlspec_kernels, CPU, m) {
  m.impl("small_linear", &rlspec_kernels::small_linear);
  m.impl("packed_linear", &rlspec_kernels::packed_linear);
}
