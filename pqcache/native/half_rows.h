/* Rows of the host tier in half precision, read as float32: the kernels that read keys or values where they lie
   (gather_dot.c, layer_step.c's attend_picks) take a store of float32, float16 (IEEE binary16) or bfloat16 rows.
   A half row is widened into a small float buffer before the same float32 arithmetic, so a half store gives the
   same sums as a float32 store holding the same (rounded) numbers. Widening is exact in both formats.

   KV_F32, KV_F16, KV_BF16: the store's element kind, as native/__init__.py's KV_KINDS numbers them. */
#ifndef PQCACHE_HALF_ROWS_H
#define PQCACHE_HALF_ROWS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define KV_F32 0
#define KV_F16 1
#define KV_BF16 2

static inline float f16_to_float(uint16_t h) { /* binary16 -> binary32, subnormals, infinities and NaNs kept */
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0 && man == 0) {
    bits = sign;
  } else if (exp == 0) { /* subnormal: shift the mantissa up until its leading one is the implicit bit */
    int32_t e = 127 - 15 + 1;
    while (!(man & 0x400)) {
      man <<= 1;
      e--;
    }
    bits = sign | ((uint32_t)e << 23) | ((man & 0x3ff) << 13);
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline float bf16_to_float(uint16_t h) { /* bfloat16 is float32's upper half */
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* n elements of kind `kind` at `row` -> out (n floats) */
static inline void widen_row(const void *row, int kind, float *out, int64_t n) {
  const uint16_t *h = (const uint16_t *)row;
  int64_t i = 0;
  if (kind == KV_F16) {
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = f16_to_float(h[i]);
  } else {
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
      __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
      _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
#endif
    for (; i < n; i++) out[i] = bf16_to_float(h[i]);
  }
}

/* row p of a store whose rows lie `stride` elements apart, as floats: a pointer into a float32 store, or the row
   widened into buf (D floats) */
static inline const float *row_as_float(const void *store, int kind, int64_t stride, int64_t p, int64_t D,
                                        float *buf) {
  if (kind == KV_F32) return (const float *)store + p * stride;
  widen_row((const uint16_t *)store + p * stride, kind, buf, D);
  return buf;
}

static inline int64_t kv_bytes(int kind) { return kind == KV_F32 ? 4 : 2; }

/* float32 -> binary16, nearest even (torch's conversion: the FP16 library's, as c10::Half rounds; NaN -> 0x7E00) */
static inline uint16_t float_to_f16(float f) {
  uint32_t w, bias, b;
  memcpy(&w, &f, sizeof w);
  uint32_t shl1 = w + w, sign = w & 0x80000000u;
  float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f; /* overflow to inf, then the exponent room for rounding */
  bias = shl1 & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  bias = (bias >> 1) + 0x07800000u;
  float bias_f;
  memcpy(&bias_f, &bias, sizeof bias_f);
  base = bias_f + base; /* the float adder rounds the mantissa to 10 bits, to nearest even */
  memcpy(&b, &base, sizeof b);
  uint32_t nonsign = ((b >> 13) & 0x7C00u) + (b & 0x0FFFu);
  return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
}

/* float32 -> bfloat16, nearest even (c10::BFloat16's round_to_nearest_even; NaN -> 0x7FC0) */
static inline uint16_t float_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* n floats -> n elements of kind `kind` at row, each rounded as torch's copy into such a tensor rounds it */
static inline void narrow_row(const float *in, int kind, void *row, int64_t n) {
  if (kind == KV_F32) {
    memcpy(row, in, sizeof(float) * n);
    return;
  }
  uint16_t *h = (uint16_t *)row;
  for (int64_t i = 0; i < n; i++) h[i] = kind == KV_F16 ? float_to_f16(in[i]) : float_to_bf16(in[i]);
}

#endif
