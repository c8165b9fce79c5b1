/* A PQ layer's selection and attention for one token in one call (layer/fused.py, for layer/onerow.py): the lookup
   tables, the PQ search, the re-rank's exact scores, its combine and top-k, then the attention over the window and
   the picks. Each stage is the kernel the one-row step calls one by one (pq_codes.c, pq_select.c, gather_dot.c,
   layer_step.c), on the same numbers in the same order, so the picks and the output are the same to the bit; what
   goes is the Python between them: about 40 small torch operators and five calls a layer and step (0.1-0.3 ms a
   layer on a 2-core CPU, docs/benchmarks.md).

   The case it serves is the common one: picks from the re-rank (wide > k), every one a candidate (wide <= the
   candidates), no block cache and no recorded weights; layer/fused.py checks that before calling.

   It also files the new token (onerow.py's _append): its rows in the host tier and the window's ring, its flags and
   its codes, computed in the tables' pass over the codebook. In Python and torch that took about 0.13 ms a layer, in
   C about 0.08 when called alone (a 4K context, Zen 4, ad hoc): most of that is the codebook read from memory again.
   pq_append files a token alone (an observed step, whose timeline shows the filing as its own span). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_poly.h"  /* exp_nonpositive */
#include "half_rows.h" /* kv_bytes, narrow_row */
#if defined(__SSE2__)
#include <immintrin.h>
#endif

void pq_tables_codes(const float *q, int64_t R, const float *centroids, int64_t m, int64_t C, int64_t d, float *tables,
                     const float *key, const float *half_norm, uint8_t *codes, int64_t stride, float *residual);
int pq_search_rows(const float *tables, int64_t m, int64_t C, int64_t R, const uint8_t *codes, int64_t code_stride,
                   int64_t n, const uint8_t *cand, int sum_mode, int64_t k, const float *row_scale,
                   const float *residuals, int64_t *pos, const float **rows, const float **e, float *top);
void gather_dot(const void *keys, int kind, int64_t stride, const int64_t *pos, int64_t n, const float *q, int64_t R,
                int64_t D, float *out);
int combine_top(const float *scores, int64_t n, int64_t R, const uint8_t *cand, int sum_mode, int64_t k,
                int64_t *pos);
int attend_picks_lse(const float *q, int64_t Hq, const void *k, const void *v, int64_t kv_kind, int64_t Hk,
                     int64_t head_stride, int64_t n, int64_t D, float scaling, int64_t count, const float *pick_scores,
                     const uint8_t *pick_valid, const int64_t *pos, const void *shared, int64_t shared_head,
                     int64_t S0, const void *own, int64_t own_head, int64_t kind, float *out, float *weights,
                     float *lse);

/* The host tier's stores: key and value rows (Hk heads, rows of D elements of `kind`), a fork's parent part
   (positions below S0; NULL when not a fork) and the tier's own (position p at row p - S0). */
typedef struct {
  const void *shared_k, *shared_v, *own_k, *own_v;
  int64_t shared_head, own_head, S0, kind;
} Stores;

/* The PQ index of one layer: centroids (Hk, m, C, d) float32; codes: head c's sub-space j's code of token t at
   codes[c * code_head + j * code_sub + t]; residuals: head c's token t's quantization error at
   residuals[c * residual_head + t] (float32; NULL: not kept). */
typedef struct {
  const float *centroids;
  uint8_t *codes;
  float *residuals;
  int64_t m, C, code_head, code_sub, residual_head;
} Index;

/* What completion reads the values left out from (engine/completion.py). By key cell, where codes is NULL: sums
   (Hk, m C, D) each PQ cell's values summed, counts (Hk, m C) how many (ValueMeans: a value is the mean over its
   key's m cells of their mean values). Else by the values' own codes: head c's sub-space j's code of token t at
   codes[c * code_head + j * code_sub + t], centroids (Hk, n, C, D/n) (ValueCodes: a value is its codes' centroids
   put together). */
typedef struct {
  float *sums, *counts;
  uint8_t *codes;
  const float *centroids;
  int64_t n, C, code_head, code_sub;
} Values;

/* The cells a token's weight is summed into, one head's: n sub-spaces of C cells, token t's in sub-space j
   codes[j * code_sub + t] (the key index's cells, or the values' codes) */
typedef struct {
  const uint8_t *codes;
  int64_t n, C, code_sub;
} Cells;

/* where head c's token t's residual goes (NULL where the index keeps none) */
static inline float *residual_at(const Index *X, int64_t c, int64_t t) {
  return X->residuals ? X->residuals + c * X->residual_head + t : NULL;
}

/* Where a decode step's new token goes: its key and value rows in the host tier's own store and in the window's ring
   slot (head h's row at h * *_head elements of *_kind), its flags (the tier's valid and searchable bytes, the ring
   slot's position) and its code tuple's row in the joint index (joint_head int32 apart; NULL: the index keeps
   none). */
typedef struct {
  void *own_k, *own_v, *ring_k, *ring_v;
  uint8_t *valid, *searchable;
  int64_t *slot_pos;
  int32_t *joint;
  int64_t own_head, own_kind, ring_head, ring_kind, joint_head;
} Token;

/* exact (wide, R) = keys[top] . q for one head: the positions below S0 from the parent's part, the rest from the
   tier's own (top is in position order, so the first are a prefix); local: wide int64 of scratch */
static void head_scores(const Stores *S, int64_t c, const int64_t *top, int64_t wide, const float *q, int64_t R,
                        int64_t D, int64_t *local, float *exact) {
  int64_t size = kv_bytes((int)S->kind), i = 0;
  while (i < wide && top[i] < S->S0) i++;
  if (i > 0) gather_dot((const char *)S->shared_k + c * S->shared_head * size, (int)S->kind, D, top, i, q, R, D, exact);
  for (int64_t j = i; j < wide; j++) local[j - i] = top[j] - S->S0;
  if (wide > i)
    gather_dot((const char *)S->own_k + c * S->own_head * size, (int)S->kind, D, local, wide - i, q, R, D,
               exact + i * R);
}

/* k, v (Hk, D) float32: the token at position t, its codes written -> its rows, each rounded to its store's kind as
   torch's copy rounds it (half_rows.h narrow_row); its code tuple's row joint = c C^m + the tuple's index
   (index.set_codes' rule, in int32); its flags set. */
static void file_token(const float *k, const float *v, int64_t Hk, int64_t D, const Index *X, int64_t t,
                       const Token *T) {
  int64_t m = X->m, own = kv_bytes((int)T->own_kind), ring = kv_bytes((int)T->ring_kind);
  int32_t tuples = 1;
  for (int64_t j = 0; j < m; j++) tuples *= (int32_t)X->C;
  for (int64_t c = 0; c < Hk; c++) {
    narrow_row(k + c * D, (int)T->own_kind, (char *)T->own_k + c * T->own_head * own, D);
    narrow_row(v + c * D, (int)T->own_kind, (char *)T->own_v + c * T->own_head * own, D);
    narrow_row(k + c * D, (int)T->ring_kind, (char *)T->ring_k + c * T->ring_head * ring, D);
    narrow_row(v + c * D, (int)T->ring_kind, (char *)T->ring_v + c * T->ring_head * ring, D);
    if (T->joint) {
      const uint8_t *codes = X->codes + c * X->code_head + t;
      int32_t row = codes[0];
      for (int64_t j = 1; j < m; j++) row = row * (int32_t)X->C + codes[j * X->code_sub];
      T->joint[c * T->joint_head + t] = (int32_t)c * tuples + row;
    }
  }
  *T->valid = *T->searchable = 1;
  *T->slot_pos = t;
}

/* The filed token's value (its row in the host tier's own store, as stored) into V: by key cell, summed into its m
   cells of each head's sums, each cell's count one more (completion.ValueMeans.update's sums for one token, in the
   same order); by the values' codes, its codes written at t, the nearest centroid of each sub-space
   (pq.encode's rule: the largest v . c - |c|^2 / 2). v: D floats of scratch. */
static void file_value(int64_t Hk, int64_t D, const Index *X, int64_t t, const Token *T, const Values *V, float *v) {
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
    int64_t d_sub = D / V->n;
    for (int64_t j = 0; j < V->n; j++) {
      const float *cent = V->centroids + (c * V->n + j) * V->C * d_sub, *x = v + j * d_sub;
      float best = -INFINITY;
      int64_t code = 0;
      for (int64_t e = 0; e < V->C; e++) {
        float dot = 0.0f, half = 0.0f;
        for (int64_t d = 0; d < d_sub; d++) {
          dot += x[d] * cent[e * d_sub + d];
          half += cent[e * d_sub + d] * cent[e * d_sub + d];
        }
        float score = dot - 0.5f * half;
        if (score > best) best = score, code = e;
      }
      V->codes[c * V->code_head + j * V->code_sub + t] = (uint8_t)code;
    }
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

/* What the search left for completion (pq_search_rows): each candidate's PQ score per query row (rows (G, n)), and
   where its combine was the softmax over the candidates, their exponentials e (G, n) = exp(score - top[g]); NULL
   where the search did not keep them, and the scores are computed again from the codes. */
typedef struct {
  const float *rows, *e, *top;
} Searched;

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
static int unselected_part(const float *tables, const Index *X, const uint8_t *codes, const uint8_t *cand, int64_t n,
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
static int cut_by_mass(const float *fixed, int64_t n_fixed, const float *exact, const int64_t *idx, int64_t k,
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
static void add_dropped(const Index *X, const uint8_t *codes, const int64_t *top, const int64_t *idx,
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

/* q (Hq, D) the token's query rows (unscaled); cand (n,) the candidates among tokens 0..n-1; the window's keys and
   values wk, wv (Hk heads of head_stride elements of w_kind, its first n_slots rows attended: sinks, ring, the new
   token, whose k_new, v_new (Hk, D) float32 this call writes into the last slot) -> pos (Hk, k) the picks in
   position order and out (Hq D,) the attention's output. Where T is not NULL, the new token, at position t, is also
   filed as pq_append files it: its codes from the tables' pass, its ring slot written after the attention has read
   the token it replaces. Where V is not NULL (what completion reads the values from: Values), the candidates left
   out are estimated and merged in by log-sum-exp (completion: unselected_part), and a token filed here has its
   value filed in V (file_value). row_scale (Hq,), where not NULL:
   the search ranks by the PQ score + row_scale x the token's residual (pq_search_rows). mass in (0, 1): a budget in
   mass (cut_by_mass, at least mass_floor picks), the picks kept written to kept (Hk, k) and the others left out of
   the attention (estimated, under completion); else every pick is attended. 0, or -1 without scratch memory (or
   with more than 64 query rows a KV head under completion or a budget in mass). */
int pq_step(const float *q, int64_t Hq, int64_t Hk, int64_t D, float scaling, const Index *X, const uint8_t *cand,
            int64_t n, int sum_mode, int64_t wide, int64_t k, const float *row_scale, const Stores *S, void *wk,
            void *wv, int64_t w_kind, int64_t head_stride, int64_t n_slots, int64_t *pos, float *out,
            const float *k_new, const float *v_new, const float *half_norm, int64_t t, const Token *T, const Values *V,
            float mass, int64_t mass_floor, uint8_t *kept) {
  int64_t G = Hq / Hk, m = X->m, C = X->C, d = D / X->m;
  float searched_top[16]; /* pq_select.c's MAX_ROWS: it refuses more rows */
  float *qs = malloc(sizeof(float) * Hq * D), *tables = malloc(sizeof(float) * m * C * G);
  float *exact = malloc(sizeof(float) * wide * G), *scores = malloc(sizeof(float) * Hk * k * G);
  int64_t *top = malloc(sizeof(int64_t) * wide), *local = malloc(sizeof(int64_t) * wide),
          *idx = malloc(sizeof(int64_t) * k);
  uint8_t *valid = malloc(Hk * k);
  /* completion's: the part left out, per query row (its log-sum-exp and output), the selection's log-sum-exp */
  float *part_lse = NULL, *part_out = NULL, *sel_lse = NULL;
  uint8_t *mark = NULL;
  /* the budget in mass's: the sinks' and window's exact scores (the stored ones: every slot but the new token's) */
  int cutting = mass > 0.0f && mass < 1.0f;
  int64_t n_fixed = n_slots - 1, *slots = NULL;
  float *fixed = NULL;
  if (V) {
    part_lse = malloc(sizeof(float) * Hq), part_out = malloc(sizeof(float) * Hq * D);
    sel_lse = malloc(sizeof(float) * Hq);
  }
  if (V || cutting) mark = malloc(n);
  if (cutting) {
    slots = malloc(sizeof(int64_t) * (n_fixed > 0 ? n_fixed : 1));
    fixed = malloc(sizeof(float) * (n_fixed > 0 ? n_fixed : 1) * G);
    for (int64_t j = 0; slots && j < n_fixed; j++) slots[j] = j;
  }
  int failed = !qs || !tables || !exact || !scores || !top || !local || !idx || !valid;
  failed = failed || (V && (!part_lse || !part_out || !sel_lse || G > 64));
  failed = failed || ((V || cutting) && !mark) || (cutting && (!slots || !fixed || G > 64));
  for (int64_t i = 0; !failed && i < Hq * D; i++) qs[i] = q[i] * scaling; /* methods' q * scaling, in float32 */
  for (int64_t c = 0; !failed && c < Hk; c++) { /* the new token's slot, rounded as torch's copy rounds it */
    int64_t slot = (c * head_stride + (n_slots - 1) * D) * kv_bytes((int)w_kind);
    narrow_row(k_new + c * D, (int)w_kind, (char *)wk + slot, D);
    narrow_row(v_new + c * D, (int)w_kind, (char *)wv + slot, D);
  }
  for (int64_t c = 0; !failed && c < Hk; c++) {
    const float *qc = qs + c * G * D;
    const float *key = T ? k_new + c * D : NULL, *norms = half_norm ? half_norm + c * m * C : NULL;
    pq_tables_codes(qc, G, X->centroids + c * m * C * d, m, C, d, tables, key, norms, X->codes + c * X->code_head + t,
                    X->code_sub, residual_at(X, c, t)); /* t >= n: the search does not read the new codes */
    Searched found = {NULL, NULL, NULL}; /* what completion reads: kept only under completion */
    const float *scale = row_scale ? row_scale + c * G : NULL;
    const float *residuals = row_scale ? X->residuals + c * X->residual_head : NULL;
    int estimating = V || cutting; /* the search's PQ scores (and exponentials) kept for the estimate */
    failed = pq_search_rows(tables, m, C, G, X->codes + c * X->code_head, X->code_sub, n, cand, sum_mode, wide, scale,
                            residuals, top, estimating ? &found.rows : NULL, estimating ? &found.e : NULL,
                            searched_top);
    found.top = searched_top;
    if (failed) break;
    head_scores(S, c, top, wide, qc, G, D, local, exact);
    failed = combine_top(exact, wide, G, NULL, sum_mode, k, idx);
    for (int64_t i = 0; !failed && i < k; i++) {
      pos[c * k + i] = top[idx[i]];
      for (int64_t g = 0; g < G; g++) scores[(c * k + i) * G + g] = exact[idx[i] * G + g];
      valid[c * k + i] = 1;
    }
    /* the candidates that are not picks, in one pass: completion's part, and the budget in mass's softmax */
    const uint8_t *codes = X->codes + c * X->code_head;
    float rest_lse[64], *lse = V ? part_lse + c * G : rest_lse;
    Values head = {NULL, NULL, NULL, NULL, 0, 0, 0, 0}; /* V's part for this head */
    if (V && V->codes == NULL) head = (Values){V->sums + c * m * C * D, V->counts + c * m * C, NULL, NULL, 0, 0, 0, 0};
    if (V && V->codes != NULL) {
      head = *V;
      head.codes = V->codes + c * V->code_head;
      head.centroids = V->centroids + c * V->n * V->C * (D / V->n);
    }
    if (!failed && estimating)
      failed = unselected_part(tables, X, codes, cand, n, &found, top, exact, wide, idx, k, G, V ? &head : NULL, D,
                               mark, lse, V ? part_out + c * G * D : NULL);
    if (!failed && cutting) {
      size_t size = (size_t)kv_bytes((int)w_kind);
      gather_dot((const char *)wk + c * head_stride * size, (int)w_kind, D, slots, n_fixed, qc, G, D, fixed);
      failed = cut_by_mass(fixed, n_fixed, exact, idx, k, lse, G, mass, mass_floor, valid + c * k);
      if (!failed && V)
        add_dropped(X, codes, top, idx, exact, valid + c * k, k, G, &head, D, lse, part_out + c * G * D);
    }
  }
  if (!failed && kept) memcpy(kept, valid, Hk * k);
  if (!failed)
    failed = attend_picks_lse(q, Hq, wk, wv, w_kind, Hk, head_stride, n_slots, D, scaling, k, scores, valid, pos,
                              S->S0 ? S->shared_v : NULL, S->shared_head, S->S0, S->own_v, S->own_head, S->kind, out,
                              NULL, sel_lse);
  for (int64_t h = 0; !failed && V && h < Hq; h++) { /* completion.merge: two parts of one softmax */
    if (part_lse[h] == -INFINITY) continue;
    float top_lse = sel_lse[h] > part_lse[h] ? sel_lse[h] : part_lse[h];
    double a = exp((double)sel_lse[h] - top_lse), b = exp((double)part_lse[h] - top_lse);
    float wa = (float)(a / (a + b)), wb = (float)(b / (a + b));
    for (int64_t e = 0; e < D; e++) out[h * D + e] = wa * out[h * D + e] + wb * part_out[h * D + e];
  }
  if (!failed && T) file_token(k_new, v_new, Hk, D, X, t, T);
  if (!failed && T && V) file_value(Hk, D, X, t, T, V, part_out);
  free(qs);
  free(tables);
  free(exact);
  free(scores);
  free(top);
  free(local);
  free(idx);
  free(valid);
  free(part_lse);
  free(part_out);
  free(sel_lse);
  free(mark);
  free(slots);
  free(fixed);
  return failed ? -1 : 0;
}

/* The token at position t filed alone: its codes under X's codebook, as index.encode codes a key (half_norm (Hk, m,
   C), NULL for the inner-product metric), then file_token. */
void pq_append(const float *k, const float *v, int64_t Hk, int64_t D, const Index *X, const float *half_norm,
               int64_t t, const Token *T) {
  int64_t m = X->m, C = X->C, d = D / m;
  for (int64_t c = 0; c < Hk; c++)
    pq_tables_codes(NULL, 0, X->centroids + c * m * C * d, m, C, d, NULL, k + c * D,
                    half_norm ? half_norm + c * m * C : NULL, X->codes + c * X->code_head + t, X->code_sub,
                    residual_at(X, c, t));
  file_token(k, v, Hk, D, X, t, T);
}
