/* A PQ layer's selection and attention for one token in one call (layer/onerow.py's fused step): the lookup
   tables, the PQ search, the re-rank's exact scores, its combine and top-k, then the attention over the window and
   the picks. Each stage is the kernel the one-row step calls one by one (pq_codes.c, pq_select.c, gather_dot.c,
   layer_step.c), on the same numbers in the same order, so the picks and the output are the same to the bit; what
   goes is the Python between them: about 40 small torch operators and five calls a layer and step (0.1-0.3 ms a
   layer on a 2-core CPU, docs/benchmarks.md).

   The case it serves is the common one: picks from the re-rank (wide > k), every one a candidate (wide <= the
   candidates), no block cache and no recorded weights; onerow.py checks that before calling.

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

void pq_tables_codes(const float *q, int64_t R, const float *centroids, int64_t m, int64_t C, int64_t d, float *tables,
                     const float *key, const float *half_norm, uint8_t *codes, int64_t stride);
int pq_search(const float *tables, int64_t m, int64_t C, int64_t R, const uint8_t *codes, int64_t code_stride,
              int64_t n, const uint8_t *cand, int sum_mode, int64_t k, int64_t *pos);
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
   codes[c * code_head + j * code_sub + t]. */
typedef struct {
  const float *centroids;
  uint8_t *codes;
  int64_t m, C, code_head, code_sub;
} Index;

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

/* w (G,) into token t's m cells of cells (m C, G) */
static inline void add_to_cells(float *cells, const Index *X, const uint8_t *codes, int64_t t, int64_t G,
                                const float *w) {
  for (int64_t j = 0; j < X->m; j++) {
    float *cell = cells + (j * X->C + codes[j * X->code_sub + t]) * G;
    for (int64_t g = 0; g < G; g++) cell[g] += w[g];
  }
}

/* a log-sum-exp kept as its running maximum top and the sum of exp(x - top), x added (the sum rescaled when x is a
   new maximum: one pass over the values) */
static inline void running_lse(float x, float *top, double *sum) {
  if (x > *top) {
    *sum = *sum * exp_nonpositive(*top - x) + 1.0;
    *top = x;
  } else {
    *sum += exp_nonpositive(x - *top);
  }
}

#define COMPLETE_SPLIT 4096 /* candidates from which the passes over them are split between the threads */
#define COMPLETE_BLOCK 1024 /* scores (tokens x query rows) a thread holds at a time */

/* Completion (engine/completion.py) for one KV head: the candidates that are not picks, their part of the softmax
   estimated and summed by cell. A candidate of the re-rank (top: wide positions, exact (wide, G) their exact scores)
   scores exactly, another its PQ score shifted by the calibration offset (engine/mass.py: the exact scores'
   log-sum-exp over the re-rank's candidates less their PQ scores'); its value is the mean over the sub-spaces of its
   cells' mean values (means (m C, D)). picked: the k of top taken (idx). -> lse (G,) the part's log-sum-exp (-inf
   where no token is left out) and out (G, D) its output, normalised over the part. mark: n bytes of scratch. The same
   arithmetic as completion.unselected_part, summed in another order (and split between the threads from
   COMPLETE_SPLIT candidates on: each its own cells, added in thread order). 0, or -1 without scratch memory. */
static int unselected_part(const float *tables, const Index *X, const uint8_t *codes, const uint8_t *cand, int64_t n,
                           const int64_t *top, const float *exact, int64_t wide, const int64_t *idx, int64_t k,
                           int64_t G, const float *means, int64_t D, uint8_t *mark, float *lse, float *out) {
  int64_t m = X->m, P = m * X->C;
  int threads = n >= COMPLETE_SPLIT ? omp_get_max_threads() : 1;
  float *cells = calloc((size_t)threads * P * G, sizeof(float)); /* each thread's (m C, G) sums */
  double *z = calloc((size_t)threads * G, sizeof(double));
  if (cells == NULL || z == NULL) {
    free(cells);
    free(z);
    return -1;
  }
  memset(mark, 0, n);
  for (int64_t i = 0; i < wide; i++) mark[top[i]] = 1; /* known: scored exactly */
  for (int64_t i = 0; i < k; i++) mark[top[idx[i]]] = 2; /* picked: attended, not estimated */
  float offset[64] = {0}, zero[64] = {0}, best[64], s[64];
  if (wide > 0) { /* the calibration offset over the re-rank's candidates, each read once */
    float e_top[64], a_top[64];
    double e_sum[64] = {0}, a_sum[64] = {0};
    for (int64_t g = 0; g < G; g++) e_top[g] = a_top[g] = -INFINITY;
    for (int64_t i = 0; i < wide; i++) {
      approx_scores(tables, X, codes, top[i], G, zero, s);
      for (int64_t g = 0; g < G; g++) {
        running_lse(exact[i * G + g], e_top + g, e_sum + g);
        running_lse(s[g], a_top + g, a_sum + g);
      }
    }
    for (int64_t g = 0; g < G; g++) offset[g] = (float)((e_top[g] + log(e_sum[g])) - (a_top[g] + log(a_sum[g])));
  }
  /* the softmax's shift: no approximate score passes the sum over the sub-spaces of their largest table entry, so
     one pass over the candidates suffices (a score far below it only loses exponent range, not precision) */
  for (int64_t g = 0; g < G; g++) {
    best[g] = offset[g];
    for (int64_t j = 0; j < m; j++) {
      float top_entry = -INFINITY;
      for (int64_t c = 0; c < X->C; c++) {
        float e = tables[(j * X->C + c) * G + g];
        top_entry = e > top_entry ? e : top_entry;
      }
      best[g] += top_entry;
    }
  }
  for (int64_t i = 0; i < wide; i++) /* the known ones left out */
    if (mark[top[i]] == 1)
      for (int64_t g = 0; g < G; g++) best[g] = exact[i * G + g] > best[g] ? exact[i * G + g] : best[g];
  float w[64];
  for (int64_t i = 0; i < wide; i++) /* the known ones into the first thread's cells */
    if (mark[top[i]] == 1) {
      for (int64_t g = 0; g < G; g++) {
        w[g] = exp_nonpositive(exact[i * G + g] - best[g]);
        z[g] += w[g];
      }
      add_to_cells(cells, X, codes, top[i], G, w);
    }
  int64_t per_block = COMPLETE_BLOCK / G; /* tokens a block: their scores, then one loop of exponentials */
#pragma omp parallel num_threads(threads)
  {
    int th = omp_get_thread_num();
    float *mine = cells + (int64_t)th * P * G, sc[COMPLETE_BLOCK];
    int64_t who[COMPLETE_BLOCK];
    double *zt = z + th * G;
#pragma omp for schedule(static)
    for (int64_t t0 = 0; t0 < n; t0 += per_block) {
      int64_t count = 0, t1 = t0 + per_block < n ? t0 + per_block : n;
      for (int64_t t = t0; t < t1; t++)
        if (cand[t] && !mark[t]) {
          approx_scores(tables, X, codes, t, G, offset, sc + count * G);
          for (int64_t g = 0; g < G; g++) sc[count * G + g] -= best[g];
          who[count++] = t;
        }
      for (int64_t i = 0; i < count * G; i++) sc[i] = exp_nonpositive(sc[i]); /* vectorized */
      for (int64_t c = 0; c < count; c++) {
        for (int64_t g = 0; g < G; g++) zt[g] += sc[c * G + g];
        add_to_cells(mine, X, codes, who[c], G, sc + c * G);
      }
    }
  }
  for (int th = 1; th < threads; th++) { /* the threads' sums, in thread order */
    for (int64_t i = 0; i < P * G; i++) cells[i] += cells[(int64_t)th * P * G + i];
    for (int64_t g = 0; g < G; g++) z[g] += z[th * G + g];
  }
  for (int64_t g = 0; g < G; g++) {
    float *o = out + g * D;
    memset(o, 0, sizeof(float) * D);
    if (z[g] == 0.0) {
      lse[g] = -INFINITY;
      continue;
    }
    lse[g] = best[g] + (float)log(z[g]);
    float scale = (float)(1.0 / (z[g] * m));
    for (int64_t c = 0; c < P; c++) {
      float wc = cells[c * G + g] * scale;
      if (wc != 0.0f)
        for (int64_t d = 0; d < D; d++) o[d] += wc * means[c * D + d];
    }
  }
  free(cells);
  free(z);
  return 0;
}

/* q (Hq, D) the token's query rows (unscaled); cand (n,) the candidates among tokens 0..n-1; the window's keys and
   values wk, wv (Hk heads of head_stride elements of w_kind, its first n_slots rows attended: sinks, ring, the new
   token, whose k_new, v_new (Hk, D) float32 this call writes into the last slot) -> pos (Hk, k) the picks in
   position order and out (Hq D,) the attention's output. Where T is not NULL, the new token, at position t, is also
   filed as pq_append files it: its codes from the tables' pass, its ring slot written after the attention has read
   the token it replaces. Where means is not NULL (Hk, m C, D: each cell's mean value), the candidates left out are
   estimated and merged in by log-sum-exp (completion: unselected_part). 0, or -1 without scratch memory (or with
   more than 64 query rows a KV head under completion). */
int pq_step(const float *q, int64_t Hq, int64_t Hk, int64_t D, float scaling, const Index *X, const uint8_t *cand,
            int64_t n, int sum_mode, int64_t wide, int64_t k, const Stores *S, void *wk, void *wv, int64_t w_kind,
            int64_t head_stride, int64_t n_slots, int64_t *pos, float *out, const float *k_new, const float *v_new,
            const float *half_norm, int64_t t, const Token *T, const float *means) {
  int64_t G = Hq / Hk, m = X->m, C = X->C, d = D / X->m;
  float *qs = malloc(sizeof(float) * Hq * D), *tables = malloc(sizeof(float) * m * C * G);
  float *exact = malloc(sizeof(float) * wide * G), *scores = malloc(sizeof(float) * Hk * k * G);
  int64_t *top = malloc(sizeof(int64_t) * wide), *local = malloc(sizeof(int64_t) * wide),
          *idx = malloc(sizeof(int64_t) * k);
  uint8_t *valid = malloc(Hk * k);
  /* completion's: the part left out, per query row (its log-sum-exp and output), the selection's log-sum-exp */
  float *part_lse = NULL, *part_out = NULL, *sel_lse = NULL;
  uint8_t *mark = NULL;
  if (means) {
    part_lse = malloc(sizeof(float) * Hq), part_out = malloc(sizeof(float) * Hq * D);
    sel_lse = malloc(sizeof(float) * Hq), mark = malloc(n);
  }
  int failed = !qs || !tables || !exact || !scores || !top || !local || !idx || !valid;
  failed = failed || (means && (!part_lse || !part_out || !sel_lse || !mark || G > 64));
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
                    X->code_sub); /* t >= n: the search does not read the new codes */
    failed = pq_search(tables, m, C, G, X->codes + c * X->code_head, X->code_sub, n, cand, sum_mode, wide, top);
    if (failed) break;
    head_scores(S, c, top, wide, qc, G, D, local, exact);
    failed = combine_top(exact, wide, G, NULL, sum_mode, k, idx);
    for (int64_t i = 0; !failed && i < k; i++) {
      pos[c * k + i] = top[idx[i]];
      for (int64_t g = 0; g < G; g++) scores[(c * k + i) * G + g] = exact[idx[i] * G + g];
      valid[c * k + i] = 1;
    }
    if (!failed && means)
      failed = unselected_part(tables, X, X->codes + c * X->code_head, cand, n, top, exact, wide, idx, k, G,
                               means + c * m * C * D, D, mark, part_lse + c * G, part_out + c * G * D);
  }
  if (!failed)
    failed = attend_picks_lse(q, Hq, wk, wv, w_kind, Hk, head_stride, n_slots, D, scaling, k, scores, valid, pos,
                              S->S0 ? S->shared_v : NULL, S->shared_head, S->S0, S->own_v, S->own_head, S->kind, out,
                              NULL, sel_lse);
  for (int64_t h = 0; !failed && means && h < Hq; h++) { /* completion.merge: two parts of one softmax */
    if (part_lse[h] == -INFINITY) continue;
    float top_lse = sel_lse[h] > part_lse[h] ? sel_lse[h] : part_lse[h];
    double a = exp((double)sel_lse[h] - top_lse), b = exp((double)part_lse[h] - top_lse);
    float wa = (float)(a / (a + b)), wb = (float)(b / (a + b));
    for (int64_t e = 0; e < D; e++) out[h * D + e] = wa * out[h * D + e] + wb * part_out[h * D + e];
  }
  if (!failed && T) file_token(k_new, v_new, Hk, D, X, t, T);
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
  return failed ? -1 : 0;
}

/* The token at position t filed alone: its codes under X's codebook, as index.encode codes a key (half_norm (Hk, m,
   C), NULL for the inner-product metric), then file_token. */
void pq_append(const float *k, const float *v, int64_t Hk, int64_t D, const Index *X, const float *half_norm,
               int64_t t, const Token *T) {
  int64_t m = X->m, C = X->C, d = D / m;
  for (int64_t c = 0; c < Hk; c++)
    pq_tables_codes(NULL, 0, X->centroids + c * m * C * d, m, C, d, NULL, k + c * D,
                    half_norm ? half_norm + c * m * C : NULL, X->codes + c * X->code_head + t, X->code_sub);
  file_token(k, v, Hk, D, X, t, T);
}
