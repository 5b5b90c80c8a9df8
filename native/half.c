/* Bulk f16 / bf16 <-> f32 conversion of wire values (cdefs/codec.h), with the one
 * converter of stella_half.h, and the sum of squares of wire values. Dispatched by
 * ISA level (stella_isa.h): the x86-64-v3 copy converts f16 with F16C, 8 values an
 * instruction, the v4 copy with AVX-512, 16; the bf16 loops and the sum of squares
 * are plain C that the compiler vectorises to the level's width. Every copy gives
 * the same bits. */
#include "stella_native.h"
#include "stella_half.h"

#include "cdefs/codec.h"

void STELLA_ISA_FN(stella_f32_to_f16)(const float *in, int64_t n, uint16_t *out) { stella_f32_to_f16_n(in, n, out); }

void STELLA_ISA_FN(stella_f16_to_f32)(const uint16_t *in, int64_t n, float *out) { stella_f16_to_f32_n(in, n, out); }

void STELLA_ISA_FN(stella_f32_to_bf16)(const float *in, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = stella_float_to_bf16(in[i]);
}

void STELLA_ISA_FN(stella_bf16_to_f32)(const uint16_t *in, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = stella_bf16_to_float(in[i]);
}

/* The sum of the squares of n values (STELLA_VAL_F32/F16/BF16), accumulated in
 * float64 (a float32 square of 3e38 overflows): a push's L2 norm for the server's
 * push-norm bounds. Values are finite (the wire decoder checked them). Halves are
 * converted a chunk at a time into a buffer on the stack (the array is not copied).
 * A float32 times itself is exact in float64 (48 bits of product), so the sum depends
 * only on the order of its additions: value i goes to partial sum i % SUMSQ_LANES, and
 * the partial sums are added in a fixed tree. Every ISA level gives the same bits;
 * the 16 sums are two AVX-512 or four AVX2 registers of float64. */
#define SUMSQ_LANES 16
#define SUMSQ_CHUNK 512 /* a multiple of SUMSQ_LANES: a chunk's value j is the array's value i + j */

int STELLA_ISA_FN(stella_values_sumsq)(const void *val, int64_t n, int32_t dtype, double *out) {
    if (n < 0 || (n > 0 && !val) || !out ||
        (dtype != STELLA_VAL_F32 && dtype != STELLA_VAL_F16 && dtype != STELLA_VAL_BF16))
        return STELLA_E_ARG;
    double s[SUMSQ_LANES] = {0};
    float buf[SUMSQ_CHUNK];
    for (int64_t i = 0; i < n; i += SUMSQ_CHUNK) {
        const int64_t m = n - i < SUMSQ_CHUNK ? n - i : SUMSQ_CHUNK;
        const float *x = buf;
        if (dtype == STELLA_VAL_F32) {
            x = (const float *)val + i;
        } else if (dtype == STELLA_VAL_F16) {
            stella_f16_to_f32_n((const uint16_t *)val + i, m, buf);
        } else {
            const uint16_t *h = (const uint16_t *)val + i;
            for (int64_t j = 0; j < m; j++) buf[j] = stella_bf16_to_float(h[j]);
        }
        int64_t j = 0;
        for (; j + SUMSQ_LANES <= m; j += SUMSQ_LANES)
            for (int l = 0; l < SUMSQ_LANES; l++) s[l] += (double)x[j + l] * (double)x[j + l];
        for (int l = 0; j < m; j++, l++) s[l] += (double)x[j] * (double)x[j];
    }
    for (int w = SUMSQ_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) s[l] += s[l + w];
    *out = s[0];
    return STELLA_OK;
}

#if STELLA_ISA_BASE
STELLA_ISA_VARIANTS(stella_values_sumsq);
STELLA_ISA_VARIANTS(stella_f32_to_f16);
STELLA_ISA_VARIANTS(stella_f16_to_f32);
STELLA_ISA_VARIANTS(stella_f32_to_bf16);
STELLA_ISA_VARIANTS(stella_bf16_to_f32);

void stella_f32_to_f16(const float *in, int64_t n, uint16_t *out) { STELLA_ISA_PICK(stella_f32_to_f16)(in, n, out); }

void stella_f16_to_f32(const uint16_t *in, int64_t n, float *out) { STELLA_ISA_PICK(stella_f16_to_f32)(in, n, out); }

void stella_f32_to_bf16(const float *in, int64_t n, uint16_t *out) { STELLA_ISA_PICK(stella_f32_to_bf16)(in, n, out); }

void stella_bf16_to_f32(const uint16_t *in, int64_t n, float *out) { STELLA_ISA_PICK(stella_bf16_to_f32)(in, n, out); }

int stella_values_sumsq(const void *val, int64_t n, int32_t dtype, double *out) {
    return STELLA_ISA_PICK(stella_values_sumsq)(val, n, dtype, out);
}
#endif
