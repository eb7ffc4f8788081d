/* exp_fixed(x): e^x in float32 from plain IEEE operations only (Cephes' expf: the range reduction
 * x = n ln2 + r with n rounded to nearest by the 1.5 * 2^23 trick, a degree-6 polynomial in r, the
 * power of two put in the exponent bits). Error within 2 ulp of e^x for normal results; x > 88.72
 * gives +inf, x < -87.33 gives 0 (no subnormal results), a NaN gives a NaN.
 *
 * No table and no branch: a loop over an array of it vectorises, and every element, in the vector
 * body or the scalar tail, goes through the same operations, so its bits do not depend on its place
 * or on the length of the loop (with -ffp-contract=off: no multiply-add contracted).
 */
#ifndef ENGRAM_SERVE_FEXP_H
#define ENGRAM_SERVE_FEXP_H
#include <stdint.h>
#include <string.h>

static inline float exp_fixed(float x) {
    const float hi = 88.7228317f, lo = -87.3365479f;
    const float xc = x > hi ? hi : (x < lo ? lo : x); /* a NaN passes through */
    const float magic = 12582912.0f;                  /* 1.5 * 2^23: adding it rounds to an integer */
    const float t = xc * 1.44269504088896341f + magic;
    uint32_t tb;
    memcpy(&tb, &t, 4);
    const float n = t - magic;
    const float r = xc - n * 0.693359375f - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const uint32_t eb = (tb - 0x4B400000u + 127u) << 23; /* 2^n as float bits */
    float scale;
    memcpy(&scale, &eb, 4);
    const float y = p * scale;
    return x > hi ? INFINITY : (x < lo ? 0.0f : y);
}
#endif
