/* One decoder layer's decode step for one token, in three calls: the layer's own arithmetic, without the two
   hundred small torch operators it takes in Python (five RMSNorms of seven operators each, the rotary embedding,
   SDPA's setup, GELU, residuals; a few microseconds each, whatever their size). Gemma 3's layers and the Llama
   family's (pqcache/fastpath/shape.py): the norms a layer lacks are NULL, and so is a q/k/v bias it lacks.

   layer_qkv   input norm, the stacked q/k/v product (and bias), the q and k heads' norms and the rotary embedding
   attend_row  softmax attention of one token's query heads over the keys it attends to (a sliding window's, or
               a full-attention layer's of a DynamicCache), grouped query heads sharing a key/value head
   attend_picks  the same over a PQ layer's sinks, ring and new token and its picks, the picks' scores from the
               re-rank and their values read where they lie in the host tier (layer/onerow.py)
   layer_out   o projection, post-attention norm and residual, pre-feedforward norm, gate/up, GELU (tanh) or
               SiLU, down, post-feedforward norm and residual

   The products are int8_rows.c's (the same int16 rounding of each input row and exact integer sums), so each
   matches native.Int8Product to the bit on the same input. The rest is float32 arithmetic in the same formulas as
   transformers' decoder layers (sums of squares in double), in another order than torch's kernels: a few
   units in the last place, which the int16 rounding of the next product can turn into 1e-5 of its output
   (tests/unit/test_decode_layer.py). The caller keeps the cache: layer_qkv's k and v rows go into it, and attend_row
   reads the keys and values it returns. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_poly.h"  /* exp_nonpositive, sigmoid */
#include "half_rows.h" /* the host tier's rows in float32, float16 or bfloat16 */
#include "lanes16.h"   /* 16 float lanes: AVX-512, or AVX2 in two halves */

int int8_rows_mm(const float *x, const int8_t *q, const float *scale, float *y, int64_t R, int64_t N, int64_t K);

/* pqcache/native/layer.py's LayerWeights mirrors this (ctypes.Structure, same field order and types) */
typedef struct {
  int64_t E, Hq, Hk, D, I; /* hidden size, query heads, key/value heads, head size, intermediate size */
  int64_t act;             /* the MLP's activation: 0 GELU (tanh), 1 SiLU */
  double eps;
  /* each norm's weight as applied (Gemma: 1 + w): (E,) each; w_qk (Hq + Hk, D), the q norm's row for every q head,
     then k's. w_qk, w_post_attn, w_post_ff: NULL where the layer has no such norm (the Llama family) */
  const float *w_in, *w_qk, *w_post_attn, *w_pre_ff, *w_post_ff;
  const float *qkv_bias; /* ((Hq + 2 Hk) D,) or NULL */
  /* int8 rows and their float32 scales: qkv ((Hq + 2 Hk) D, E), o (E, Hq D), gate_up (2 I, E), down (E, I) */
  const int8_t *qkv_q, *o_q, *gate_up_q, *down_q;
  const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
} Layer;

/* y = x * rsqrt(mean(x^2) + eps) * w, in that order (torch's rms_norm); y may be x */
static void rms_norm(const float *x, const float *w, float *y, int64_t n, double eps) {
  double squares = 0.0;
  for (int64_t i = 0; i < n; i++) squares += (double)x[i] * x[i];
  float r = (float)(1.0 / sqrt(squares / (double)n + eps));
  for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* torch's gelu(approximate="tanh"), 0.5 x (1 + tanh(u)), as x sigmoid(2 u): the same function, with exp_poly.h's
   exponential, which vectorizes (libm's tanhf does not); a few units in the last place from torch's values */
static inline float gelu_tanh(float x) {
  const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi) */
  return x * sigmoid(2.0f * beta * (x + kappa * x * x * x));
}

static inline float silu(float x) { return x * sigmoid(x); } /* torch's silu, x / (1 + exp(-x)) */

/* x (E,) -> qkv (Hq + 2 Hk, D): the normed, rotated q and k heads, then the v heads. cos, sin_signed (D,): the
   step's rotary embedding, sin's first half negated (x * cos + roll(x, D / 2) * sin_signed is rotate_half's form).
   Returns 0, or -1 when scratch memory could not be allocated. */
int layer_qkv(const Layer *L, const float *x, const float *cos, const float *sin_signed, float *qkv) {
  int64_t E = L->E, D = L->D, half = L->D / 2, heads = L->Hq + 2 * L->Hk;
  float *h = malloc(sizeof(float) * (E > D ? E : D));
  if (h == NULL) return -1;
  rms_norm(x, L->w_in, h, E, L->eps);
  int failed = int8_rows_mm(h, L->qkv_q, L->qkv_scale, qkv, 1, heads * D, E);
  if (!failed && L->qkv_bias != NULL)
    for (int64_t i = 0; i < heads * D; i++) qkv[i] += L->qkv_bias[i];
  for (int64_t r = 0; !failed && r < L->Hq + L->Hk; r++) {
    float *t = qkv + r * D;
    if (L->w_qk != NULL)
      rms_norm(t, L->w_qk + r * D, h, D, L->eps);
    else
      memcpy(h, t, sizeof(float) * D);
    for (int64_t i = 0; i < D; i++) t[i] = h[i] * cos[i] + (i < half ? h[i + half] : h[i - half]) * sin_signed[i];
  }
  free(h);
  return failed;
}

#if defined(__AVX512F__)
#define KEYS 4 /* keys a step of scores() holds: 16 accumulators in 32 zmm registers */
#else
/* AVX2's 16 ymm registers: 1 key x 4 rows x 2 halves; 2 or 4 keys spill (ad hoc, attend_row over 512 and 8192
   keys: 0.06-0.07 and 3.7-4.2 ms with 1 key, 0.08-0.09 and 5.0-5.7 with 2, 0.07-0.09 and 4.5-4.9 with 4) */
#define KEYS 1
#endif

/* s[h * n + j] = scaling q_h . k_j for the g query rows q (g, D) of one key/value head and its keys j0..j1 (row j
   at k + j * D) */
static void scores(const float *q, int64_t g, const float *k, int64_t j0, int64_t j1, int64_t D, float scaling,
                   float *s, int64_t n) {
  int64_t j = j0;
#if defined(LANES16)
  if (g <= 4 && D % 16 == 0)
    /* KEYS keys against four query rows at a time: on AVX-512 8 loads for 16 FMAs (one key at a time: 5 for 4) */
    for (; j + KEYS <= j1; j += KEYS) {
      f16x acc[KEYS][4];
      for (int a = 0; a < KEYS; a++)
        for (int h = 0; h < 4; h++) acc[a][h] = f16_zero();
      for (int64_t d = 0; d < D; d += 16) {
        f16x kd[KEYS], qd[4];
        for (int a = 0; a < KEYS; a++) kd[a] = f16_load(k + (j + a) * D + d);
        for (int h = 0; h < 4; h++) qd[h] = f16_load(q + (h < g ? h : g - 1) * D + d);
        for (int a = 0; a < KEYS; a++)
          for (int h = 0; h < 4; h++) acc[a][h] = f16_fmadd(kd[a], qd[h], acc[a][h]);
      }
      for (int h = 0; h < g; h++)
        for (int a = 0; a < KEYS; a++) s[h * n + j + a] = f16_sum(acc[a][h]) * scaling;
    }
#endif
  for (; j < j1; j++)
    for (int64_t h = 0; h < g; h++) s[h * n + j] = lanes_dot(q + h * D, k + j * D, D) * scaling;
}

/* o (g, D) += sum over keys j0..j1 of p[h * n + j] v_j, for the g query rows of one key/value head */
static void weighted_values(const float *p, int64_t g, const float *v, int64_t j0, int64_t j1, int64_t D, float *o,
                            int64_t n) {
#if defined(__AVX512F__)
  if (g <= 4 && D % 64 == 0) {
    /* 64 columns of every query row held in 16 registers while the keys stream past: no stores in the loop */
    for (int64_t d = 0; d < D; d += 64) {
      __m512 acc[4][4];
      for (int h = 0; h < 4; h++)
        for (int c = 0; c < 4; c++) acc[h][c] = _mm512_setzero_ps();
      for (int64_t j = j0; j < j1; j++) {
        __m512 vd[4];
        for (int c = 0; c < 4; c++) vd[c] = _mm512_loadu_ps(v + j * D + d + 16 * c);
        for (int h = 0; h < 4 && h < g; h++) {
          __m512 ph = _mm512_set1_ps(p[h * n + j]);
          for (int c = 0; c < 4; c++) acc[h][c] = _mm512_fmadd_ps(ph, vd[c], acc[h][c]);
        }
      }
      for (int h = 0; h < g; h++)
        for (int c = 0; c < 4; c++) {
          float *out = o + h * D + d + 16 * c;
          _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), acc[h][c]));
        }
    }
    return;
  }
#elif defined(LANES16)
  if (g <= 4 && D % 64 == 0) {
    /* the same sums in 8-lane registers (each column's fused multiply-adds in key order, then added to o: the
       AVX-512 path's numbers), 16 columns at a time */
    for (int64_t d = 0; d < D; d += 16) {
      __m256 acc[4][2];
      for (int h = 0; h < 4; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
      for (int64_t j = j0; j < j1; j++) {
        __m256 v0 = _mm256_loadu_ps(v + j * D + d), v1 = _mm256_loadu_ps(v + j * D + d + 8);
        for (int h = 0; h < 4 && h < g; h++) {
          __m256 ph = _mm256_set1_ps(p[h * n + j]);
          acc[h][0] = _mm256_fmadd_ps(ph, v0, acc[h][0]);
          acc[h][1] = _mm256_fmadd_ps(ph, v1, acc[h][1]);
        }
      }
      for (int h = 0; h < g; h++)
        for (int c = 0; c < 2; c++) {
          float *out = o + h * D + d + 8 * c;
          _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), acc[h][c]));
        }
    }
    return;
  }
#endif
  for (int64_t j = j0; j < j1; j++)
    for (int64_t h = 0; h < g; h++)
      for (int64_t i = 0; i < D; i++) o[h * D + i] += p[h * n + j] * v[j * D + i];
}

/* A PQ layer's picks (layer/onerow.py): tokens whose scaled scores the re-rank computed and whose values are read
   where they lie in the host tier, a fork's two parts included. Per key/value head c: scores (count, group) at
   scores[c * count * group], valid and pos (count,) at [c * count]; position p's value row at shared + c *
   shared_head + p * D when p < S0 (the parent's part of a fork), else at own + c * own_head + (p - S0) * D, in
   elements of the stores' kind (half_rows.h: float32, float16 or bfloat16). */
typedef struct {
  int64_t count, S0, shared_head, own_head, kind;
  const float *scores;
  const void *shared, *own;
  const uint8_t *valid;
  const int64_t *pos;
} Picks;

/* picks whose value rows are prefetched ahead of the one being summed (a row of 64 floats is 4 cache lines; 0.07
   against 0.27 ms a call for 3 x 394 picks among 8K tokens, 3 KV heads, caches cold, ad hoc) */
#define PICKS_AHEAD 8

/* where pick position p's value row of head c starts (an element's address, of the stores' kind) */
static const void *pick_address(const Picks *P, int64_t c, int64_t p, int64_t D) {
  int64_t size = kv_bytes((int)P->kind);
  if (p < P->S0) return (const char *)P->shared + (c * P->shared_head + p * D) * size;
  return (const char *)P->own + (c * P->own_head + (p - P->S0) * D) * size;
}

/* o (g, D) += sum over picks i0..i1 of p[h * n + n_keys + i] v(pos_i): weighted_values for rows read in place */
static void weighted_picks(const float *p, int64_t g, const Picks *P, int64_t c, int64_t i0, int64_t i1, int64_t D,
                           float *o, int64_t n, int64_t n_keys) {
  const int64_t *pos = P->pos + c * P->count;
  int64_t bytes = D * kv_bytes((int)P->kind);
  float buf[P->kind == KV_F32 ? 1 : D]; /* a half row widened */
  for (int64_t i = i0; i < i1; i++) {
    if (i + PICKS_AHEAD < i1) { /* the rows lie scattered in a host tier too large for the caches: ask ahead */
      const char *ahead = pick_address(P, c, pos[i + PICKS_AHEAD], D);
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + b, 0, 0);
    }
    const float *v = row_as_float(pick_address(P, c, pos[i], D), (int)P->kind, 0, 0, D, buf);
    for (int64_t h = 0; h < g; h++) {
      float w = p[h * n + n_keys + i];
      for (int64_t d = 0; d < D; d++) o[h * D + d] += w * v[d];
    }
  }
}

/* rows of a half-precision window widened at a time (16 x D floats on the thread's stack) */
#define HALF_TILE 16

/* scores() over keys j0..j1 stored as `kind` (half_rows.h): float32 rows read as they lie, half rows widened
   HALF_TILE at a time (each score is the same dot product of the same numbers) */
static void kind_scores(const float *q, int64_t g, const void *k, int kind, int64_t j0, int64_t j1, int64_t D,
                        float scaling, float *s, int64_t n) {
  if (kind == KV_F32) {
    scores(q, g, (const float *)k, j0, j1, D, scaling, s, n);
    return;
  }
  float tile[HALF_TILE * D];
  for (int64_t j = j0; j < j1; j += HALF_TILE) {
    int64_t m = j1 - j < HALF_TILE ? j1 - j : HALF_TILE;
    widen_row((const uint16_t *)k + j * D, kind, tile, m * D);
    scores(q, g, tile, 0, m, D, scaling, s + j, n);
  }
}

/* weighted_values() over values j0..j1 stored as `kind`: half rows widened HALF_TILE at a time, each tile's sums
   added to o in turn */
static void kind_weighted_values(const float *p, int64_t g, const void *v, int kind, int64_t j0, int64_t j1,
                                 int64_t D, float *o, int64_t n) {
  if (kind == KV_F32) {
    weighted_values(p, g, (const float *)v, j0, j1, D, o, n);
    return;
  }
  float tile[HALF_TILE * D];
  for (int64_t j = j0; j < j1; j += HALF_TILE) {
    int64_t m = j1 - j < HALF_TILE ? j1 - j : HALF_TILE;
    widen_row((const uint16_t *)v + j * D, kind, tile, m * D);
    weighted_values(p + j, g, tile, 0, m, D, o, n);
  }
}

/* keys and picks from which attend() splits them between the threads: a sliding window's 512 keys too (a 32K decode
   step, the bundled model: 25.2 against 23.9 ms a step with 2,048, ten alternating turns in one process, ad hoc) */
#define SPLIT_KEYS 256

/* attend_row's attention over the n_keys keys (their rows of `kind`) and, after them, the picks (NULL: none) */
static int attend(const float *q, int64_t Hq, const void *k, const void *v, int kind, int64_t Hk,
                  int64_t head_stride, int64_t n_keys, const Picks *P, int64_t D, float scaling, float *out,
                  float *weights, float *lse) {
  int64_t size = kv_bytes(kind);
  int64_t group = Hq / Hk, count = P == NULL ? 0 : P->count, n = n_keys + count;
  int threads = n >= SPLIT_KEYS ? omp_get_max_threads() : 1;
  float *s = malloc(sizeof(float) * Hq * n);             /* (Hq, n) scores, then unnormalised probabilities */
  float *part = calloc(threads * Hq * D, sizeof(float)); /* (threads, Hq, D) each thread's sum of p v */
  double *total = calloc(Hq, sizeof(double));
  if (s == NULL || part == NULL || total == NULL) {
    free(s);
    free(part);
    free(total);
    return -1;
  }
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    /* this thread's share of the keys and its share of the picks, for scores and values: each thread takes part of
       both, since the picks' scattered rows are slower to read than the window's (a PQ layer's 1.6K of each at
       32K: one thread had all the picks, docs/benchmarks.md) */
    int64_t k0 = n_keys * t / nt, k1 = n_keys * (t + 1) / nt, p0 = count * t / nt, p1 = count * (t + 1) / nt;
    for (int64_t c = 0; c < Hk; c++) {
      kind_scores(q + c * group * D, group, (const char *)k + c * head_stride * size, kind, k0, k1, D, scaling,
                  s + c * group * n, n);
      for (int64_t p = p0; p < p1; p++) { /* its picks: the re-rank's scores */
        int64_t i = c * count + p;
        for (int64_t h = 0; h < group; h++)
          s[(c * group + h) * n + n_keys + p] = P->valid[i] ? P->scores[i * group + h] : -INFINITY;
      }
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t h = 0; h < Hq; h++) {
      float top = -INFINITY, *row = s + h * n;
      for (int64_t j = 0; j < n; j++) top = row[j] > top ? row[j] : top;
      for (int64_t j = 0; j < n; j++) row[j] = exp_nonpositive(row[j] - top); /* vectorized, then summed in order */
      double sum = 0.0;
      for (int64_t j = 0; j < n; j++) sum += row[j];
      total[h] = sum;
      if (lse != NULL) lse[h] = top + (float)log(sum); /* the softmax's log-sum-exp, for a part merged in after */
    }
    for (int64_t c = 0; c < Hk; c++) {
      float *o = part + (t * Hq + c * group) * D;
      kind_weighted_values(s + c * group * n, group, (const char *)v + c * head_stride * size, kind, k0, k1, D, o,
                           n);
      if (p1 > p0) weighted_picks(s + c * group * n, group, P, c, p0, p1, D, o, n, n_keys);
    }
  }
  for (int64_t i = 0; i < Hq * D; i++) {
    float sum = 0.0f;
    for (int t = 0; t < threads; t++) sum += part[t * Hq * D + i];
    out[i] = (float)(sum / total[i / D]);
  }
  if (weights != NULL) /* (Hk, n): each key's and pick's weight, summed over its group of query heads */
    for (int64_t c = 0; c < Hk; c++)
      for (int64_t j = 0; j < n; j++) {
        double w = 0.0;
        for (int64_t h = 0; h < group; h++) w += s[(c * group + h) * n + j] / total[c * group + h];
        weights[c * n + j] = (float)w;
      }
  free(s);
  free(part);
  free(total);
  return 0;
}

/* q (Hq, D) -> out (Hq, D): softmax(scaling q . k_j) over the n keys, times the values. k and v: key/value head
   c's row j at element c * head_stride + j * D, of `kind` (half_rows.h: a window kept in float16 or bfloat16 is
   widened as it is read). Query head h reads key/value head h / (Hq / Hk). From SPLIT_KEYS keys on (a sliding
   layer's window included) the keys are split between the threads, each with its own partial sums. Returns 0, or
   -1 when scratch memory could not be allocated. */
int attend_row(const float *q, int64_t Hq, const void *k, const void *v, int64_t kind, int64_t Hk,
               int64_t head_stride, int64_t n, int64_t D, float scaling, float *out) {
  return attend(q, Hq, k, v, (int)kind, Hk, head_stride, n, NULL, D, scaling, out, NULL, NULL);
}

int attend_picks_lse(const float *q, int64_t Hq, const void *k, const void *v, int64_t kv_kind, int64_t Hk,
                     int64_t head_stride, int64_t n, int64_t D, float scaling, int64_t count, const float *pick_scores,
                     const uint8_t *pick_valid, const int64_t *pos, const void *shared, int64_t shared_head,
                     int64_t S0, const void *own, int64_t own_head, int64_t kind, float *out, float *weights,
                     float *lse);

/* attend_row over the n keys (a PQ layer's sinks, ring and new token) and a PQ layer's picks (see Picks): one
   softmax over both. The picks' keys are never read, their values where they lie. k and v are of kv_kind (a
   CPU's window buffer is kept at the host tier's kind), the stores of kind. weights (NULL: not wanted) gets
   (Hk, n + count): the attention each key and pick received, summed over the query heads that share its head. */
int attend_picks(const float *q, int64_t Hq, const void *k, const void *v, int64_t kv_kind, int64_t Hk,
                 int64_t head_stride, int64_t n, int64_t D, float scaling, int64_t count, const float *pick_scores,
                 const uint8_t *pick_valid, const int64_t *pos, const void *shared, int64_t shared_head, int64_t S0,
                 const void *own, int64_t own_head, int64_t kind, float *out, float *weights) {
  return attend_picks_lse(q, Hq, k, v, kv_kind, Hk, head_stride, n, D, scaling, count, pick_scores, pick_valid, pos,
                          shared, shared_head, S0, own, own_head, kind, out, weights, NULL);
}

/* attend_picks, and lse (Hq,): each query head's log-sum-exp of its scores (NULL: not wanted) */
int attend_picks_lse(const float *q, int64_t Hq, const void *k, const void *v, int64_t kv_kind, int64_t Hk,
                     int64_t head_stride, int64_t n, int64_t D, float scaling, int64_t count, const float *pick_scores,
                     const uint8_t *pick_valid, const int64_t *pos, const void *shared, int64_t shared_head,
                     int64_t S0, const void *own, int64_t own_head, int64_t kind, float *out, float *weights,
                     float *lse) {
  Picks P = {count, S0, shared_head, own_head, kind, pick_scores, shared, own, pick_valid, pos};
  return attend(q, Hq, k, v, (int)kv_kind, Hk, head_stride, n, &P, D, scaling, out, weights, lse);
}

/* x (E,), the attention's output attn (Hq D,) -> y (E,): the rest of the layer (y may not be x) */
int layer_out(const Layer *L, const float *x, const float *attn, float *y) {
  int64_t E = L->E, I = L->I;
  float *t = malloc(sizeof(float) * E), *h = malloc(sizeof(float) * E), *gu = malloc(sizeof(float) * 3 * I);
  int failed = t == NULL || h == NULL || gu == NULL;
  if (!failed) failed = int8_rows_mm(attn, L->o_q, L->o_scale, t, 1, E, L->Hq * L->D);
  if (!failed) {
    if (L->w_post_attn != NULL) rms_norm(t, L->w_post_attn, t, E, L->eps);
    for (int64_t i = 0; i < E; i++) y[i] = x[i] + t[i]; /* the residual stream after attention */
    rms_norm(y, L->w_pre_ff, h, E, L->eps);
    failed = int8_rows_mm(h, L->gate_up_q, L->gate_up_scale, gu, 1, 2 * I, E);
  }
  if (!failed) {
    float *act = gu + 2 * I;
    if (L->act == 1)
      for (int64_t i = 0; i < I; i++) act[i] = silu(gu[i]) * gu[I + i];
    else
      for (int64_t i = 0; i < I; i++) act[i] = gelu_tanh(gu[i]) * gu[I + i];
    failed = int8_rows_mm(act, L->down_q, L->down_scale, t, 1, E, I);
  }
  if (!failed) {
    if (L->w_post_ff != NULL) rms_norm(t, L->w_post_ff, t, E, L->eps);
    for (int64_t i = 0; i < E; i++) y[i] += t[i];
  }
  free(t);
  free(h);
  free(gu);
  return failed ? -1 : 0;
}

/* A sliding-window layer's whole step (fastpath/layer.py): layer_qkv, the new key and value into row `slot` of the
   window's buffers k and v (Hk heads head_stride elements apart, rows of kind; rounded as torch's copy rounds),
   attention over the n rows ending at that row (attend_row's), then layer_out -> y (E,). One call instead of three
   and the cache's two copies between them. Returns 0, or -1 without scratch memory (the row may then hold the new
   token already). */
int layer_window_step(const Layer *L, const float *x, const float *cos, const float *sin_signed, void *k, void *v,
                      int64_t kind, int64_t head_stride, int64_t slot, int64_t n, float scaling, float *y) {
  int64_t Hq = L->Hq, Hk = L->Hk, D = L->D, size = kv_bytes((int)kind);
  float *qkv = malloc(sizeof(float) * (Hq + 2 * Hk) * D), *attn = malloc(sizeof(float) * Hq * D);
  int failed = qkv == NULL || attn == NULL || layer_qkv(L, x, cos, sin_signed, qkv);
  for (int64_t c = 0; !failed && c < Hk; c++) {
    int64_t at = (c * head_stride + slot * D) * size;
    narrow_row(qkv + (Hq + c) * D, (int)kind, (char *)k + at, D);
    narrow_row(qkv + (Hq + Hk + c) * D, (int)kind, (char *)v + at, D);
  }
  int64_t first = (slot + 1 - n) * D * size;
  if (!failed) failed = attend(qkv, Hq, (char *)k + first, (char *)v + first, (int)kind, Hk, head_stride, n, NULL, D,
                               scaling, attn, NULL, NULL);
  if (!failed) failed = layer_out(L, x, attn, y);
  free(qkv);
  free(attn);
  return failed ? -1 : 0;
}
