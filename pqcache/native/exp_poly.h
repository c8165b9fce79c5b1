/* exp(x) for x <= 0 in plain float arithmetic that the compiler vectorizes (libm's expf and tanhf are calls, one
   value at a time: 2,048 tanhf of a Gemma MLP took 40 us, 0.7 ms of a decode step's 18 layers, Zen 3, ad hoc).

   2^n p(r), r = x - n ln 2, with Cephes' expf polynomial: within 1 ulp of the exact value on every 64th float of
   [-87, 0]; n is rounded by adding and subtracting 1.5 * 2^23, and the loops calling it vectorize where
   -fno-trapping-math lets the compiler compute both sides of a select (native/__init__.py's FLAGS). Below -87: 0.
   A NaN gives a NaN. */
#ifndef PQCACHE_EXP_POLY_H
#define PQCACHE_EXP_POLY_H
#include <stdint.h>
#include <string.h>

static inline float exp_nonpositive(float x) {
  float clamped = x < -87.0f ? -87.0f : x;
  float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

/* 1 / (1 + exp(-z)) from exp_nonpositive of -|z|: no overflow on either side */
static inline float sigmoid(float z) {
  float e = exp_nonpositive(z < 0.0f ? z : -z);
  return (z < 0.0f ? e : 1.0f) / (1.0f + e);
}
#endif
