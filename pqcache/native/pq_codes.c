/* A PQ layer's two small products of a decode step (methods/pqcache.py's search, layer/index.py's encode): the
   query's lookup tables and the new key's codes. Each is a few thousand multiply-adds over the codebooks (256 KB
   for the bundled model's 4 sub-spaces of 64 dimensions), which torch spends in a batched matmul and the half dozen
   reshapes around it: 0.10 and 0.17 ms a layer at a step, where these take a few microseconds (Zen 3, ad hoc).

   Each entry is a float32 dot product summed in lanes16.h's fixed order (lanes_dot), not a matmul's: the
   tables and the codes' scores differ from torch's in the last bits, so a code can differ from torch's only where
   two centroids are within rounding of each other.

   A decode step needs both from one codebook: pq_tables_codes computes them in one pass over the centroids, which
   the step (pq_step.c) would otherwise read twice, the second time mostly from memory. */
#include <math.h>
#include <stdint.h>

#include "lanes16.h" /* lanes_dot */

/* q (R, m d): R query rows; centroids (m, C, d) -> tables (m, C, R): tables[j][c][r] = q_r's sub-vector j . c.
   And where key (m d,) is not NULL, codes[j * stride], j < m: the centroid c of sub-space j with the largest
   key_j . c - half_norm[j][c] (the nearest, ||key_j - c||^2 = ||key_j||^2 - 2 (that)), or of key_j . c where
   half_norm is NULL (the "ip" metric); the first of equal scores, as torch's argmax takes it. And where residual
   is not NULL, *residual = ||key - its codes' centroids|| (index.py's residuals: the first stage's margin). */
void pq_tables_codes(const float *q, int64_t R, const float *centroids, int64_t m, int64_t C, int64_t d, float *tables,
                     const float *key, const float *half_norm, uint8_t *codes, int64_t stride, float *residual) {
  float squared = 0.0f;
  for (int64_t j = 0; j < m; j++) {
    int64_t best = 0;
    float top = 0.0f;
    for (int64_t c = 0; c < C; c++) {
      const float *centroid = centroids + (j * C + c) * d;
      for (int64_t r = 0; r < R; r++) tables[(j * C + c) * R + r] = lanes_dot(q + r * m * d + j * d, centroid, d);
      if (!key) continue;
      float s = lanes_dot(key + j * d, centroid, d) - (half_norm ? half_norm[j * C + c] : 0.0f);
      if (c == 0 || s > top) {
        top = s;
        best = c;
      }
    }
    if (!key) continue;
    codes[j * stride] = (uint8_t)best;
    if (!residual) continue;
    const float *centroid = centroids + (j * C + best) * d;
    for (int64_t i = 0; i < d; i++) {
      float diff = key[j * d + i] - centroid[i];
      squared += diff * diff;
    }
  }
  if (key && residual) *residual = sqrtf(squared);
}

void pq_tables(const float *q, int64_t R, const float *centroids, int64_t m, int64_t C, int64_t d, float *tables) {
  pq_tables_codes(q, R, centroids, m, C, d, tables, NULL, NULL, NULL, 0, NULL);
}

void pq_encode(const float *key, const float *centroids, const float *half_norm, int64_t m, int64_t C, int64_t d,
               uint8_t *codes, int64_t stride, float *residual) {
  pq_tables_codes(NULL, 0, centroids, m, C, d, NULL, key, half_norm, codes, stride, residual);
}
