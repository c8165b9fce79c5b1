/* y (R, N) = x (R, K) . q (N, K)^T * scale (N,): int8 weight rows times a few float rows, at the memory's pace.

   A decode step multiplies one row by every weight once, so the weights' bytes set its time: torch 2.13's CPU
   kernel for int8 rows (_weight_int8pack_mm) reads them at a fifth of the rate the memory streams
   (`python -m pqcache bench kernels`). This one streams each weight row once, front to back, as int8.

   Each row of x is first rounded to int16 with one scale (x ~ xq * xs, |x - xq * xs| <= xs / 2 = max|x| / 65534):
   finer than the bf16 rounding torch's kernel applies to x (2^-9 of each value). The dot products are then exact
   integer sums (int16 x int8 products, AVX-512 VNNI's vpdpwssd where the CPU has it, plain C elsewhere: the
   same integers either way), and y = float(sum) * xs * scale.

   Overflow: a product is at most 32767 * 127 < 2^22; one int32 lane of the vector path adds 256 of them per
   block of BLOCK columns (4 accumulators x 64), under 2^30, before the block's sum moves to int64. The plain
   path (a CPU without AVX-512 VNNI, and the vector path's last columns) sums at most PLAIN columns in one int32:
   512 products are under 2^31 (a block of 4096 wrapped around on an AVX2 CPU: tests/test_native.py). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VNNI 1
#endif

#define BLOCK 4096 /* columns summed in int32 lanes before the sum moves to int64 (see overflow above) */
#define PLAIN 512   /* columns the plain path sums in one int32 (512 * 32767 * 127 < 2^31) */

static int64_t dot_row(const int8_t *w, const int16_t *x, int64_t K) {
  int64_t total = 0;
  for (int64_t k0 = 0; k0 < K; k0 += BLOCK) {
    int64_t k1 = k0 + BLOCK < K ? k0 + BLOCK : K, k = k0;
#ifdef VNNI
    /* four independent accumulators: one add chain would wait on vpdpwssd's latency every 32 columns */
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 128 <= k1; k += 128) {
      a0 = _mm512_dpwssd_epi32(a0, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k))),
                               _mm512_loadu_si512(x + k));
      a1 = _mm512_dpwssd_epi32(a1, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k + 32))),
                               _mm512_loadu_si512(x + k + 32));
      a2 = _mm512_dpwssd_epi32(a2, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k + 64))),
                               _mm512_loadu_si512(x + k + 64));
      a3 = _mm512_dpwssd_epi32(a3, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k + 96))),
                               _mm512_loadu_si512(x + k + 96));
    }
    for (; k + 32 <= k1; k += 32)
      a0 = _mm512_dpwssd_epi32(a0, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k))),
                               _mm512_loadu_si512(x + k));
    __m512i a = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
    total += _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(a)),
                                                      _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1))));
#endif
    while (k < k1) {
      int64_t k2 = k + PLAIN < k1 ? k + PLAIN : k1;
      int32_t rest = 0;
      for (; k < k2; k++) rest += (int32_t)w[k] * (int32_t)x[k];
      total += rest;
    }
  }
  return total;
}

/* Returns 0, or -1 when the scratch row could not be allocated (y untouched). */
int int8_rows_mm(const float *x, const int8_t *q, const float *scale, float *y, int64_t R, int64_t N, int64_t K) {
  int16_t *xq = malloc(sizeof(int16_t) * R * K);
  float *xs = malloc(sizeof(float) * R);
  if (xq == NULL || xs == NULL) {
    free(xq);
    free(xs);
    return -1;
  }
  for (int64_t r = 0; r < R; r++) {
    float top = 0.0f;
    int finite = 1;
    for (int64_t k = 0; k < K; k++) {
      finite &= isfinite(x[r * K + k]);
      top = fmaxf(top, fabsf(x[r * K + k]));
    }
    /* a row with an inf or a NaN gives NaN outputs (as a float product would), not integers of garbage */
    xs[r] = !finite ? NAN : top > 0.0f ? top / 32767.0f : 1.0f;
    if (!finite) top = 0.0f;
    float inverse = top > 0.0f ? 32767.0f / top : 1.0f;
    for (int64_t k = 0; k < K; k++) xq[r * K + k] = (int16_t)lrintf(x[r * K + k] * inverse); /* nearest, ties even */
  }
  /* static schedule: each thread reads one contiguous run of weight rows, which the prefetchers follow */
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++)
    for (int64_t r = 0; r < R; r++) y[r * N + n] = (float)dot_row(q + n * K, xq + r * K, K) * xs[r] * scale[n];
  free(xq);
  free(xs);
  return 0;
}
