/* out (n, R) = keys[pos[i]] . q[r]: the re-rank's exact scores, read straight from the key store.

   PQCache's second stage scores its first-stage candidates (4x the budget: 13K of a 32K context) with their exact
   keys. In torch that is a gather (a copy of every candidate's key, 13 MB at 32K for the bundled model) and then a
   matmul over the copy; here each key is read once, where it lies, and dotted with up to 4 query rows at once,
   while the keys a few candidates ahead are already on their way (the positions are known, the hardware cannot
   guess them).

   The sums are float32 in a fixed order for every key (16 lanes of every 16th column, then the lanes added as a
   tree, lanes16.h): the same on every thread count and on AVX-512 and AVX2 CPUs, not torch's order, so the scores
   differ from a torch matmul's in the last bits. The store may hold float16 or bfloat16 rows (half_rows.h): each
   row is widened to float32 first, so the sums are those of a float32 store holding the same numbers. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "half_rows.h"
#include "lanes16.h"

#define AHEAD 8 /* keys prefetched ahead of the one being scored: 1.2-1.3 ms against 1.9 ms without, for 13K
                   sorted rows of a 32K store (4 to 32 ahead all alike; ad hoc, docs/benchmarks.md) */

static inline void prefetch_row(const void *row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b); /* a 64-byte line each */
}

/* one key against rows q[0..r_n) (r_n <= 4), D a multiple of 16 on the vector path */
static void dot_rows(const float *k, const float *q, int64_t r_n, int64_t D, float *out) {
#if defined(LANES16)
  if (D % 16 == 0) {
    f16x a0 = f16_zero(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += 16) {
      f16x kv = f16_load(k + d);
      a0 = f16_fmadd(kv, f16_load(q + d), a0);
      if (r_n > 1) a1 = f16_fmadd(kv, f16_load(q + D + d), a1);
      if (r_n > 2) a2 = f16_fmadd(kv, f16_load(q + 2 * D + d), a2);
      if (r_n > 3) a3 = f16_fmadd(kv, f16_load(q + 3 * D + d), a3);
    }
    out[0] = f16_sum(a0);
    if (r_n > 1) out[1] = f16_sum(a1);
    if (r_n > 2) out[2] = f16_sum(a2);
    if (r_n > 3) out[3] = f16_sum(a3);
    return;
  }
#endif
  for (int64_t r = 0; r < r_n; r++) {
    float total = 0.0f;
    for (int64_t d = 0; d < D; d++) total += k[d] * q[r * D + d];
    out[r] = total;
  }
}

/* keys: the store's first row (rows of D elements of `kind`, `stride` elements apart); pos (n,) int64 rows;
   q (R, D) */
void gather_dot(const void *keys, int kind, int64_t stride, const int64_t *pos, int64_t n, const float *q, int64_t R,
                int64_t D, float *out) {
  int64_t size = kv_bytes(kind);
#pragma omp parallel
  {
    float buf[kind == KV_F32 ? 1 : D]; /* a widened half row (D is a head's size: a few hundred floats) */
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) {
      if (i + AHEAD < n) prefetch_row((const char *)keys + pos[i + AHEAD] * stride * size, D * size);
      const float *k = row_as_float(keys, kind, stride, pos[i], D, buf);
      for (int64_t r0 = 0; r0 < R; r0 += 4) dot_rows(k, q + r0 * D, R - r0 < 4 ? R - r0 : 4, D, out + i * R + r0);
    }
  }
}

/* out (R, D) = sum over i of p[i * R + r] * values[pos[i]]: the attention's weighted sum over the picks, each
   value row read where it lies (the transpose of gather_dot: the picks' values are never gathered into a copy).
   Each thread sums its share of the rows into its own partial (R x D floats, R <= 4 on the vector path), and the
   partials are added in thread order. Returns 0, or -1 when the partials could not be allocated. */
int gather_weighted_sum(const void *values, int kind, int64_t stride, const int64_t *pos, int64_t n, const float *p,
                        int64_t R, int64_t D, float *out) {
  int threads = n >= 256 ? omp_get_max_threads() : 1;
  int64_t size = kv_bytes(kind);
  /* each thread's partial sums (R x D), then, for a half store, its widened row (D) */
  int64_t each = R * D + (kind == KV_F32 ? 0 : D);
  float *part = calloc((size_t)threads * each, sizeof(float));
  if (part == NULL) return -1;
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t i0 = n * t / nt, i1 = n * (t + 1) / nt;
    float *mine = part + (int64_t)t * each, *buf = mine + R * D;
    for (int64_t i = i0; i < i1; i++) {
      if (i + AHEAD < i1) prefetch_row((const char *)values + pos[i + AHEAD] * stride * size, D * size);
      const float *v = row_as_float(values, kind, stride, pos[i], D, buf);
      for (int64_t r = 0; r < R; r++) {
        float w = p[i * R + r], *o = mine + r * D;
        for (int64_t d = 0; d < D; d++) o[d] += w * v[d];
      }
    }
  }
  for (int64_t j = 0; j < R * D; j++) {
    float total = 0.0f;
    for (int t = 0; t < threads; t++) total += part[(int64_t)t * each + j];
    out[j] = total;
  }
  free(part);
  return 0;
}
