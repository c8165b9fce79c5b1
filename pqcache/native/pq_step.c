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
   pq_append files a token alone (an observed step, whose timeline shows the filing as its own span).

   Under completion or a budget in mass the step also estimates the candidates it does not pick, in the same pass
   over them: pq_complete.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half_rows.h" /* kv_bytes, narrow_row */
#include "pq_step.h"   /* Index, Values, Token, Searched; completion and the budget in mass (pq_complete.c) */

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

/* where head c's token t's residual goes (NULL where the index keeps none) */
static inline float *residual_at(const Index *X, int64_t c, int64_t t) {
  return X->residuals ? X->residuals + c * X->residual_head + t : NULL;
}

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
    Values head = {0}; /* V's part for this head */
    if (V && V->codes == NULL) {
      head.sums = V->sums + c * m * C * D;
      head.counts = V->counts + c * m * C;
    }
    if (V && V->codes != NULL) {
      head = *V;
      head.codes = V->codes + c * V->code_head;
      head.centroids = V->centroids + c * V->n * V->C * (D / V->n);
      head.half_norm = V->half_norm + c * V->n * V->C;
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
