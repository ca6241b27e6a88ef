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

inline uint16_t store_bf16(float v) { return c10::BFloat16(v).x; }  // round to nearest even, NaN kept

}  // namespace rlspec_simd
