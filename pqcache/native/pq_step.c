/* A PQ layer's selection and attention for one token in one call (layer/onerow.py's fused step): the lookup
   tables, the PQ search, the re-rank's exact scores, its combine and top-k, then the attention over the window and
   the picks. Each stage is the kernel the one-row step calls one by one (pq_codes.c, pq_select.c, gather_dot.c,
   layer_step.c), on the same numbers in the same order, so the picks and the output are the same to the bit; what
   goes is the Python between them: about 40 small torch operators and five calls a layer and step (0.1-0.3 ms a
   layer on a 2-core CPU, docs/benchmarks.md).

   The case it serves is the common one: picks from the re-rank (wide > k), every one a candidate (wide <= the
   candidates), no block cache and no recorded weights; onerow.py checks that before calling. */
#include <stdint.h>
#include <stdlib.h>

#include "half_rows.h" /* kv_bytes */

void pq_tables(const float *q, int64_t R, const float *centroids, int64_t m, int64_t C, int64_t d, float *tables);
int pq_search(const float *tables, int64_t m, int64_t C, int64_t R, const uint8_t *codes, int64_t code_stride,
              int64_t n, const uint8_t *cand, int sum_mode, int64_t k, int64_t *pos);
void gather_dot(const void *keys, int kind, int64_t stride, const int64_t *pos, int64_t n, const float *q, int64_t R,
                int64_t D, float *out);
int combine_top(const float *scores, int64_t n, int64_t R, const uint8_t *cand, int sum_mode, int64_t k,
                int64_t *pos);
int attend_picks(const float *q, int64_t Hq, const void *k, const void *v, int64_t kv_kind, int64_t Hk,
                 int64_t head_stride, int64_t n, int64_t D, float scaling, int64_t count, const float *pick_scores,
                 const uint8_t *pick_valid, const int64_t *pos, const void *shared, int64_t shared_head, int64_t S0,
                 const void *own, int64_t own_head, int64_t kind, float *out, float *weights);

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
  const uint8_t *codes;
  int64_t m, C, code_head, code_sub;
} Index;

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

/* q (Hq, D) the token's query rows (unscaled); cand (n,) the candidates among tokens 0..n-1; the window's keys and
   values wk, wv (Hk heads of head_stride elements of w_kind, its first n_slots rows attended: sinks, ring, the new
   token) -> pos (Hk, k) the picks in position order and out (Hq D,) the attention's output. 0, or -1 without
   scratch memory. */
int pq_step(const float *q, int64_t Hq, int64_t Hk, int64_t D, float scaling, const Index *X, const uint8_t *cand,
            int64_t n, int sum_mode, int64_t wide, int64_t k, const Stores *S, const void *wk, const void *wv,
            int64_t w_kind, int64_t head_stride, int64_t n_slots, int64_t *pos, float *out) {
  int64_t G = Hq / Hk, m = X->m, C = X->C, d = D / X->m;
  float *qs = malloc(sizeof(float) * Hq * D), *tables = malloc(sizeof(float) * m * C * G);
  float *exact = malloc(sizeof(float) * wide * G), *scores = malloc(sizeof(float) * Hk * k * G);
  int64_t *top = malloc(sizeof(int64_t) * wide), *local = malloc(sizeof(int64_t) * wide),
          *idx = malloc(sizeof(int64_t) * k);
  uint8_t *valid = malloc(Hk * k);
  int failed = !qs || !tables || !exact || !scores || !top || !local || !idx || !valid;
  for (int64_t i = 0; !failed && i < Hq * D; i++) qs[i] = q[i] * scaling; /* methods' q * scaling, in float32 */
  for (int64_t c = 0; !failed && c < Hk; c++) {
    const float *qc = qs + c * G * D;
    pq_tables(qc, G, X->centroids + c * m * C * d, m, C, d, tables);
    failed = pq_search(tables, m, C, G, X->codes + c * X->code_head, X->code_sub, n, cand, sum_mode, wide, top);
    if (failed) break;
    head_scores(S, c, top, wide, qc, G, D, local, exact);
    failed = combine_top(exact, wide, G, NULL, sum_mode, k, idx);
    for (int64_t i = 0; !failed && i < k; i++) {
      pos[c * k + i] = top[idx[i]];
      for (int64_t g = 0; g < G; g++) scores[(c * k + i) * G + g] = exact[idx[i] * G + g];
      valid[c * k + i] = 1;
    }
  }
  if (!failed)
    failed = attend_picks(q, Hq, wk, wv, w_kind, Hk, head_stride, n_slots, D, scaling, k, scores, valid, pos,
                          S->S0 ? S->shared_v : NULL, S->shared_head, S->S0, S->own_v, S->own_head, S->kind, out,
                          NULL);
  free(qs);
  free(tables);
  free(exact);
  free(scores);
  free(top);
  free(local);
  free(idx);
  free(valid);
  return failed ? -1 : 0;
}
