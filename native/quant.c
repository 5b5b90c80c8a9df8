/* The low-bit value codings of pushes and of the server's broadcast, q4 and q2 (their
 * format is below). Dispatched by ISA level (stella_isa.h): the loops run a chunk
 * of 64 values at a time with no dependences between values, so each copy's
 * compiler vectorises them to its width, and the levels are looked up in registers
 * (q_dequant). Every copy gives the same bits. */
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "stella_native.h"

#include "cdefs/codec.h"

/* ---- q4 / q2 --------------------------------------------------------------
 *
 * A frame of n values coded with b = 4 (q4) or b = 2 (q2) bits, L = 2^b levels:
 *   ceil(n / QCHUNK) scales, little-endian float32, one per chunk of QCHUNK (64)
 *   consecutive values (the last chunk may be short); then ceil(n b / 8) bytes of
 *   codes: value i's code k (0 <= k < L) in bits (i b) mod 8 .. + b of byte (i b) / 8,
 *   least significant bit first; the last byte's unused high bits are zero.
 * A chunk's scale m is its largest magnitude, and code k decodes to m * lv[k] with
 * lv[k] = (float)((2k - (L-1)) / (double)(L-1)): the mid-rise levels +-m/(L-1),
 * +-3m/(L-1), ..., +-m (step s = 2m/(L-1); zero is not a level). The encoder takes
 * the nearest level, k = floor(x h + (h + 1/2)) with x = v / m and h = (L-1)/2, each
 * operation a float32 one (a tie goes up; separate statements, and GCC's ISO mode
 * does not contract them into an FMA, so NumPy and torch compute the same bits), and
 * k = L/2 (+0) in a chunk whose m is 0. The largest magnitude travels exactly, so
 * quantising decoded values again reproduces them bit for bit. Decoders refuse a
 * scale with its sign bit set, NaN or Inf (STELLA_E_SCALE): every level of a valid
 * scale is finite.
 */
static inline int q_bits(int32_t dtype) {
    return dtype == STELLA_VAL_Q4 ? 4 : dtype == STELLA_VAL_Q2 ? 2 : 0;
}

static void q_levels(int b, float *lv) {
    const int top = (1 << b) - 1;
    for (int k = 0; k <= top; k++) lv[k] = (float)((double)(2 * k - top) / (double)top);
}

static inline int64_t q_chunks(int64_t n) { return (n + STELLA_QCHUNK - 1) / STELLA_QCHUNK; }

/* d[j] = m * lv[k[j]] for the len (<= STELLA_QCHUNK) codes of a chunk: the levels are
 * a table of at most 16 floats, looked up in registers (AVX-512: one permute of 16;
 * AVX2: two of 8 and a blend) rather than by a gather or one value at a time. The
 * same float product either way. */
static inline void q_dequant(const uint8_t *k, int len, float m, const float *lv, float *d) {
    int j = 0;
#if defined(__AVX512F__)
    const __m512 tab = _mm512_loadu_ps(lv), mm = _mm512_set1_ps(m);
    for (; j + 16 <= len; j += 16) {
        const __m512i ix = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(k + j)));
        _mm512_storeu_ps(d + j, _mm512_mul_ps(mm, _mm512_permutexvar_ps(ix, tab)));
    }
#elif defined(__AVX2__)
    const __m256 lo = _mm256_loadu_ps(lv), hi = _mm256_loadu_ps(lv + 8), mm = _mm256_set1_ps(m);
    for (; j + 8 <= len; j += 8) {
        const __m256i ix = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(k + j)));
        const __m256 up = _mm256_castsi256_ps(_mm256_cmpgt_epi32(ix, _mm256_set1_epi32(7)));
        const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, ix), _mm256_permutevar8x32_ps(hi, ix), up);
        _mm256_storeu_ps(d + j, _mm256_mul_ps(mm, v));
    }
#endif
    for (; j < len; j++) d[j] = m * lv[k[j]];
}

#if !STELLA_ISA_VARIANT /* not dispatched: defined once, whether dispatch is on or off */
int64_t stella_q_size(int64_t n, int32_t dtype) {
    const int b = q_bits(dtype);
    if (!b || n < 0 || n > STELLA_MAX_CODED_NUMEL) return STELLA_E_ARG;
    return 4 * q_chunks(n) + (n * b + 7) / 8;
}
#endif

int64_t STELLA_ISA_FN(stella_q_encode)(const float *in, int64_t n, int32_t dtype, uint8_t *out, int64_t cap,
                                       float *deq) {
    const int64_t size = stella_q_size(n, dtype);
    if (size < 0) return size;
    if (n > 0 && (!in || (out && cap < size))) return STELLA_E_ARG;
    const int b = q_bits(dtype), top = (1 << b) - 1;
    const float h = 0.5f * (float)top, hh = h + 0.5f;
    float lv[16] = {0}; /* q2 fills 4: the vector lookups load all 16 */
    q_levels(b, lv);
    const int64_t nchunks = q_chunks(n);
    uint8_t *codes = out ? out + 4 * nchunks : NULL;
    /* A chunk at a time, in three loops without dependences between values, which the
     * compiler vectorises: the largest magnitude, then every code into k[] (one
     * division, product and sum each, as above), then the bytes of codes and the
     * decoded values from k[]. A chunk's codes fill whole bytes (64 b bits); the last
     * chunk's missing values are code 0, the zero padding bits. */
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t i0 = c * STELLA_QCHUNK;
        const int len = (int)(n - i0 < STELLA_QCHUNK ? n - i0 : STELLA_QCHUNK);
        const float *x = in + i0;
        /* finite magnitudes order as their bit patterns; NaN/Inf have all exponent bits */
        uint32_t amax = 0, bad = 0;
        for (int j = 0; j < len; j++) {
            const uint32_t a = stella_f32_bits(x[j]) & 0x7fffffffu;
            bad |= a >= 0x7f800000u;
            amax = a > amax ? a : amax;
        }
        if (bad) return STELLA_E_NONFINITE;
        const float m = stella_bits_f32(amax);
        if (out) stella_store32le(out + 4 * c, amax);
        uint8_t k[STELLA_QCHUNK];
        if (amax) {
            for (int j = 0; j < len; j++) {
                const float y = (x[j] / m) * h;
                const float t = y + hh;
                const int kj = (int)t; /* floor: |x / m| <= 1, so t >= 1/2 */
                k[j] = (uint8_t)(kj > top ? top : kj);
            }
        } else {
            memset(k, (top + 1) / 2, (size_t)len);
        }
        if (codes) {
            memset(k + len, 0, (size_t)(STELLA_QCHUNK - len));
            uint8_t *o = codes + (i0 * b >> 3);
            const int nbytes = (len * b + 7) >> 3;
            if (b == 4)
                for (int j = 0; j < nbytes; j++) o[j] = (uint8_t)(k[2 * j] | k[2 * j + 1] << 4);
            else
                for (int j = 0; j < nbytes; j++)
                    o[j] = (uint8_t)(k[4 * j] | k[4 * j + 1] << 2 | k[4 * j + 2] << 4 | k[4 * j + 3] << 6);
        }
        if (deq) q_dequant(k, len, m, lv, deq + i0); /* after in[] is read: deq may be in */
    }
    return size;
}

int64_t STELLA_ISA_FN(stella_q_decode)(const uint8_t *buf, int64_t len, int64_t n, int32_t dtype, float *out) {
    const int64_t size = stella_q_size(n, dtype);
    if (size < 0) return size;
    if (len != size) return STELLA_E_CORRUPT;
    if (n == 0) return 0;
    if (!buf || !out) return STELLA_E_ARG;
    const int b = q_bits(dtype);
    const int64_t nchunks = q_chunks(n), nbits = n * b;
    const uint8_t *codes = buf + 4 * nchunks;
    if ((nbits & 7) && (codes[nbits >> 3] >> (nbits & 7))) return STELLA_E_CORRUPT;
    for (int64_t c = 0; c < nchunks; c++) /* sign bit, NaN or Inf: all >= 0x7f800000 */
        if (stella_load32le(buf + 4 * c) >= 0x7f800000u) return STELLA_E_SCALE;
    float lv[16] = {0}; /* q2 fills 4: the vector lookups load all 16 */
    q_levels(b, lv);
    for (int64_t c = 0; c < nchunks; c++) {
        const float m = stella_bits_f32(stella_load32le(buf + 4 * c));
        const int64_t i0 = c * STELLA_QCHUNK;
        const int len = (int)(n - i0 < STELLA_QCHUNK ? n - i0 : STELLA_QCHUNK);
        const uint8_t *o = codes + (i0 * b >> 3);
        uint8_t k[STELLA_QCHUNK];
        const int nbytes = (len * b + 7) >> 3; /* the chunk's codes; any past len in the last byte go unused */
        if (b == 4)
            for (int j = 0; j < nbytes; j++) {
                k[2 * j] = o[j] & 15u;
                k[2 * j + 1] = o[j] >> 4;
            }
        else
            for (int j = 0; j < nbytes; j++) {
                k[4 * j] = o[j] & 3u;
                k[4 * j + 1] = (o[j] >> 2) & 3u;
                k[4 * j + 2] = (o[j] >> 4) & 3u;
                k[4 * j + 3] = o[j] >> 6;
            }
        q_dequant(k, len, m, lv, out + i0);
    }
    return n;
}

#if STELLA_ISA_BASE
STELLA_ISA_VARIANTS(stella_q_encode);
STELLA_ISA_VARIANTS(stella_q_decode);

int64_t stella_q_encode(const float *in, int64_t n, int32_t dtype, uint8_t *out, int64_t cap, float *deq) {
    return STELLA_ISA_PICK(stella_q_encode)(in, n, dtype, out, cap, deq);
}

int64_t stella_q_decode(const uint8_t *buf, int64_t len, int64_t n, int32_t dtype, float *out) {
    return STELLA_ISA_PICK(stella_q_decode)(buf, len, n, dtype, out);
}
#endif
