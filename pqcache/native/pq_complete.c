/* Completion and the budget in mass for pq_step.c's decode step (engine/completion.py, engine/mass.py): the
   candidates the step does not pick, their part of the softmax estimated from their PQ scores (calibrated on the
   re-rank's exact ones) and their values from the values' summary (Values: the values' own codes, or the mean value
   per key cell), summed by cell in one pass split between the threads; the fewest picks that hold a target share of
   the attention; and the filed token's value put into the summary. The same arithmetic as the general step's torch
   (completion.unselected_part, mass.mass_cut), summed in another order: tests/unit/test_mass.py compares them. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_poly.h"  /* exp_nonpositive */
#include "half_rows.h" /* kv_bytes, widen_row */
#include "pq_step.h"
#if defined(__SSE2__)
#include <immintrin.h>
#endif

/* The cells a token's weight is summed into, one head's: n sub-spaces of C cells, token t's in sub-space j
   codes[j * code_sub + t] (the key index's cells, or the values' codes) */
typedef struct {
  const uint8_t *codes;
  int64_t n, C, code_sub;
} Cells;

void pq_encode(const float *key, const float *centroids, const float *half_norm, int64_t m, int64_t C, int64_t d,
               uint8_t *codes, int64_t stride, float *residual);

/* The filed token's value (its row in the host tier's own store, as stored) into V: by key cell, summed into its m
   cells of each head's sums, each cell's count one more (completion.ValueMeans.update's sums for one token, in the
   same order); by the values' codes, its codes written at t as pq_codes.c codes a key (pq.encode's rule: the
   nearest centroid of each sub-space). v: D floats of scratch. */
void file_value(int64_t Hk, int64_t D, const Index *X, int64_t t, const Token *T, const Values *V, float *v) {
  int64_t m = X->m, P = m * X->C, own = kv_bytes((int)T->own_kind);
  for (int64_t c = 0; c < Hk; c++) {
    widen_row((const char *)T->own_v + c * T->own_head * own, (int)T->own_kind, v, D);
    if (V->codes == NULL) {
      for (int64_t j = 0; j < m; j++) {
        int64_t cell = c * P + j * X->C + X->codes[c * X->code_head + j * X->code_sub + t];
        for (int64_t d = 0; d < D; d++) V->sums[cell * D + d] += v[d];
        V->counts[cell] += 1.0f;
      }
      continue;
    }
    int64_t cells = V->n * V->C;
    pq_encode(v, V->centroids + c * cells * (D / V->n), V->half_norm + c * cells, V->n, V->C, D / V->n,
              V->codes + c * V->code_head + t, V->code_sub, NULL);
  }
}

/* token t's approximate scores for the G query rows, plus offset (G,): its codes' table rows summed over the
   sub-spaces in order (tables (m, C, G): a code's G entries are adjacent) */
static inline void approx_scores(const float *tables, const Index *X, const uint8_t *codes, int64_t t, int64_t G,
                                 const float *offset, float *s) {
  const float *row = tables + (int64_t)codes[t] * G;
  for (int64_t g = 0; g < G; g++) s[g] = row[g];
  for (int64_t j = 1; j < X->m; j++) {
    row = tables + (j * X->C + codes[j * X->code_sub + t]) * G;
    for (int64_t g = 0; g < G; g++) s[g] += row[g];
  }
  for (int64_t g = 0; g < G; g++) s[g] += offset[g];
}

/* w (G,) into token t's n cells of cells (n C, G): four query rows at once where there are four (Gemma 3's and
   Llama 3's heads; a loop over a G known only at run time adds one float at a time) */
static inline void add_to_cells(float *cells, const Cells *K, int64_t t, int64_t G, const float *w) {
  for (int64_t j = 0; j < K->n; j++) {
    float *cell = cells + (j * K->C + K->codes[j * K->code_sub + t]) * G;
    int64_t g = 0;
#if defined(__SSE2__)
    for (; g + 4 <= G; g += 4) _mm_storeu_ps(cell + g, _mm_add_ps(_mm_loadu_ps(cell + g), _mm_loadu_ps(w + g)));
#endif
    for (; g < G; g++) cell[g] += w[g];
  }
}

/* The calibration offset (engine/mass.py) over the re-rank's candidates, per query row: the log-sum-exp of their
   exact scores (exact (wide, G)) less that of their PQ scores (approx (wide, G), overwritten). -> known (wide, G)
   = exp(exact - emax) and emax (G,) their largest exact score, from which the ones left out are weighed. Each a
   subtraction, then one loop of exponentials (vectorized). */
static void calibrate(const float *exact, float *approx, int64_t wide, int64_t G, float *known, float *emax,
                      float *offset) {
  float amax[64];
  double e_sum[64] = {0}, a_sum[64] = {0};
  for (int64_t g = 0; g < G; g++) emax[g] = amax[g] = -INFINITY;
  for (int64_t i = 0; i < wide; i++)
    for (int64_t g = 0; g < G; g++) {
      emax[g] = exact[i * G + g] > emax[g] ? exact[i * G + g] : emax[g];
      amax[g] = approx[i * G + g] > amax[g] ? approx[i * G + g] : amax[g];
    }
  for (int64_t i = 0; i < wide; i++)
    for (int64_t g = 0; g < G; g++) {
      known[i * G + g] = exact[i * G + g] - emax[g];
      approx[i * G + g] -= amax[g];
    }
  for (int64_t x = 0; x < wide * G; x++) known[x] = exp_nonpositive(known[x]);
  for (int64_t x = 0; x < wide * G; x++) approx[x] = exp_nonpositive(approx[x]);
  for (int64_t i = 0; i < wide; i++)
    for (int64_t g = 0; g < G; g++) {
      e_sum[g] += known[i * G + g];
      a_sum[g] += approx[i * G + g];
    }
  for (int64_t g = 0; g < G; g++) offset[g] = (float)((emax[g] + log(e_sum[g])) - (amax[g] + log(a_sum[g])));
}

#define COMPLETE_SPLIT 4096 /* candidates from which the passes over them are split between the threads */
#define COMPLETE_BLOCK 1024 /* scores (tokens x query rows) a thread holds at a time */


/* the candidates' weights exp(score + offset - best) (G per token) summed by cell (into's) into cells (NULL: only
   z) and over the tokens into z (G,), tokens [t0, t1) that are candidates and not marked. From the search's
   exponentials where it kept them (scale: exp(top + offset - best), so no exponential is taken here), else from its
   scores where it kept them, else from the codes. */
static void weigh_candidates(const float *tables, const Index *X, const uint8_t *codes, const uint8_t *cand,
                             const uint8_t *mark, int64_t n, int64_t t0, int64_t t1, int64_t G, const Searched *found,
                             const float *offset, const float *best, const float *scale, const Cells *into,
                             float *cells, double *z) {
  float sc[COMPLETE_BLOCK], w[64];
  double sum[64] = {0}; /* z's share, added once: the threads' z share a cache line */
  int64_t who[COMPLETE_BLOCK], count = 0;
  if (found->e != NULL) {
    for (int64_t t = t0; t < t1; t++)
      if (cand[t] && !mark[t]) {
        for (int64_t g = 0; g < G; g++) {
          w[g] = found->e[g * n + t] * scale[g];
          sum[g] += w[g];
        }
        if (cells) add_to_cells(cells, into, t, G, w);
      }
  } else {
    for (int64_t t = t0; t < t1; t++)
      if (cand[t] && !mark[t]) {
        if (found->rows != NULL)
          for (int64_t g = 0; g < G; g++) sc[count * G + g] = found->rows[g * n + t] + offset[g] - best[g];
        else {
          approx_scores(tables, X, codes, t, G, offset, sc + count * G);
          for (int64_t g = 0; g < G; g++) sc[count * G + g] -= best[g];
        }
        who[count++] = t;
      }
    for (int64_t i = 0; i < count * G; i++) sc[i] = exp_nonpositive(sc[i]); /* vectorized */
    for (int64_t c = 0; c < count; c++) {
      for (int64_t g = 0; g < G; g++) sum[g] += sc[c * G + g];
      if (cells) add_to_cells(cells, into, who[c], G, sc + c * G);
    }
  }
  for (int64_t g = 0; g < G; g++) z[g] += sum[g];
}

/* Completion (engine/completion.py) for one KV head: the candidates that are not picks, their part of the softmax
   estimated and summed by cell. A candidate of the re-rank (top: wide positions, exact (wide, G) their exact scores)
   scores exactly, another its PQ score shifted by the calibration offset (engine/mass.py: the exact scores'
   log-sum-exp over the re-rank's candidates less their PQ scores'); its value is what V (this head's) gives: the
   mean over the sub-spaces of its key cells' mean values (a mean is sums over at least 1), or its codes'
   centroids. The weights are summed by cell (key cells or value codes) and each cell's value read once. picked:
   the k of top taken (idx). -> lse (G,) the part's log-sum-exp (-inf where no token is left out) and, where V is not
   NULL, out (G, D) its output, normalised over the part (V NULL: the log-sum-exp alone, for the budget in mass).
   mark: n bytes of scratch. The same arithmetic as completion.unselected_part, summed in another order (and split
   between the threads from COMPLETE_SPLIT candidates on: each its own cells, added in thread order). 0, or -1
   without scratch memory. */
int unselected_part(const float *tables, const Index *X, const uint8_t *codes, const uint8_t *cand, int64_t n,
                           const Searched *found, const int64_t *top, const float *exact, int64_t wide,
                           const int64_t *idx, int64_t k, int64_t G, const Values *V, int64_t D, uint8_t *mark,
                           float *lse, float *out) {
  int64_t m = X->m;
  int by_code = V != NULL && V->codes != NULL;
  Cells into = {codes, m, X->C, X->code_sub};
  if (by_code) into = (Cells){V->codes, V->n, V->C, V->code_sub};
  int64_t P = into.n * into.C;
  int threads = n >= COMPLETE_SPLIT ? omp_get_max_threads() : 1;
  float *cells = calloc((size_t)threads * P * G, sizeof(float)); /* each thread's (m C, G) sums */
  double *z = calloc((size_t)threads * G, sizeof(double));
  float *approx = malloc(sizeof(float) * (wide + 1) * G), *known = malloc(sizeof(float) * (wide + 1) * G);
  if (cells == NULL || z == NULL || approx == NULL || known == NULL) {
    free(cells);
    free(z);
    free(approx);
    free(known);
    return -1;
  }
  memset(mark, 0, n);
  for (int64_t i = 0; i < wide; i++) mark[top[i]] = 1; /* known: scored exactly */
  for (int64_t i = 0; i < k; i++) mark[top[idx[i]]] = 2; /* picked: not estimated here (add_dropped: the mass's) */
  float offset[64] = {0}, zero[64] = {0}, emax[64], best[64], scale[64], w[64];
  for (int64_t i = 0; i < wide; i++) /* the re-rank's candidates' PQ scores, then the offset */
    if (found->rows != NULL)
      for (int64_t g = 0; g < G; g++) approx[i * G + g] = found->rows[g * n + top[i]];
    else
      approx_scores(tables, X, codes, top[i], G, zero, approx + i * G);
  if (wide > 0) calibrate(exact, approx, wide, G, known, emax, offset);
  /* the softmax's shift: with the search's exponentials, the largest calibrated score; else an upper bound of every
     approximate score, the sum over the sub-spaces of their largest table entry, so one pass over the candidates
     suffices (a score far below it only loses exponent range, not precision); at least the largest exact score */
  for (int64_t g = 0; g < G; g++) {
    best[g] = offset[g];
    if (found->e != NULL) {
      best[g] += found->top[g];
    } else {
      for (int64_t j = 0; j < m; j++) {
        float top_entry = -INFINITY;
        for (int64_t c = 0; c < X->C; c++) {
          float e = tables[(j * X->C + c) * G + g];
          top_entry = e > top_entry ? e : top_entry;
        }
        best[g] += top_entry;
      }
    }
    if (wide > 0) best[g] = emax[g] > best[g] ? emax[g] : best[g];
  }
  for (int64_t g = 0; g < G; g++) /* 0 where no candidate is left: the search's top is -inf */
    scale[g] = found->e == NULL ? 1.0f : found->top[g] > -INFINITY ? expf(found->top[g] + offset[g] - best[g]) : 0.0f;
  for (int64_t g = 0; g < G && wide > 0; g++) emax[g] = expf(emax[g] - best[g]); /* the known ones' factor */
  for (int64_t i = 0; i < wide; i++) /* the known ones left out, into the first thread's cells */
    if (mark[top[i]] == 1) {
      for (int64_t g = 0; g < G; g++) {
        w[g] = known[i * G + g] * emax[g];
        z[g] += w[g];
      }
      if (V) add_to_cells(cells, &into, top[i], G, w);
    }
  int64_t per_block = COMPLETE_BLOCK / G; /* tokens a block: their scores, then one loop of exponentials */
#pragma omp parallel num_threads(threads)
  {
    int th = omp_get_thread_num();
#pragma omp for schedule(static)
    for (int64_t t0 = 0; t0 < n; t0 += per_block)
      weigh_candidates(tables, X, codes, cand, mark, n, t0, t0 + per_block < n ? t0 + per_block : n, G, found,
                       offset, best, scale, &into, V ? cells + (int64_t)th * P * G : NULL, z + th * G);
  }
  for (int th = 1; th < threads; th++) { /* the threads' sums, in thread order */
    for (int64_t i = 0; i < P * G; i++) cells[i] += cells[(int64_t)th * P * G + i];
    for (int64_t g = 0; g < G; g++) z[g] += z[th * G + g];
  }
  float inverse[64]; /* each cell's weight a row, over the part's sum (and, by key cell, the m sub-spaces' mean) */
  for (int64_t g = 0; g < G; g++) {
    lse[g] = z[g] == 0.0 ? -INFINITY : best[g] + (float)log(z[g]);
    inverse[g] = z[g] == 0.0 ? 0.0f : (float)(1.0 / (z[g] * (by_code ? 1 : m)));
  }
  if (V) memset(out, 0, sizeof(float) * G * D);
  int64_t d_sub = by_code ? D / V->n : D; /* a cell's value: a sub-space's part of the row, or the whole row */
  for (int64_t c = 0; V && c < P; c++) { /* each cell's value read once for the G rows */
    float per_token = by_code ? 1.0f : 1.0f / (V->counts[c] > 1.0f ? V->counts[c] : 1.0f);
    const float *value = by_code ? V->centroids + c * d_sub : V->sums + c * D;
    int64_t at = by_code ? c / V->C * d_sub : 0; /* where in the row it goes */
    for (int64_t g = 0; g < G; g++) {
      float wc = cells[c * G + g] * inverse[g] * per_token, *o = out + g * D + at;
      if (wc != 0.0f)
        for (int64_t d = 0; d < d_sub; d++) o[d] += wc * value[d];
    }
  }
  free(cells);
  free(z);
  free(approx);
  free(known);
  return 0;
}

/* A pick and its estimated share, ordered by share, larger first, then by pick (mass.mass_cut's stable sort) */
typedef struct {
  double share;
  int64_t i;
} Share;

static int by_share(const void *a, const void *b) {
  const Share *x = a, *y = b;
  if (x->share != y->share) return x->share < y->share ? 1 : -1;
  return x->i < y->i ? -1 : x->i > y->i;
}

/* The budget in mass (methods/estimate.estimate_and_cut, mass.mass_cut) for one KV head: each token's share of the
   step's softmax over the stored tokens, from the sinks' and window's exact scores (fixed (n_fixed, G)), the picks'
   exact scores (exact at idx), and the rest's log-sum-exp (rest_lse (G,): the re-rank's other candidates exact,
   the others by calibrated PQ score: unselected_part), averaged over the G query rows; then the picks by share,
   each kept while the share held before it (the sinks' and window's first) is short of target, at least `floor`
   of them -> kept (k,) 1 or 0. 0, or -1 without scratch memory. */
int cut_by_mass(const float *fixed, int64_t n_fixed, const float *exact, const int64_t *idx, int64_t k,
                       const float *rest_lse, int64_t G, float target, int64_t floor, uint8_t *kept) {
  Share *order = malloc(sizeof(Share) * (k > 0 ? k : 1));
  if (order == NULL) return -1;
  double top[64], z[64], base = 0.0;
  for (int64_t g = 0; g < G; g++) { /* the largest score of each row: the sums below are of exp(s - top) */
    top[g] = rest_lse[g];
    for (int64_t j = 0; j < n_fixed; j++) top[g] = fixed[j * G + g] > top[g] ? fixed[j * G + g] : top[g];
    for (int64_t i = 0; i < k; i++) top[g] = exact[idx[i] * G + g] > top[g] ? exact[idx[i] * G + g] : top[g];
    z[g] = rest_lse[g] == -INFINITY ? 0.0 : exp(rest_lse[g] - top[g]);
    for (int64_t j = 0; j < n_fixed; j++) z[g] += exp(fixed[j * G + g] - top[g]);
    for (int64_t i = 0; i < k; i++) z[g] += exp(exact[idx[i] * G + g] - top[g]);
  }
  for (int64_t j = 0; j < n_fixed; j++)
    for (int64_t g = 0; g < G; g++) base += exp(fixed[j * G + g] - top[g]) / z[g] / G;
  for (int64_t i = 0; i < k; i++) {
    order[i].i = i;
    order[i].share = 0.0;
    for (int64_t g = 0; g < G; g++) order[i].share += exp(exact[idx[i] * G + g] - top[g]) / z[g] / G;
  }
  qsort(order, k, sizeof(Share), by_share);
  double held = base;
  for (int64_t r = 0; r < k; r++) {
    kept[order[r].i] = held < target || r < floor;
    held += order[r].share;
  }
  free(order);
  return 0;
}

/* Completion's part (lse (G,), out (G, D) normalised over it: unselected_part's) with the picks the mass left out
   added: each weighs exp(its exact score) and brings its value as V (this head's) gives it, as unselected_part
   weighs the re-rank's candidates it leaves out (the general step's sum, in another order). */
void add_dropped(const Index *X, const uint8_t *codes, const int64_t *top, const int64_t *idx,
                        const float *exact, const uint8_t *kept, int64_t k, int64_t G, const Values *V, int64_t D,
                        float *lse, float *out) {
  for (int64_t g = 0; g < G; g++) {
    float best = lse[g], *o = out + g * D;
    for (int64_t i = 0; i < k; i++)
      if (!kept[i]) best = exact[idx[i] * G + g] > best ? exact[idx[i] * G + g] : best;
    if (best == -INFINITY) continue; /* no token left out */
    double total = lse[g] == -INFINITY ? 0.0 : exp((double)lse[g] - best);
    for (int64_t d = 0; d < D; d++) o[d] *= (float)total; /* the part's sum, on the new shift */
    for (int64_t i = 0; i < k; i++) {
      if (kept[i]) continue;
      float w = expf(exact[idx[i] * G + g] - best);
      int64_t t = top[idx[i]];
      total += w;
      if (V->codes != NULL) {
        int64_t d_sub = D / V->n;
        for (int64_t j = 0; j < V->n; j++) {
          const float *value = V->centroids + (j * V->C + V->codes[j * V->code_sub + t]) * d_sub;
          for (int64_t d = 0; d < d_sub; d++) o[j * d_sub + d] += w * value[d];
        }
        continue;
      }
      for (int64_t j = 0; j < X->m; j++) {
        int64_t cell = j * X->C + codes[j * X->code_sub + t];
        float f = w / X->m / (V->counts[cell] > 1.0f ? V->counts[cell] : 1.0f);
        for (int64_t d = 0; d < D; d++) o[d] += f * V->sums[cell * D + d];
      }
    }
    for (int64_t d = 0; d < D; d++) o[d] = (float)(o[d] / total);
    lse[g] = best + (float)log(total);
  }
}
