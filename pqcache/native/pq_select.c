/* PQCache's selection for one (row, KV head) of a decode step: the approximate scores from the codes, the GQA
   combine and the top-k with ties to the earliest positions, in one call (methods/pqcache.py's search), and the
   combine and top-k alone over the re-rank's exact scores (rerank_exact).

   In torch the first stage is about 140 operators a layer (embedding lookups over m sub-spaces and their sum, a
   masked softmax per query head, the sum over heads, top-k, the tie pass, the bookkeeping around them), several
   over every token of the context: about 2 ms a PQ layer at 32K tokens, against 0.4 ms here (docs/benchmarks.md).

   The combine is the same arithmetic as methods/base.combine_rows ("softmax_sum": a softmax over the candidates per
   query row, summed over the rows; "sum": the raw sum), with its own exp (exp_poly.h: a polynomial that vectorizes)
   and sums in a fixed order for every thread count. The combined scores therefore differ from torch's in the last
   bits; equal scores stay equal, so ties are still ties, and only two tokens within float rounding of each other could
   be ordered differently. The top-k is a radix selection of the k-th largest score (a histogram of every score's top
   11 bits, then two over the chosen bucket's few), then one pass that takes every score above it and the earliest
   positions at it: topk_positions' rule, with the picks in position order. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_poly.h" /* exp_nonpositive */
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define BLOCK 1024 /* tokens per partial sum: the softmax's denominators add the blocks' sums in order */
#define MAX_ROWS 16

/* The calls' working memory (about 2.3 MB at 32K tokens), kept per calling thread between calls: malloc would map
   and fault in fresh pages every call, which cost more than the selection itself (0.6 of 0.9 ms at 32K). Two areas:
   the search's (SEARCH) and the re-rank's combine (RERANK), so that pq_step.c's completion can read the search's
   rows after the re-rank's top-k (pq_search_rows). */
enum { SEARCH, RERANK };
static _Thread_local float *scratch[2];
static _Thread_local size_t scratch_floats[2];

static float *workspace(int area, size_t floats) {
  if (floats > scratch_floats[area]) {
    free(scratch[area]);
    scratch[area] = malloc(floats * sizeof(float));
    scratch_floats[area] = scratch[area] == NULL ? 0 : floats;
  }
  return scratch[area];
}

/* a float's order as an unsigned integer (larger float, larger key); NaN lowest */
static inline uint32_t order_key(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  if (f != f) return 0;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* sum of x[0..n) in a fixed order: 16 lanes, then the lanes in order */
static float lane_sum(const float *x, int64_t n) {
  float lanes[16] = {0};
  int64_t t = 0;
  for (; t + 16 <= n; t += 16)
    for (int j = 0; j < 16; j++) lanes[j] += x[t + j];
  for (; t < n; t++) lanes[t % 16] += x[t];
  float total = 0.0f;
  for (int j = 0; j < 16; j++) total += lanes[j];
  return total;
}

/* combined (n,) from scores (R, n), one row per query row; cand (n,) nonzero for candidates, NULL for all. Not
   candidates: -inf. sum_mode: the raw sum over rows, else softmax_sum, which leaves e (R, n) = exp(score - top[r])
   over the candidates (0 elsewhere) and top (R,) each row's largest score over them. e: R * n floats, partial: R *
   n / BLOCK + R floats of scratch. */
static void combine(const float *scores, int64_t n, int64_t R, const uint8_t *cand, int sum_mode, float *e,
                    float *partial, float *combined, float *top) {
  if (sum_mode) {
    for (int64_t t = 0; t < n; t++) combined[t] = scores[t];
    for (int64_t r = 1; r < R; r++)
      for (int64_t t = 0; t < n; t++) combined[t] += scores[r * n + t];
  } else {
    int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    float inverse[MAX_ROWS];
#pragma omp parallel for schedule(static) if (n >= 4 * BLOCK)
    for (int64_t r = 0; r < R; r++) {
      const float *s = scores + r * n;
      float best = -INFINITY;
      for (int64_t t = 0; t < n; t++) {
        float v = (cand == NULL || cand[t]) ? s[t] : -INFINITY;
        best = v > best ? v : best;
      }
      top[r] = best;
    }
    if (top[0] == -INFINITY) { /* no candidate */
      for (int64_t t = 0; t < n; t++) combined[t] = -INFINITY;
      return;
    }
    /* exponentials and their sums per block, in parallel; the blocks' sums added in order below: the same sums on
       every thread count */
#pragma omp parallel for collapse(2) schedule(static) if (n >= 4 * BLOCK)
    for (int64_t r = 0; r < R; r++)
      for (int64_t b = 0; b < n_blocks; b++) {
        int64_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        const float *s = scores + r * n;
        float *x = e + r * n, best = top[r];
        for (int64_t t = lo; t < hi; t++) x[t] = (cand == NULL || cand[t]) ? exp_nonpositive(s[t] - best) : 0.0f;
        partial[r * n_blocks + b] = lane_sum(x + lo, hi - lo);
      }
    for (int64_t r = 0; r < R; r++) {
      float z = 0.0f;
      for (int64_t b = 0; b < n_blocks; b++) z += partial[r * n_blocks + b];
      inverse[r] = 1.0f / z;
    }
    /* each thread its share of the tokens, the rows added in order and the non-candidates masked: the same
       operations on each token as one thread's loops */
#pragma omp parallel if (n >= 4 * BLOCK)
    {
      int64_t T = omp_get_num_threads(), i = omp_get_thread_num(), t0 = n * i / T, t1 = n * (i + 1) / T;
      for (int64_t t = t0; t < t1; t++) combined[t] = e[t] * inverse[0];
      for (int64_t r = 1; r < R; r++)
        for (int64_t t = t0; t < t1; t++) combined[t] += e[r * n + t] * inverse[r];
      if (cand != NULL)
        for (int64_t t = t0; t < t1; t++) combined[t] = cand[t] ? combined[t] : -INFINITY;
    }
    return;
  }
  if (cand != NULL)
    for (int64_t t = 0; t < n; t++) combined[t] = cand[t] ? combined[t] : -INFINITY;
}

/* pos (k,) = the k largest of combined (n,) (k <= n), ties at the k-th to the earliest, in position order. keys,
   near: n each of scratch. The first pass (the keys' top 11 bits) reads every key, split between the threads; the
   two after it read only the keys of the bucket it chose, gathered into near (a few hundred of 32K: 0.20 against
   0.07 ms here, ad hoc). */
static void top_positions(const float *combined, int64_t n, int64_t k, uint32_t *keys, uint32_t *near,
                          int64_t *pos) {
  if (k <= 0) return;
  static const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
  int64_t hist[2048] = {0}, count = 0;
#pragma omp parallel if (n >= 4 * BLOCK)
  {
    int64_t mine[2048] = {0};
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < n; t++) {
      keys[t] = order_key(combined[t]);
      mine[keys[t] >> 21]++;
    }
#pragma omp critical
    for (int b = 0; b < 2048; b++) hist[b] += mine[b];
  }
  uint32_t prefix = 0, mask = 0;
  int64_t want = k; /* how many of the keys matching the prefix are still to take */
  for (int p = 0; p < 3; p++) {
    uint32_t buckets = 1u << widths[p];
    if (p > 0) {
      for (int64_t b = 0; b < buckets; b++) hist[b] = 0;
      for (int64_t t = 0; t < count; t++) hist[(near[t] >> shifts[p]) & (buckets - 1)]++;
    }
    for (int64_t b = buckets - 1; b >= 0; b--) {
      if (hist[b] >= want) {
        prefix |= (uint32_t)b << shifts[p];
        mask |= (buckets - 1) << shifts[p];
        break;
      }
      want -= hist[b];
    }
    if (p == 0) /* the keys of the chosen bucket, for the later passes */
      for (int64_t t = 0; t < n; t++) {
        near[count] = keys[t];
        count += (keys[t] & mask) == prefix;
      }
    else { /* ...and of its chosen sub-bucket */
      int64_t kept = 0;
      for (int64_t t = 0; t < count; t++) {
        near[kept] = near[t];
        kept += (near[t] & mask) == prefix;
      }
      count = kept;
    }
  }
  /* prefix: the k-th largest key; want: how many of the keys equal to it are taken (the earliest) */
  int64_t j = 0, t = 0;
#if defined(__AVX2__)
  /* 8 keys at a time: a mask of those above the prefix (unsigned, as signed after flipping the top bit) and of the
     ties, then one write per pick; a loop with a branch per key mispredicted on the fifth of them taken at random
     (0.07 against 0.02 ms at 32K keys, ad hoc) */
  const __m256i flip = _mm256_set1_epi32((int)0x80000000u), level = _mm256_set1_epi32((int)(prefix ^ 0x80000000u));
  for (; t + 8 <= n && j < k; t += 8) {
    __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(keys + t)), flip);
    uint32_t above = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, level)));
    uint32_t tied = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(v, level)));
    for (; tied && want > 0; want--) { /* the earliest ties, while some are still wanted */
      above |= tied & -tied;
      tied &= tied - 1;
    }
    for (; above && j < k; above &= above - 1) pos[j++] = t + __builtin_ctz(above);
  }
#endif
  for (; t < n && j < k; t++) {
    if (keys[t] > prefix) {
      pos[j++] = t;
    } else if (keys[t] == prefix && want > 0) {
      pos[j++] = t;
      want--;
    }
  }
}

/* scores (R, n), cand (n,) or NULL -> pos (k,): combine, then the top k. work: (R + 3) * n + R * n / BLOCK + R
   floats. */
static void combined_top_of(const float *scores, int64_t n, int64_t R, const uint8_t *cand, int sum_mode,
                            int64_t k, float *work, int64_t *pos, float *top) {
  float *e = work, *combined = e + R * n, *partial = combined + 3 * n;
  combine(scores, n, R, cand, sum_mode, e, partial, combined, top);
  top_positions(combined, n, k, (uint32_t *)(combined + n), (uint32_t *)(combined + 2 * n), pos);
}

static size_t work_floats(int64_t n, int64_t R) { return (size_t)((R + 3) * n + R * (n / BLOCK + 1)); }

/* scores (n, R) row-major (the re-rank's exact scores), cand (n,) or NULL -> pos (k,). 0, or -1 without memory
   (or with more than MAX_ROWS rows). */
int combine_top(const float *scores, int64_t n, int64_t R, const uint8_t *cand, int sum_mode, int64_t k,
                int64_t *pos) {
  float *rows = R <= MAX_ROWS ? workspace(RERANK, (size_t)(R * n) + work_floats(n, R)) : NULL;
  float top[MAX_ROWS];
  if (rows == NULL) return -1;
  for (int64_t t = 0; t < n; t++)
    for (int64_t r = 0; r < R; r++) rows[r * n + t] = scores[t * R + r];
  combined_top_of(rows, n, R, cand, sum_mode, k, rows + R * n, pos, top);
  return 0;
}

/* One sub-space (m = 1, a head size of at most 64: SmolLM2, most small Llama-family models): a token's score rows
   are its code's, so the combine is computed per code, as methods/pqcache.select_by_tuples does in torch: the
   softmax's maximum over the codes the candidates hold, its denominator sum over codes of count x exp. Then each
   token takes its code's combined score: no exponential per token (0.03 against 0.10 ms a KV head at 8K tokens,
   R = 3, ad hoc). Tokens of one code have one score: their ties are exact, and go to the earliest. */
static void combined_top_by_code(const float *tables, int64_t C, int64_t R, const uint8_t *codes, int64_t n,
                                 const uint8_t *cand, int sum_mode, int64_t k, float *work, int64_t *pos) {
  float *combined = work, by_code[256];
  int64_t count[256] = {0};
  for (int64_t t = 0; t < n; t++) count[codes[t]] += cand == NULL || cand[t];
  for (int64_t c = 0; c < C; c++) by_code[c] = 0.0f;
  if (sum_mode) {
    for (int64_t c = 0; c < C; c++)
      for (int64_t r = 0; r < R; r++) by_code[c] += tables[c * R + r];
  } else {
    for (int64_t r = 0; r < R; r++) {
      float best = -INFINITY;
      for (int64_t c = 0; c < C; c++) best = count[c] && tables[c * R + r] > best ? tables[c * R + r] : best;
      if (best == -INFINITY) break; /* no candidate: every score is -inf below */
      float e[256], z = 0.0f;
      for (int64_t c = 0; c < C; c++) {
        e[c] = count[c] ? exp_nonpositive(tables[c * R + r] - best) : 0.0f;
        z += (float)count[c] * e[c];
      }
      for (int64_t c = 0; c < C; c++) by_code[c] += e[c] / z;
    }
  }
  for (int64_t t = 0; t < n; t++) combined[t] = (cand == NULL || cand[t]) ? by_code[codes[t]] : -INFINITY;
  top_positions(combined, n, k, (uint32_t *)(combined + n), (uint32_t *)(combined + 2 * n), pos);
}

/* pq_search, and what it leaves in this thread's workspace until its next search (pq_step.c's completion reads it
   after the re-rank): *scores (R, n) each token's PQ score per query row, and where the combine took the softmax
   over every candidate's scores, *e (R, n) = exp(score - top[r]) over the candidates (0 elsewhere) and top (R,)
   (*e NULL otherwise: the raw sum, one sub-space combined per code, whose *scores is NULL too, or a margin).
   row_scale (R,) and residuals (n,), where not NULL: the combine and top-k rank score + row_scale[r] x residuals[t]
   (methods/pqcache.spreads), *scores keeps the PQ scores alone. rows and e may be NULL: nothing is kept for them (with
   a margin, the PQ scores alone are then not stored at all: half the rows' memory traffic). */
int pq_search_rows(const float *tables, int64_t m, int64_t C, int64_t R, const uint8_t *codes, int64_t code_stride,
                   int64_t n, const uint8_t *cand, int sum_mode, int64_t k, const float *row_scale,
                   const float *residuals, int64_t *pos, const float **rows, const float **e, float *top) {
  int keep = residuals != NULL && rows != NULL; /* the PQ scores alone, beside the ranked ones */
  int64_t ranked_floats = keep ? R * n : 0;
  float *scores = R <= MAX_ROWS ? workspace(SEARCH, (size_t)(R * n + ranked_floats) + work_floats(n, R)) : NULL;
  if (rows) *rows = NULL;
  if (e) *e = NULL;
  if (scores == NULL) return -1;
  if (m == 1 && C <= 256 && n >= 2 * C && residuals == NULL) { /* fewer codes than tokens: per code */
    combined_top_by_code(tables, C, R, codes, n, cand, sum_mode, k, scores, pos);
    return 0;
  }
  float *ranked = keep ? scores + R * n : scores;
#pragma omp parallel for schedule(static) if (n >= 4 * BLOCK)
  for (int64_t t = 0; t < n; t++) {
    float row[MAX_ROWS];
    int64_t r = 0;
#if defined(__SSE2__)
    for (; r + 4 <= R; r += 4) { /* four query rows at once: 0.07 against 0.33 ms at 32K tokens, ad hoc */
      __m128 sum = _mm_loadu_ps(tables + (int64_t)codes[t] * R + r);
      for (int64_t j = 1; j < m; j++)
        sum = _mm_add_ps(sum, _mm_loadu_ps(tables + (j * C + codes[j * code_stride + t]) * R + r));
      _mm_storeu_ps(row + r, sum);
    }
#endif
    for (; r < R; r++) {
      float sum = tables[(int64_t)codes[t] * R + r];
      for (int64_t j = 1; j < m; j++) sum += tables[(j * C + codes[j * code_stride + t]) * R + r];
      row[r] = sum;
    }
    if (keep)
      for (r = 0; r < R; r++) scores[r * n + t] = row[r];
    if (residuals != NULL)
      for (r = 0; r < R; r++) ranked[r * n + t] = row[r] + row_scale[r] * residuals[t];
    else
      for (r = 0; r < R; r++) scores[r * n + t] = row[r];
  }
  float *work = scores + R * n + ranked_floats;
  combined_top_of(ranked, n, R, cand, sum_mode, k, work, pos, top);
  if (rows) *rows = scores;
  if (e) *e = sum_mode || residuals != NULL ? NULL : work;
  return 0;
}

/* tables (m, C, R), codes: sub-space j's code of token t at codes[j * code_stride + t], cand (n,) or NULL -> pos
   (k,): scores(t, r) = sum over j in order of tables[j, code, r] (+ row_scale[r] x residuals[t] where they are not
   NULL), combined, then the top k. 0, or -1 without memory (or with more than MAX_ROWS rows). */
int pq_search(const float *tables, int64_t m, int64_t C, int64_t R, const uint8_t *codes, int64_t code_stride,
              int64_t n, const uint8_t *cand, int sum_mode, int64_t k, const float *row_scale, const float *residuals,
              int64_t *pos) {
  float top[MAX_ROWS];
  return pq_search_rows(tables, m, C, R, codes, code_stride, n, cand, sum_mode, k, row_scale, residuals, pos, NULL,
                        NULL, top);
}
