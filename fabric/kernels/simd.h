// Sixteen fp32 lanes, the vector the CPU kernels are written in: one AVX-512 register where the module is built
// with -mavx512f, two AVX2 registers where it is built with -mavx2 -mfma (skinny.py picks the flags from the CPU).
// Every op is lane-wise, and the reductions combine lanes in the tree of GCC's _mm512_reduce_add_ps (the upper
// eight onto the lower, then four, then two, then one), so both builds give the same floats, bit for bit.
//
// Legend: a mask (`tail(n)`) holds the first min(n, 16) lanes; a masked load reads zeros past them and never
// touches their memory.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace simd {

#if defined(__AVX512F__)

struct V16 {
  __m512 v;
};
using Mask = __mmask16;

inline Mask tail(int64_t n) { return n >= 16 ? static_cast<Mask>(0xFFFF) : static_cast<Mask>((1u << n) - 1); }  // n >= 0
inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 load(const float* p, Mask m) { return {_mm512_maskz_loadu_ps(m, p)}; }
inline void store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline void store(float* p, Mask m, V16 a) { _mm512_mask_storeu_ps(p, m, a.v); }
inline V16 load(const float* p, Mask m, V16 fill) { return {_mm512_mask_loadu_ps(fill.v, m, p)}; }  // fill past m
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 add(Mask m, V16 a, V16 b) { return {_mm512_mask_add_ps(a.v, m, a.v, b.v)}; }  // a + b in m, a past it
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }    // a b + c, one rounding
inline V16 fnmadd(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a b, one rounding
inline V16 round_nearest(V16 a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline V16 times_pow2(V16 p, V16 n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p 2^n, n whole, in [-126, 127]
inline float reduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(V16 a) { return _mm512_reduce_max_ps(a.v); }

#else  // AVX2 and FMA: lanes 0-7 in lo, 8-15 in hi

struct V16 {
  __m256 lo, hi;
};
struct Mask {
  __m256i lo, hi;
};

inline int64_t clamp16(int64_t n) { return n < 0 ? 0 : n > 16 ? 16 : n; }
inline __m256i first(int64_t n) {  // lanes i < n of eight
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Mask tail(int64_t n) { return {first(clamp16(n)), first(clamp16(n) - 8)}; }
inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 load(const float* p, Mask m) { return {_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi)}; }
inline void store(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void store(float* p, Mask m, V16 a) {
  _mm256_maskstore_ps(p, m.lo, a.lo);
  _mm256_maskstore_ps(p + 8, m.hi, a.hi);
}
inline V16 select(Mask m, V16 a, V16 b) {  // m ? a : b (the two masked ops below; AVX-512 has them as instructions)
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_castsi256_ps(m.lo)), _mm256_blendv_ps(b.hi, a.hi, _mm256_castsi256_ps(m.hi))};
}
inline V16 load(const float* p, Mask m, V16 fill) { return select(m, load(p, m), fill); }  // fill past m
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 add(Mask m, V16 a, V16 b) { return select(m, add(a, b), a); }  // a + b in m, a past it
inline V16 sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 fnmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 round_nearest(V16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline __m256 pow2(__m256 n) {  // 2^n for whole n in [-126, 127]: the exponent field set, exact
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 times_pow2(V16 p, V16 n) {  // as scalef: one product by an exact power of two, one rounding
  return {_mm256_mul_ps(p.lo, pow2(n.lo)), _mm256_mul_ps(p.hi, pow2(n.hi))};
}
template <typename Op>
inline float reduce(V16 a, Op op) {  // _mm512_reduce_*_ps's tree
  const __m256 t3 = op(a.hi, a.lo);
  const __m128 t6 = op(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = op(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(op(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}
inline float reduce_add(V16 a) {
  return reduce(a, [](auto x, auto y) {
    if constexpr (sizeof(x) == 32) return _mm256_add_ps(x, y); else return _mm_add_ps(x, y);
  });
}
inline float reduce_max(V16 a) {
  return reduce(a, [](auto x, auto y) {
    if constexpr (sizeof(x) == 32) return _mm256_max_ps(x, y); else return _mm_max_ps(x, y);
  });
}

#endif

}  // namespace simd
