/* The one f16 / bf16 <-> f32 converter: scalar and array forms, static inline so
 * that half.c (wire values) and merge.c (pushes in f16/bf16) share one
 * implementation and one rounding. f16 uses F16C / AVX-512 where the translation
 * unit is compiled for them (the build's -march, or the x86-64-v3/v4 copies of
 * run-time dispatch, stella_isa.h); every path gives the same bits (f16 -> f32 is
 * exact, NaNs made quiet; f32 -> f16 rounds to nearest even in hardware and in the
 * soft version alike). */
#ifndef STELLA_HALF_H
#define STELLA_HALF_H

#include "stella_native.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* IEEE binary16, round to nearest even; NaN stays NaN (quiet), overflow -> inf. */
static inline uint16_t stella_f32_to_f16_soft(float f) {
    uint32_t x = stella_f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf or NaN */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x0200u | ((ax >> 13) & 0x3ffu) : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (ax < 0x38800000u) { /* result is subnormal or zero: exact RNE via float addition */
        float r = stella_bits_f32(ax) + 0.5f; /* 0.5 = 2^-1; the ulp of [0.5,1) is 2^-24, the f16 denormal step */
        return (uint16_t)(sign | (stella_f32_bits(r) - 0x3f000000u));
    }
    uint32_t mant_odd = (ax >> 13) & 1u;
    ax += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round */
    return (uint16_t)(sign | (ax >> 13));
}

static inline float stella_f16_to_f32_soft(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) /* inf, or NaN made quiet (as F16C does: the same bits on every path) */
        return stella_bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0u));
    if (e == 0) { /* zero / subnormal: m * 2^-24 exactly */
        float v = (float)m * stella_bits_f32(0x33800000u);
        return stella_bits_f32(sign | stella_f32_bits(v));
    }
    return stella_bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

/* One f16 value (the merge's per-entry load). */
static inline float stella_half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return stella_f16_to_f32_soft(h);
#endif
}

/* One bf16 value: the upper half of a float32. */
static inline float stella_bf16_to_float(uint16_t h) { return stella_bits_f32((uint32_t)h << 16); }

/* bfloat16, round to nearest even (as torch: NaN -> 0x7fc0 with the sign kept). */
static inline uint16_t stella_float_to_bf16(float f) {
    uint32_t u = stella_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void stella_f32_to_f16_n(const float *in, int64_t n, uint16_t *out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) out[i] = stella_f32_to_f16_soft(in[i]);
}

static inline void stella_f16_to_f32_n(const uint16_t *in, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(in + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
#endif
    for (; i < n; i++) out[i] = stella_f16_to_f32_soft(in[i]);
}

#endif
