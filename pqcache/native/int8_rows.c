/* y (R, N) = x (R, K) . q (N, K)^T * scale (N,): int8 weight rows times a few float rows, at the memory's pace.

   A decode step multiplies one row by every weight once, so the weights' bytes set its time: torch 2.13's CPU
   kernel for int8 rows (_weight_int8pack_mm) reads them at a fifth of the rate the memory streams
   (`python -m pqcache bench kernels`). This one streams each weight row once, front to back, as int8.

   Each row of x is first rounded to int16 with one scale (x ~ xq * xs, |x - xq * xs| <= xs / 2 = max|x| / 65534):
   finer than the bf16 rounding torch's kernel applies to x (2^-9 of each value). The dot products are then exact
   integer sums (int16 x int8 products: AVX-512 VNNI's vpdpwssd where the CPU has it, AVX2's vpmaddwd pairs where
   it has that, plain C elsewhere: the same integers every way), and y = float(sum) * xs * scale.

   Overflow: a product is at most 32767 * 127 < 2^22; one int32 lane of the vector path adds 256 of them per
   block of BLOCK columns (4 accumulators x 64), under 2^30, before the block's sum moves to int64; on AVX2 a lane
   of each of two accumulators adds 128 pairs of products per block, and the two are added before the move: 256
   pairs, at most 256 x 2 x 128 x 32767 = 2,147,418,112 < 2^31 (tests/unit/test_native.py sums the largest). The plain
   path (a CPU without AVX-512 VNNI, and the vector path's last columns) sums at most PLAIN columns in one int32:
   512 products are under 2^31 (a block of 4096 wrapped around on an AVX2 CPU: tests/unit/test_native.py). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define MADD 1 /* AVX2 without VNNI (Zen 3): the auto-vectorized plain loop read the LM head at 0.81 of the stream */
#endif

#define BLOCK 4096 /* columns summed in int32 lanes before the sum moves to int64 (see overflow above) */
#define PLAIN 512   /* columns the plain path sums in one int32 (512 * 32767 * 127 < 2^31) */
#define MAX_THREADS 64 /* threads the candidate test splits its rows between */

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
#elif defined(MADD)
    /* two accumulators of 8 int32 lanes; vpmaddwd adds each pair of adjacent int16 x int16 products */
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (; k + 32 <= k1; k += 32) {
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k))),
                                                  _mm256_loadu_si256((const __m256i *)(x + k))));
      a1 = _mm256_add_epi32(a1,
                            _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k + 16))),
                                              _mm256_loadu_si256((const __m256i *)(x + k + 16))));
    }
    for (; k + 16 <= k1; k += 16)
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k))),
                                                  _mm256_loadu_si256((const __m256i *)(x + k))));
    __m256i a = _mm256_add_epi32(a0, a1);
    __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(a)),
                                    _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a, 1)));
    __m128i pair = _mm_add_epi64(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
    total += _mm_cvtsi128_si64(pair) + _mm_extract_epi64(pair, 1);
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

/* x (R, K) -> xq (R, K) int16 and xs (R,): each row rounded with one scale, x ~ xq * xs */
static void round_rows(const float *x, int64_t R, int64_t K, int16_t *xq, float *xs) {
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
}

/* The calling thread's share of N weight rows, n0..n1, read as two runs of `half` rows, a row of each in turn: two
   streams in flight per core, which the prefetchers follow (one stream a core left Zen 3's decoder linears at 0.55 of
   the memory's rate; two: 0.6 ms less a step over the 72 matrices, 1 ms less on the LM head, an A/B of compiled
   variants, ad hoc). Called inside a parallel region. */
static void share(int64_t N, int64_t *n0, int64_t *n1, int64_t *half) {
  int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
  *n0 = N * t / T;
  *n1 = N * (t + 1) / T;
  *half = (*n1 - *n0 + 1) / 2;
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
  round_rows(x, R, K, xq, xs);
#pragma omp parallel
  {
    int64_t n0, n1, half;
    share(N, &n0, &n1, &half);
    for (int64_t i = 0; i < half; i++)
      for (int64_t n = n0 + i; n < n1; n += half)
        for (int64_t r = 0; r < R; r++) y[r * N + n] = (float)dot_row(q + n * K, xq + r * K, K) * xs[r] * scale[n];
  }
  free(xq);
  free(xs);
  return 0;
}

/* score v of row n's bound: coef[0] * slack[n] + coef[1] * slack[N + n] + |v| * rounding (one function, so that
   both passes below compute it by the same operations) */
static inline float bound(float v, const float *coef, const float *slack, float rounding, int64_t n, int64_t N) {
  return coef[0] * slack[n] + coef[1] * slack[N + n] + fabsf(v) * rounding;
}

/* The exact-argmax LM head's first test in one pass over the weights (fastpath/lmhead.py), for one row x (K,): y (N,)
   as int8_rows_mm computes it, each score's bound b[n] = coef[0] * slack[n] + coef[1] * slack[N + n] + |y[n]| *
   rounding (slack: (2, N)), and the rows that can win, y[n] + b[n] >= max over all rows of y - b, into cand in row
   order. In torch the bound, the maximum and the test were eight passes over N floats after the kernel's (1.5 ms a
   step of the bundled model's 262,144 rows here). Returns how many rows can win (only the first max_cand are
   written), or -1 when the scratch row could not be allocated. A row x with an inf or a NaN: NaN scores, none can
   win (0). */
int64_t int8_rows_candidates(const float *x, const int8_t *q, const float *scale, const float *slack,
                             const float *coef, float rounding, float *y, int64_t *cand, int64_t max_cand, int64_t N,
                             int64_t K) {
  int16_t *xq = malloc(sizeof(int16_t) * K);
  float xs, floor = -INFINITY;
  if (xq == NULL) return -1;
  round_rows(x, 1, K, xq, &xs);
#pragma omp parallel reduction(max : floor)
  {
    int64_t n0, n1, half;
    share(N, &n0, &n1, &half);
    for (int64_t i = 0; i < half; i++)
      for (int64_t n = n0 + i; n < n1; n += half) {
        float v = (float)dot_row(q + n * K, xq, K) * xs * scale[n];
        float lower = v - bound(v, coef, slack, rounding, n, N);
        y[n] = v;
        floor = lower > floor ? lower : floor;
      }
  }
  free(xq);
  /* the test, each thread over its share of the rows: a count, then the rows written after the earlier threads'
     (one thread over 262,144 rows left the other idle for about 0.4 ms a step, perf, ad hoc) */
  int64_t counts[MAX_THREADS] = {0};
#pragma omp parallel num_threads(omp_get_max_threads() < MAX_THREADS ? omp_get_max_threads() : MAX_THREADS)
  {
    int64_t T = omp_get_num_threads(), t = omp_get_thread_num(), n0 = N * t / T, n1 = N * (t + 1) / T, c = 0;
    for (int64_t n = n0; n < n1; n++) c += y[n] + bound(y[n], coef, slack, rounding, n, N) >= floor;
    counts[t] = c;
#pragma omp barrier
    int64_t at = 0;
    for (int64_t u = 0; u < t; u++) at += counts[u];
    for (int64_t n = n0; n < n1; n++)
      if (y[n] + bound(y[n], coef, slack, rounding, n, N) >= floor) {
        if (at < max_cand) cand[at] = n;
        at++;
      }
  }
  int64_t count = 0;
  for (int u = 0; u < MAX_THREADS; u++) count += counts[u];
  return count;
}
