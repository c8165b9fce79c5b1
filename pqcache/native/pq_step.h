/* What pq_step.c's decode step and pq_complete.c's estimate of the tokens it leaves out share: the layer's PQ index,
   what completion reads the values from, where a filed token goes, what the search leaves for the estimate, and the
   estimate's entry points. */
#ifndef PQ_STEP_H
#define PQ_STEP_H

#include <stdint.h>

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
   codes[c * code_head + j * code_sub + t], centroids (Hk, n, C, D/n) and their half_norm (Hk, n, C) |c|^2 / 2
   (ValueCodes: a value is its codes' centroids put together). */
typedef struct {
  float *sums, *counts;
  uint8_t *codes;
  const float *centroids, *half_norm;
  int64_t n, C, code_head, code_sub;
} Values;

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

/* What the search left for completion (pq_search_rows): each candidate's PQ score per query row (rows (G, n)), and
   where its combine was the softmax over the candidates, their exponentials e (G, n) = exp(score - top[g]); NULL
   where the search did not keep them, and the scores are computed again from the codes. */
typedef struct {
  const float *rows, *e, *top;
} Searched;

/* the filed token's value into V (pq_complete.c) */
void file_value(int64_t Hk, int64_t D, const Index *X, int64_t t, const Token *T, const Values *V, float *v);

/* completion's part for one KV head: the candidates left out, estimated (pq_complete.c) */
int unselected_part(const float *tables, const Index *X, const uint8_t *codes, const uint8_t *cand, int64_t n,
                           const Searched *found, const int64_t *top, const float *exact, int64_t wide,
                           const int64_t *idx, int64_t k, int64_t G, const Values *V, int64_t D, uint8_t *mark,
                           float *lse, float *out);

/* the budget in mass for one KV head: the picks kept (pq_complete.c) */
int cut_by_mass(const float *fixed, int64_t n_fixed, const float *exact, const int64_t *idx, int64_t k,
                       const float *rest_lse, int64_t G, float target, int64_t floor, uint8_t *kept);

/* the picks the mass left out, added to completion's part (pq_complete.c) */
void add_dropped(const Index *X, const uint8_t *codes, const int64_t *top, const int64_t *idx,
                        const float *exact, const uint8_t *kept, int64_t k, int64_t G, const Values *V, int64_t D,
                        float *lse, float *out);

#endif
