// Helpers the CPU kernels share (AVX-512): horizontal sums and bf16 <-> float32.
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace rlspec_simd {

// Sum each of four accumulators' 16 lanes: out[j] = sum(a_j).
inline void hsum4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  auto half = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  __m256 ab = _mm256_hadd_ps(half(a), half(b)), cd = _mm256_hadd_ps(half(c), half(d));
  __m256 abcd = _mm256_hadd_ps(ab, cd);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

// Sum each of eight accumulators' 16 lanes: lane j of the result = sum(a[j]).
inline __m256 hsum8(const __m512* a) {
  __m256 h[8];
  for (int j = 0; j < 8; j++)
    h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
  const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// Eight float32 lanes rounded to bf16 exactly as c10::BFloat16 rounds one (nearest even; NaN -> 0x7FC0).
inline __m128i store_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_mask_blend_epi32(_mm256_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm256_set1_epi32(0x7FC0));
  return _mm256_cvtepi32_epi16(r);
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// 16 bf16 values at p as float32 lanes (exact: a bf16 is a float32's upper half).
inline __m512 bf16x16_to_f32(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// exp(x) for x <= 0 (scores minus their running maximum), 16 lanes: 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5],
// 2^f by its degree-7 Taylor polynomial (relative error < 1e-7); lanes below -87 (masked keys: -inf) give 0.
inline __m512 exp_nonpos(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(live, p, n);
}

inline uint16_t store_bf16(float v) { return c10::BFloat16(v).x; }  // round to nearest even, NaN kept

}  // namespace rlspec_simd
