/* Sixteen float lanes, summed alike on AVX-512 and on AVX2 with FMA (two 8-lane halves): a dot product split into
   16 lanes of every 16th column, each lane's products added by fused multiply-adds in column order, then the lanes
   added as _mm512_reduce_add_ps adds them in GCC (halves, quarters, pairs). A sum computed with these is the same
   to the bit on both kinds of CPU. Elsewhere LANES16 is undefined and the kernels take their plain C paths. */
#ifndef PQCACHE_LANES16_H
#define PQCACHE_LANES16_H
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES16 1
typedef __m512 f16x;
static inline f16x f16_zero(void) { return _mm512_setzero_ps(); }
static inline f16x f16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline f16x f16_fmadd(f16x a, f16x b, f16x c) { return _mm512_fmadd_ps(a, b, c); }
static inline f16x f16_add(f16x a, f16x b) { return _mm512_add_ps(a, b); }
static inline float f16_sum(f16x a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES16 1
typedef struct {
  __m256 lo, hi; /* lanes 0-7, 8-15 */
} f16x;
static inline f16x f16_zero(void) { return (f16x){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline f16x f16_load(const float *p) { return (f16x){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline f16x f16_fmadd(f16x a, f16x b, f16x c) {
  return (f16x){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline f16x f16_add(f16x a, f16x b) { return (f16x){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline float f16_sum(f16x a) {
  __m256 half = _mm256_add_ps(a.hi, a.lo);                                                  /* lane i + lane i+8 */
  __m128 quarter = _mm_add_ps(_mm256_extractf128_ps(half, 1), _mm256_castps256_ps128(half)); /* i + i+4 */
  __m128 pair = _mm_add_ps(quarter, _mm_shuffle_ps(quarter, quarter, _MM_SHUFFLE(1, 0, 3, 2))); /* i + i+2 */
  return _mm_cvtss_f32(pair) + _mm_cvtss_f32(_mm_shuffle_ps(pair, pair, 1));
}
#endif
/* a . b over n floats: 32 at a time in two 16-lane sums (then added as above), the last n % 32 one by one; plain C
   where LANES16 is undefined. layer_step.c's scores and pq_codes.c's tables and codes. */
static inline float lanes_dot(const float *a, const float *b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#if defined(LANES16)
  f16x s0 = f16_zero(), s1 = s0;
  for (; i + 32 <= n; i += 32) {
    s0 = f16_fmadd(f16_load(a + i), f16_load(b + i), s0);
    s1 = f16_fmadd(f16_load(a + i + 16), f16_load(b + i + 16), s1);
  }
  s = f16_sum(f16_add(s0, s1));
#endif
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}
#endif
