/* Error feedback fused with top-k selection, for contiguous float32 CPU tensors.
 *
 * One streaming pass computes acc = res + grad, emits the coordinates whose
 * score reaches a threshold (indices come out sorted, for free), zeroes them in
 * the residual and stores everything else back: the residual memory is read
 * once and written once, the gradient read once.
 *
 * unit == 1            : score = |acc[i]|                     (method "threshold")
 * unit == STELLA_BLOCK : score = sum of acc^2 over a 16-float block, whole
 *                        blocks are emitted as 16 consecutive element indices
 *                        (method "block")
 *
 * The API (cdefs/compress.h) takes typed structs: stella_topk_args (what to
 * select), stella_topk_state (carried per tensor), stella_topk_out (where the
 * selection goes) and, optionally, stella_topk_stats (counters of the call).
 *
 * Two thresholds come from the caller's per-tensor state (carried across
 * steps) or, when it has none, from a random sample of scores (runs of 256
 * floats, one page each): thr, aimed at 1.2 k units, decides what is emitted
 * as a candidate; tz >= thr, aimed at k, decides what the pass zeroes. The
 * final cut is usually "everything >= tz" (within [0.9 k, 1.1 k]): a
 * compaction of the candidates with no write into the residual. Otherwise a
 * histogram cut over the candidates (or an exact radix select, for ties) picks
 * the units and the few that disagree with the pass are fixed up. Fewer than
 * 0.9 k candidates make the residual whole again and the pass is repeated
 * (gradient-free, read-mostly) at a lower threshold; too many for the buffer
 * likewise at a higher one; after three tries an exact radix select over all
 * scores gives the threshold. The thresholds for the next step are the ones
 * that would have given 1.6 k (CARRY_AIM) and k units this step (extrapolated
 * with the local slope of the count just below the cut), corrected by the
 * step-to-step drift.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "stella_native.h"

#include "cdefs/compress.h"

/* The block kernels below (AVX-512 lanes, block_score16) are written for 16 floats. */
_Static_assert(STELLA_BLOCK == 16, "compress.c's block kernels assume 16-float blocks");

#ifdef STELLA_CDEBUG
#include <stdio.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_TRIES 3
#define AIM 1.2 /* aim the pass at this many times k units */
/* A carried threshold (last step's) at this many: the residual has moved since, and a
 * pass that draws too few units (< 0.9 k) costs another pass over the tensor, while one
 * that draws more costs only their compaction until the check (1.7x what it aims at)
 * sends it to a fresh estimate; the caller's buffer holds 3k + 1024 units
 * (stella_topk_cap_units). Measured
 * (bench.compress --workload bytelm and its 1M tensors, bench.broadcast; AMD EPYC Zen 4):
 * over a training run's first steps, 1.2 took a second pass in 6-33% of the calls, 1.4
 * in 2-16%, 1.6 in 1-6%; 1.8 and 2.0 cost more in compaction and overflows than they saved. */
#define CARRY_AIM 1.6


/* Smallest positive float (a denormal): "select every nonzero". */
#define TINY_BITS 1u
static inline float tiny(void) { return stella_bits_f32(TINY_BITS); }

/* Monotone key of |x| (NaN maps to 0, so it never wins a selection). */
static inline uint32_t abs_key(float x) {
    uint32_t u = stella_f32_bits(x) & 0x7fffffffu;
    return u > 0x7f800000u ? 0u : u;
}

static inline uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The k-th largest |v[i]| (1 <= k <= n), exact: two radix passes of 16 bits. */
static float kth_largest_key(const float *v, int64_t n, int64_t k, uint32_t *hist) {
    if (k < 1) k = 1;
    if (k > n) k = n;
    memset(hist, 0, 32768 * sizeof(uint32_t));
    for (int64_t i = 0; i < n; i++) hist[abs_key(v[i]) >> 16]++;
    int64_t cum = 0;
    int b = 32767;
    for (; b > 0; b--) {
        if (cum + (int64_t)hist[b] >= k) break;
        cum += hist[b];
    }
    int64_t r = k - cum;
    memset(hist, 0, 65536 * sizeof(uint32_t));
    for (int64_t i = 0; i < n; i++) {
        uint32_t key = abs_key(v[i]);
        if ((key >> 16) == (uint32_t)b) hist[key & 0xffffu]++;
    }
    cum = 0;
    int lo = 65535;
    for (; lo > 0; lo--) {
        if (cum + (int64_t)hist[lo] >= r) break;
        cum += hist[lo];
    }
    return stella_bits_f32(((uint32_t)b << 16) | (uint32_t)lo);
}

#if !STELLA_ISA_VARIANT /* not dispatched: scalar radix passes */
float stella_kth_largest_abs(const float *v, int64_t n, int64_t k) {
    if (!v || n < 1 || k < 1 || k > n) return NAN;
    uint32_t *hist = malloc(65536 * sizeof(uint32_t));
    if (!hist) return NAN;
    float t = kth_largest_key(v, n, k, hist);
    free(hist);
    return t;
}
#endif

/* Sum of squares of one 16-float block (a partial block is zero-padded by the
 * caller). The same reduction order everywhere, so a threshold computed on
 * scores compares exactly with the pass's scores. */
static inline float block_score16(const float *a) {
#if defined(__AVX512F__)
    __m512 v = _mm512_loadu_ps(a);
    return _mm512_reduce_add_ps(_mm512_mul_ps(v, v));
#else
    float s[8];
    for (int j = 0; j < 8; j++) s[j] = a[j] * a[j] + a[j + 8] * a[j + 8];
    for (int j = 0; j < 4; j++) s[j] += s[j + 4];
    s[0] += s[2];
    s[1] += s[3];
    return s[0] + s[1];
#endif
}

static inline float block_score(const float *a, int len) {
    if (len == 16) return block_score16(a);
    float t[16] = {0};
    for (int j = 0; j < len; j++) t[j] = a[j];
    return block_score16(t);
}

/* Scores of about `nsample` sampled floats of res (+ g) into samp: runs of
 * RUN consecutive floats (unit 1) or RUN / 16 whole blocks (unit 16) at random
 * places (with replacement); everything when the sample would cover the
 * tensor. Runs of 1 KiB stay inside one page: random pages cost far more than
 * the floats read in them. Returns how many scores were written. */
#define RUN 256

/* Sparse changes not yet added to the residual (stella_ef_topk_add): up to
 * STELLA_TOPK_MAX_ADDS lists of sorted, unique, in-range indices and their values, added
 * list after list. Until the first pass adds them, what a sample reads at a coordinate
 * they touch is (res + val_1 + val_2 ...) + 0, in that order: the float that scatter-adds
 * and then a gradient-free read of the residual would give, so the selection comes out
 * the same. */
typedef struct {
    const stella_sparse_list *list;
    int32_t nlists;
} adds_t;

/* samp[0..len) = res[s..s+len) with the adds that fall there, + 0 (a chunk at a time). */
static void sample_with_adds(const float *res, const adds_t *ad, int64_t s, int64_t len, float *samp) {
    float raw[RUN];
    for (int64_t c = s; c < s + len; c += RUN) {
        const int64_t m = s + len - c < RUN ? s + len - c : RUN;
        memcpy(raw, res + c, (size_t)m * sizeof(float));
        for (int32_t l = 0; l < ad->nlists; l++) {
            const stella_sparse_list *a = &ad->list[l];
            for (int64_t j = stella_lower_bound(a->idx, a->n, c); j < a->n && a->idx[j] < c + m; j++)
                raw[a->idx[j] - c] += a->val[j];
        }
        for (int64_t t = 0; t < m; t++) samp[c - s + t] = raw[t] + 0.f;
    }
}

static int64_t sample_scores(const float *res, const float *g, int64_t n, int unit,
                             int64_t nsample, uint64_t *rng, float *samp, const adds_t *ad) {
    int64_t m = 0;
    if (unit == 1) {
        if (nsample >= n || n < 2 * RUN) {
            if (ad) sample_with_adds(res, ad, 0, n, samp);
            else
                for (int64_t i = 0; i < n; i++) samp[i] = res[i] + (g ? g[i] : 0.f);
            return n;
        }
        int64_t runs = nsample / RUN > 0 ? nsample / RUN : 1;
        uint64_t span = (uint64_t)(n - RUN + 1);
        for (int64_t j = 0; j < runs; j++) {
            int64_t s = (int64_t)(splitmix64(rng) % span);
            if (ad) sample_with_adds(res, ad, s, RUN, samp + m);
            else
                for (int t = 0; t < RUN; t++) samp[m + t] = res[s + t] + (g ? g[s + t] : 0.f);
            m += RUN;
        }
        return m;
    }
    int64_t nu = (n + 15) / 16;
    int64_t want = nsample / 16 > 0 ? nsample / 16 : 1;
    const int64_t rb = RUN / 16; /* blocks a run */
    float a[16];
    if (want >= nu || nu < 2 * rb) {
        for (int64_t b = 0; b < nu; b++) {
            int64_t s = b * 16;
            int len = n - s < 16 ? (int)(n - s) : 16;
            for (int t = 0; t < 16; t++) a[t] = t < len ? res[s + t] + (g ? g[s + t] : 0.f) : 0.f;
            samp[b] = block_score16(a);
        }
        return nu;
    }
    int64_t runs = want / rb > 0 ? want / rb : 1;
    uint64_t span = (uint64_t)(nu - rb + 1);
    for (int64_t j = 0; j < runs; j++) {
        int64_t b0 = (int64_t)(splitmix64(rng) % span);
        for (int64_t b = b0; b < b0 + rb; b++) {
            int64_t s = b * 16;
            int len = n - s < 16 ? (int)(n - s) : 16;
            for (int t = 0; t < 16; t++) a[t] = t < len ? res[s + t] + (g ? g[s + t] : 0.f) : 0.f;
            samp[m++] = block_score16(a);
        }
    }
    return m;
}

/* Threshold whose expected count of units with score >= it is `target`,
 * estimated from a sample; *t2 (if not NULL) gets the one for `target2` from
 * the same sample. */
static float estimate(const float *res, const float *g, const adds_t *ad, int64_t n, int unit, int64_t nsample,
                      uint64_t *rng, double target, float *samp, uint32_t *hist, double target2,
                      float *t2) {
    int64_t nu = unit == 1 ? n : (n + 15) / 16;
    int64_t m = sample_scores(res, g, n, unit, nsample, rng, samp, ad);
    double tg[2] = {target, target2};
    float out[2];
    for (int w = 0; w < (t2 ? 2 : 1); w++) {
        int64_t r = (int64_t)llround((double)m * tg[w] / (double)nu);
        if (r < 1) r = 1;
        if (r > m) r = m;
        float t = kth_largest_key(samp, m, r, hist);
        out[w] = t > 0.f ? t : tiny();
    }
    if (t2) *t2 = out[1];
    return out[0];
}

/* ---- the fused pass ------------------------------------------------------ */

typedef struct {
    int64_t total;    /* units whose score reached thr */
    int64_t units;    /* units emitted */
    int64_t elems;    /* elements emitted */
    int overflow;     /* total > cap and not truncating: nothing kept, res == acc */
} pass_t;

/* unit 1. has_grad is a compile-time constant at each call site. */
/* One candidate (|a| >= thr) at coordinate i: counted, emitted while there is room (or
 * the pass overflows, unless it truncates); returns 1 when its residual is to be zeroed
 * (emitted and |a| >= tz: the rest of the emitted stay until the final cut). */
static inline __attribute__((always_inline)) int emit_candidate(int64_t i, float a, float tz,
                                                                int32_t *STELLA_RESTRICT idx,
                                                                float *STELLA_RESTRICT val, int64_t cap,
                                                                int truncate, pass_t *p) {
    p->total++;
    if (!p->overflow && p->units < cap) {
        idx[p->units] = (int32_t)i;
        val[p->units] = a;
        p->units++;
        return fabsf(a) >= tz;
    }
    if (!truncate) p->overflow = 1;
    return 0;
}

static inline __attribute__((always_inline)) void pass_scalar_body(
    float *STELLA_RESTRICT res, const float *STELLA_RESTRICT grad, const int has_grad, int64_t i0,
    int64_t i1, float thr, float tz, int32_t *STELLA_RESTRICT idx, float *STELLA_RESTRICT val,
    int64_t cap, int truncate, pass_t *p) {
    for (int64_t i = i0; i < i1; i++) {
        float a = has_grad ? res[i] + grad[i] : res[i];
        if (fabsf(a) >= thr && emit_candidate(i, a, tz, idx, val, cap, truncate, p))
            res[i] = 0.f;
        else if (has_grad)
            res[i] = a;
    }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* keep_lanes[m]: the lanes of an 8-bit mask m in order, then zeros (the AVX2 pass's compress). */
static uint8_t keep_lanes[256][8];
__attribute__((constructor)) static void init_keep_lanes(void) {
    for (int m = 0; m < 256; m++) {
        int k = 0;
        for (int j = 0; j < 8; j++)
            if (m >> j & 1) keep_lanes[m][k++] = (uint8_t)j;
    }
}
#endif

/* Coordinates i0..n-1 (i0 a multiple of 16, or n). */
static inline __attribute__((always_inline)) void pass1_impl(
    float *STELLA_RESTRICT res, const float *STELLA_RESTRICT grad, const int has_grad, int64_t i0, int64_t n,
    float thr, float tz, int32_t *STELLA_RESTRICT idx, float *STELLA_RESTRICT val, int64_t cap,
    int truncate, int flat, pass_t *p) {
    int64_t i = i0;
#if defined(__AVX512F__)
    const __m512 vt = _mm512_set1_ps(thr);
    const __m512 vz = _mm512_set1_ps(tz);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* While 16 more candidates fit: no branch on the data. Every block compresses its
     * candidates (maybe none) into a register and stores all 16 lanes where the next go
     * (the slack is within cap), and zeroes its lanes at or above tz through a mask
     * (maybe empty). A branch on "any candidate" (40% of blocks at 1% pushes and W = 2,
     * at random) mispredicted often enough to cost about 40% of the pass. Below about
     * 0.3% candidates the branch is predictable and cheaper (flat: the caller's pick). */
    if (flat && !p->overflow) {
        int64_t u = p->units;
        __m512i ix = _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), iota);
        const __m512i step = _mm512_set1_epi32(16);
        for (; i + 16 <= n && u + 16 <= cap; i += 16) {
            __m512 a = _mm512_loadu_ps(res + i);
            if (has_grad) a = _mm512_add_ps(a, _mm512_loadu_ps(grad + i));
            const __m512 aa = _mm512_abs_ps(a);
            const __mmask16 m = _mm512_cmp_ps_mask(aa, vt, _CMP_GE_OQ);
            _mm512_storeu_ps(val + u, _mm512_maskz_compress_ps(m, a));
            _mm512_storeu_si512(idx + u, _mm512_maskz_compress_epi32(m, ix));
            u += __builtin_popcount((unsigned)m);
            const __mmask16 mz = _mm512_mask_cmp_ps_mask(m, aa, vz, _CMP_GE_OQ);
            if (has_grad)
                _mm512_storeu_ps(res + i, _mm512_maskz_mov_ps((__mmask16)~mz, a));
            else
                _mm512_mask_storeu_ps(res + i, mz, _mm512_setzero_ps());
            ix = _mm512_add_epi32(ix, step);
        }
        p->total += u - p->units;
        p->units = u;
    }
    for (; i + 16 <= n; i += 16) {
        __m512 a = _mm512_loadu_ps(res + i);
        if (has_grad) a = _mm512_add_ps(a, _mm512_loadu_ps(grad + i));
        __mmask16 m = _mm512_cmp_ps_mask(_mm512_abs_ps(a), vt, _CMP_GE_OQ);
        if (STELLA_UNLIKELY(m)) {
            int pc = __builtin_popcount((unsigned)m);
            p->total += pc;
            if (p->overflow) {
                m = 0;
            } else if (p->units + pc > cap) {
                if (truncate) {
                    unsigned t = m, keep = 0;
                    for (int64_t need = cap - p->units; need > 0 && t; need--) {
                        keep |= t & (0u - t);
                        t &= t - 1;
                    }
                    m = (__mmask16)keep;
                } else {
                    p->overflow = 1;
                    m = 0;
                }
                pc = __builtin_popcount((unsigned)m);
            }
            if (m) {
                _mm512_mask_compressstoreu_ps(val + p->units, m, a);
                _mm512_mask_compressstoreu_epi32(
                    idx + p->units, m, _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), iota));
                p->units += pc;
                /* zero only what reaches tz (>= thr): the rest of the emitted
                 * candidates stay in the residual until the final cut */
                __mmask16 mz = _mm512_mask_cmp_ps_mask(m, _mm512_abs_ps(a), vz, _CMP_GE_OQ);
                a = _mm512_maskz_mov_ps((__mmask16)~mz, a);
                if (!has_grad) _mm512_mask_storeu_ps(res + i, mz, a);
            }
        }
        if (has_grad) _mm512_storeu_ps(res + i, a);
    }
#elif defined(__AVX2__)
    /* 16 coordinates per test, two 8-wide compares: a block with nothing at or above
     * the threshold (nearly all of them at 1%) costs a few instructions; one with a
     * candidate goes through the scalar body. */
    const __m256 vt = _mm256_set1_ps(thr);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    /* The branch-free body of the AVX-512 pass above, 8 lanes at a time: the lanes a
     * mask keeps are gathered to the front by a permutation from a table (AVX2 has no
     * compress), and all 8 stored; the zeroing takes a masked store, only where a lane
     * reaches tz (a branch, but one on a fifth of the blocks at most). */
    if (flat && !p->overflow) {
        const __m256 vz = _mm256_set1_ps(tz);
        int64_t u = p->units;
        for (; i + 16 <= n && u + 16 <= cap; i += 16) {
            for (int h = 0; h < 2; h++) {
                __m256 a = _mm256_loadu_ps(res + i + 8 * h);
                if (has_grad) a = _mm256_add_ps(a, _mm256_loadu_ps(grad + i + 8 * h));
                const __m256 aa = _mm256_andnot_ps(sign, a);
                const __m256 ge = _mm256_cmp_ps(aa, vt, _CMP_GE_OQ);
                const unsigned m = (unsigned)_mm256_movemask_ps(ge);
                const __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)keep_lanes[m]));
                _mm256_storeu_ps(val + u, _mm256_permutevar8x32_ps(a, perm));
                _mm256_storeu_si256((__m256i *)(idx + u), _mm256_add_epi32(perm, _mm256_set1_epi32((int32_t)(i + 8 * h))));
                u += __builtin_popcount(m);
                const __m256 z = _mm256_and_ps(ge, _mm256_cmp_ps(aa, vz, _CMP_GE_OQ));
                if (has_grad)
                    _mm256_storeu_ps(res + i + 8 * h, _mm256_andnot_ps(z, a));
                else if (_mm256_movemask_ps(z))
                    _mm256_maskstore_ps(res + i + 8 * h, _mm256_castps_si256(z), _mm256_setzero_ps());
            }
        }
        p->total += u - p->units;
        p->units = u;
    }
    for (; i + 16 <= n; i += 16) {
        __m256 a0 = _mm256_loadu_ps(res + i), a1 = _mm256_loadu_ps(res + i + 8);
        if (has_grad) {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(grad + i));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(grad + i + 8));
        }
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, a0), vt, _CMP_GE_OQ)) |
                     (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, a1), vt, _CMP_GE_OQ)) << 8;
        if (has_grad) {
            _mm256_storeu_ps(res + i, a0);
            _mm256_storeu_ps(res + i + 8, a1);
        }
        if (STELLA_UNLIKELY(m)) { /* the candidates, in order: as pass_scalar_body treats them */
            float a[16];
            _mm256_storeu_ps(a, a0);
            _mm256_storeu_ps(a + 8, a1);
            for (; m; m &= m - 1) {
                const int j = __builtin_ctz(m);
                if (emit_candidate(i + j, a[j], tz, idx, val, cap, truncate, p)) res[i + j] = 0.f;
            }
        }
    }
#else
    for (; i + 16 <= n; i += 16) {
        float a[16];
        int any = 0;
        for (int j = 0; j < 16; j++) {
            a[j] = has_grad ? res[i + j] + grad[i + j] : res[i + j];
            any |= fabsf(a[j]) >= thr;
        }
        if (STELLA_UNLIKELY(any)) {
            pass_scalar_body(res, grad, has_grad, i, i + 16, thr, tz, idx, val, cap, truncate, p);
        } else if (has_grad) {
            for (int j = 0; j < 16; j++) res[i + j] = a[j];
        }
    }
#endif
    pass_scalar_body(res, grad, has_grad, i, n, thr, tz, idx, val, cap, truncate, p);
}

/* unit 16: whole blocks. */
static inline __attribute__((always_inline)) void pass16_impl(
    float *STELLA_RESTRICT res, const float *STELLA_RESTRICT grad, const int has_grad, int64_t n,
    float thr, float tz, int32_t *STELLA_RESTRICT idx, float *STELLA_RESTRICT val,
    float *STELLA_RESTRICT score, int64_t cap, int truncate, pass_t *p) {
    int64_t nb = (n + 15) / 16;
    for (int64_t b = 0; b < nb; b++) {
        int64_t s = b * 16;
        int len = n - s < 16 ? (int)(n - s) : 16;
        float a[16];
#if defined(__AVX512F__)
        __m512 va;
        if (STELLA_LIKELY(len == 16)) {
            va = _mm512_loadu_ps(res + s);
            if (has_grad) va = _mm512_add_ps(va, _mm512_loadu_ps(grad + s));
        } else {
            __mmask16 lm = (__mmask16)((1u << len) - 1u);
            va = _mm512_maskz_loadu_ps(lm, res + s);
            if (has_grad) va = _mm512_add_ps(va, _mm512_maskz_loadu_ps(lm, grad + s));
        }
        float sc = _mm512_reduce_add_ps(_mm512_mul_ps(va, va));
#else
        for (int j = 0; j < 16; j++) a[j] = 0.f;
        for (int j = 0; j < len; j++) a[j] = has_grad ? res[s + j] + grad[s + j] : res[s + j];
        float sc = block_score16(a);
#endif
        int take = 0;
        if (STELLA_UNLIKELY(sc >= thr)) {
            p->total++;
            if (!p->overflow && p->units < cap) {
                take = 1;
            } else if (!truncate) {
                p->overflow = 1;
            }
        }
#if defined(__AVX512F__)
        if (take) {
            __mmask16 lm = (__mmask16)((1u << len) - 1u);
            static const int32_t iota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
            __m512i vi = _mm512_add_epi32(_mm512_set1_epi32((int32_t)s), _mm512_loadu_si512(iota));
            _mm512_mask_storeu_ps(val + p->elems, lm, va);
            _mm512_mask_storeu_epi32(idx + p->elems, lm, vi);
            if (sc >= tz)
                _mm512_mask_storeu_ps(res + s, lm, _mm512_setzero_ps());
            else if (has_grad)
                _mm512_mask_storeu_ps(res + s, lm, va);
            score[p->units] = sc;
            p->units++;
            p->elems += len;
        } else if (has_grad) {
            if (STELLA_LIKELY(len == 16))
                _mm512_storeu_ps(res + s, va);
            else
                _mm512_mask_storeu_ps(res + s, (__mmask16)((1u << len) - 1u), va);
        }
        (void)a;
#else
        if (take) {
            for (int j = 0; j < len; j++) {
                idx[p->elems + j] = (int32_t)(s + j);
                val[p->elems + j] = a[j];
                if (sc >= tz)
                    res[s + j] = 0.f;
                else if (has_grad)
                    res[s + j] = a[j];
            }
            score[p->units] = sc;
            p->units++;
            p->elems += len;
        } else if (has_grad) {
            for (int j = 0; j < len; j++) res[s + j] = a[j];
        }
#endif
    }
}

/* Candidates per coordinate from which pass1_impl runs without a branch on the data
 * (AVX-512): measured crossover 0.3-0.4% on 1.25M coordinates (Sapphire Rapids class). */
#define FLAT_FROM (1.0 / 300.0)

/* unit 1's pass over [lo, hi) of res (the adds' entries there; the gradient's), the
 * candidates into idx/val (room for cap) as pass1_impl writes them: what the pass over
 * the whole does in that range. */
static void pass1_range(float *res, const float *grad, const adds_t *ad, int64_t lo, int64_t hi, float thr, float tz,
                        int32_t *idx, float *val, int64_t cap, int truncate, int flat, pass_t *p) {
    if (ad) { /* each tile's adds (stella_native.h), then the pass over it while its lines are in L1, instead
               * of a scatter over the whole tensor and a pass that reads its lines again from memory */
        int64_t j[STELLA_TOPK_MAX_ADDS] = {0};
        for (int32_t l = 0; l < ad->nlists; l++)
            j[l] = lo ? stella_lower_bound(ad->list[l].idx, ad->list[l].n, lo) : 0;
        stella_prefetch_lines(res, lo, STELLA_ADD_TILE, hi);
        for (int64_t a = lo; a < hi; a += STELLA_ADD_TILE) {
            const int64_t b = hi - a < STELLA_ADD_TILE ? hi : a + STELLA_ADD_TILE;
            stella_add_lists_below(res, ad->list, ad->nlists, j, b);
            for (int64_t s = a; s < b; s += STELLA_ADD_STEP) { /* the next tile's lines asked for as it goes */
                stella_prefetch_lines(res, s + STELLA_ADD_TILE, STELLA_ADD_STEP, hi);
                pass1_impl(res, NULL, 0, s, b - s < STELLA_ADD_STEP ? b : s + STELLA_ADD_STEP, thr, tz, idx, val, cap,
                           truncate, flat, p);
            }
        }
    } else if (grad) {
        pass1_impl(res, grad, 1, lo, hi, thr, tz, idx, val, cap, truncate, flat, p);
    } else {
        pass1_impl(res, NULL, 0, lo, hi, thr, tz, idx, val, cap, truncate, flat, p);
    }
}

/* unit 1's pass on several threads: at least this many coordinates a thread (a thread's start costs
 * tens of microseconds, the pass about a third of a nanosecond a coordinate) */
#define PASS_MIN_PER_THREAD (INT64_C(1) << 20)
#define PASS_MAX_THREADS 16

typedef struct {
    float *res;
    const float *grad;
    const adds_t *ad;
    int64_t lo, hi;
    float thr, tz;
    int32_t *idx;
    float *val;
    int64_t cap;
    int truncate, flat;
    pass_t p;
} pass_job;

static void *pass_job_run(void *arg) {
    pass_job *J = (pass_job *)arg;
    pass1_range(J->res, J->grad, J->ad, J->lo, J->hi, J->thr, J->tz, J->idx, J->val, J->cap, J->truncate, J->flat,
                &J->p);
    return NULL;
}

/* The pass over [0, n) as T ranges (whole tiles) on T threads, each into candidate buffers of its own, then
 * joined in range order: the same residual and candidates as one pass, bit for bit (every coordinate's work
 * is its own), and the same overflow: more than cap candidates in all is an overflow (truncate: the first
 * cap, the rest given back to the residual, as one pass would have left them). Returns 0, or -1 when the
 * buffers could not be had (nothing done: the caller runs the one pass). */
static int pass1_threads(float *res, const float *grad, const adds_t *ad, int64_t n, int T, float thr, float tz,
                         int32_t *idx, float *val, int64_t cap, int truncate, int flat, pass_t *p) {
    pass_job jobs[PASS_MAX_THREADS];
    const int64_t tiles = (n + STELLA_ADD_TILE - 1) / STELLA_ADD_TILE;
    int64_t room = 0; /* the other ranges' buffers: each the least of cap and its range */
    for (int t = 0; t < T; t++) {
        pass_job *J = &jobs[t];
        J->lo = tiles * t / T * STELLA_ADD_TILE;
        J->hi = t == T - 1 ? n : tiles * (t + 1) / T * STELLA_ADD_TILE;
        J->cap = t == 0 ? cap : (cap < J->hi - J->lo ? cap : J->hi - J->lo);
        if (t > 0) room += J->cap;
    }
    float *bufv = malloc((size_t)room * sizeof(float));
    int32_t *bufi = malloc((size_t)room * sizeof(int32_t));
    if (!bufv || !bufi) {
        free(bufv);
        free(bufi);
        return -1;
    }
    int64_t off = 0;
    for (int t = 0; t < T; t++) {
        pass_job *J = &jobs[t];
        J->res = res;
        J->grad = grad;
        J->ad = ad;
        J->thr = thr;
        J->tz = tz;
        J->idx = t == 0 ? idx : bufi + off;
        J->val = t == 0 ? val : bufv + off;
        if (t > 0) off += J->cap;
        J->truncate = truncate;
        J->flat = flat;
        pass_t z = {0, 0, 0, 0};
        J->p = z;
    }
    stella_run_jobs(pass_job_run, jobs, sizeof jobs[0], T);
    pass_t q = {0, 0, 0, 0};
    int64_t all = 0;
    for (int t = 0; t < T; t++) {
        q.total += jobs[t].p.total;
        q.overflow |= jobs[t].p.overflow;
        all += jobs[t].p.units;
    }
    if (!truncate && all > cap) q.overflow = 1; /* one pass would have run out of room: it gives all back */
    for (int t = 0; t < T; t++) {
        const pass_job *J = &jobs[t];
        const int64_t m = J->p.units;
        const int64_t take = q.overflow ? 0 : (cap - q.units < m ? cap - q.units : m);
        if (t > 0 && take > 0) {
            memmove(idx + q.units, J->idx, (size_t)take * sizeof(int32_t));
            memmove(val + q.units, J->val, (size_t)take * sizeof(float));
        }
        for (int64_t u = take; u < m; u++) res[J->idx[u]] = J->val[u]; /* not kept: back into the residual */
        q.units += take;
    }
    q.elems = q.units;
    *p = q;
    free(bufv);
    free(bufi);
    return 0;
}

static pass_t run_pass(float *res, const float *grad, const adds_t *ad, int64_t n, int unit, float thr,
                       float tz, int32_t *idx, float *val, float *score, int64_t cap, int truncate, double aim,
                       int threads) {
    pass_t p = {0, 0, 0, 0};
    if (tz < thr) tz = thr;
    if (unit == 1) { /* (the adds: unit 1, no gradient, the caller checked) */
        const int flat = aim >= FLAT_FROM * (double)n;
        int T = threads < PASS_MAX_THREADS ? threads : PASS_MAX_THREADS;
        if (T > n / PASS_MIN_PER_THREAD) T = (int)(n / PASS_MIN_PER_THREAD);
        if (T > 1 && pass1_threads(res, grad, ad, n, T, thr, tz, idx, val, cap, truncate, flat, &p) == 0)
            return p; /* (an overflow was given back there) */
        pass1_range(res, grad, ad, 0, n, thr, tz, idx, val, cap, truncate, flat, &p);
        p.elems = p.units;
    } else {
        if (grad)
            pass16_impl(res, grad, 1, n, thr, tz, idx, val, score, cap, truncate, &p);
        else
            pass16_impl(res, NULL, 0, n, thr, tz, idx, val, score, cap, truncate, &p);
    }
    if (p.overflow) { /* give everything back (harmless where not zeroed): res == acc */
        for (int64_t j = 0; j < p.elems; j++) res[idx[j]] = val[j];
        p.units = p.elems = 0;
    }
    return p;
}

static inline float unit_score(int unit, const float *val, const float *score, int64_t u) {
    return unit == 1 ? val[u] : score[u];
}

/* Compact the emitted units in place, keeping those whose score key is
 * > cut, or == cut while eq_take lasts, and make the residual agree: the pass
 * zeroed exactly the units with key >= kz, so a kept unit below kz is zeroed
 * now and a dropped unit at or above kz gets its value back. */
static void compact(float *res, int unit, int32_t *idx, float *val, float *score, uint32_t cut,
                    int64_t eq_take, uint32_t kz, pass_t *p) {
    const float *sv = unit == 1 ? val : score;
    int64_t wu = 0, we = 0, re = 0;
    if (unit == 1) { /* branch-free compaction; fix-ups only where keep != zeroed */
        for (int64_t u = 0; u < p->units; u++) {
            float v = val[u];
            int32_t x = idx[u];
            uint32_t key = abs_key(v);
            int tie = key == cut && eq_take > 0;
            int keep = key > cut || tie;
            eq_take -= tie;
            int zeroed = key >= kz;
            idx[wu] = x;
            val[wu] = v;
            wu += keep;
            if (STELLA_UNLIKELY(keep != zeroed)) res[x] = keep ? 0.f : v;
        }
        p->units = p->elems = wu;
        return;
    }
    for (int64_t u = 0; u < p->units; u++) {
        uint32_t key = abs_key(sv[u]);
        int len = (p->elems - re) < 16 ? (int)(p->elems - re) : 16;
        int keep = key > cut;
        if (!keep && key == cut && eq_take > 0) {
            keep = 1;
            eq_take--;
        }
        int zeroed = key >= kz;
        if (keep) {
            if (unit != 1) score[wu] = score[u];
            for (int j = 0; j < len; j++) {
                idx[we + j] = idx[re + j];
                val[we + j] = val[re + j];
                if (!zeroed) res[idx[re + j]] = 0.f;
            }
            wu++;
            we += len;
        } else if (zeroed) {
            for (int j = 0; j < len; j++) res[idx[re + j]] = val[re + j];
        }
        re += len;
    }
    p->units = wu;
    p->elems = we;
}

/* The final cut of the p->units emitted candidates (all with score >= thr; the
 * pass zeroed those >= tz). Returns the score threshold of what is kept.
 *  1. the units >= tz, when they are within [lo, hi]: nothing to fix up in the
 *     residual (the common case: tz was aimed at k, thr below it);
 *  2. more than hi candidates: a cut at a bin edge of a histogram of the top 16
 *     bits of the score keys (bins ~0.8% wide), or, when no edge lands in
 *     [lo, hi] (ties), an exact radix select keeping exactly k, ties broken by
 *     position;
 *  3. otherwise all of them. */
static float finalize(float *res, int unit, int32_t *idx, float *val, float *score, int64_t k,
                      int64_t lo, int64_t hi, float thr, float tz, pass_t *p, uint32_t *hist) {
    const float *sv = unit == 1 ? val : score;
    if (tz < thr) tz = thr;
    uint32_t kz = abs_key(tz);
    int64_t cz = 0;
    for (int64_t u = 0; u < p->units; u++) cz += abs_key(sv[u]) >= kz;
    if (cz >= lo && cz <= hi) {
        compact(res, unit, idx, val, score, kz, INT64_MAX, kz, p);
        return tz;
    }
    if (p->units <= hi) {
        compact(res, unit, idx, val, score, 0, INT64_MAX, kz, p);
        return thr;
    }
    memset(hist, 0, 32768 * sizeof(uint32_t));
    for (int64_t u = 0; u < p->units; u++) hist[abs_key(sv[u]) >> 16]++;
    int64_t cum = 0;
    int b = 32767;
    for (; b > 0; b--) {
        if (cum + (int64_t)hist[b] >= k) break;
        cum += hist[b];
    }
    /* keys >= b<<16 give cum + hist[b] (>= k); keys >= (b+1)<<16 give cum (< k) */
    int64_t c_in = cum + hist[b], c_out = cum;
    int64_t d_in = c_in - k, d_out = k - c_out;
    if (c_in <= hi && (d_in <= d_out || c_out < lo)) {
        compact(res, unit, idx, val, score, (uint32_t)b << 16, INT64_MAX, kz, p); /* keys >= edge */
        return stella_bits_f32((uint32_t)b << 16);
    }
    if (c_out >= lo && b < 32767) {
        uint32_t e = (uint32_t)(b + 1) << 16;
        compact(res, unit, idx, val, score, e, INT64_MAX, kz, p);
        return stella_bits_f32(e);
    }
    float t = kth_largest_key(sv, p->units, k, hist);
    uint32_t tk = abs_key(t);
    int64_t gt = 0;
    for (int64_t u = 0; u < p->units; u++) gt += abs_key(sv[u]) > tk;
    compact(res, unit, idx, val, score, tk, k - gt, kz, p);
    return t;
}

/* Returns the number of elements written to out->idx/out->val (sorted indices), or
 * a negative STELLA_E_* code. res is the residual, updated in place (acc = res +
 * grad, minus what is sent); grad may be NULL (select from the residual alone).
 * Types and fields: cdefs/compress.h. Dispatched by ISA level (stella_isa.h): the
 * x86-64-v4 copy runs the AVX-512 scan and block kernels above, the v3 copy the
 * plain C ones at AVX2 width; all give the same selection and residual. */
static int64_t ef_topk(float *res, const float *grad, const adds_t *ad, int64_t n, const stella_topk_args *args,
                       stella_topk_state *state, const stella_topk_out *out, stella_topk_stats *stats) {
    if (!res || !args || !state || !out || !out->idx || !out->val || n < 0 || n > INT32_MAX)
        return STELLA_E_ARG;
    const int64_t k_units = args->k_units;
    const int unit = args->unit;
    int64_t nsample = args->nsample;
    int32_t *idx = out->idx;
    float *val = out->val, *score = out->score;
    const int64_t cap_units = out->cap_units;
    if (k_units < 1 || (unit != 1 && unit != STELLA_BLOCK) || (unit == STELLA_BLOCK && !score))
        return STELLA_E_ARG;
    stella_topk_stats st = {0, 0, 0, 0, 0, 0};
    if (n == 0) {
        state->emit_threshold = 0.f;
        if (stats) *stats = st;
        return 0;
    }
    int64_t nu = unit == 1 ? n : (n + STELLA_BLOCK - 1) / STELLA_BLOCK;
    int64_t k = k_units < nu ? k_units : nu;
    if (cap_units < k) return STELLA_E_ARG;
    /* sample sizes in the units estimate() reads */
    int64_t samp_n; /* room for the largest sample sample_scores() can write */
    if (unit == 1) {
        if (nsample < RUN) nsample = RUN;
        samp_n = (nsample >= n || n < 2 * RUN) ? n : nsample;
    } else {
        if (nsample < RUN / 16) nsample = RUN / 16;
        samp_n = (nsample >= nu || nu < 2 * (RUN / 16)) ? nu : nsample;
        nsample *= 16; /* sample_scores() takes floats: nsample / 16 blocks */
    }
    uint32_t *hist = malloc(65536 * sizeof(uint32_t));
    float *samp = malloc((size_t)samp_n * sizeof(float));
    if (!hist || !samp) {
        free(hist);
        free(samp);
        return STELLA_E_NOMEM;
    }
    uint64_t rng = args->seed;
    int64_t lo = (k * 9 + 9) / 10, hi = (k * 11) / 10;
    if (hi < k) hi = k;
    float thr = state->emit_threshold; /* aimed at AIM * k units */
    float tz = state->zero_threshold;  /* aimed at k units (>= thr) */
    const float *g = grad;
    if (k >= nu) {
        thr = tz = tiny();
    } else if (!(thr > 0.f) || !isfinite(thr)) {
        thr = estimate(res, g, ad, n, unit, nsample, &rng, AIM * (double)k, samp, hist, (double)k, &tz);
        st.estimates++;
    } else {
        /* a carried threshold: check it on a small sample (a quarter of the
         * estimate's) and re-estimate when it is clearly off (early steps, when
         * the residual builds up, or a change of gradient scale) */
        int64_t m = sample_scores(res, g, n, unit, nsample / 4, &rng, samp, ad);
        double expect = CARRY_AIM * (double)k * (double)m / (double)nu;
        int64_t hits = 0;
        for (int64_t j = 0; j < m; j++) hits += samp[j] >= thr || -samp[j] >= thr;
#ifdef STELLA_CDEBUG
        fprintf(stderr, "  check thr %g hits %ld expect %.1f (m %ld)\n", thr, (long)hits, expect, (long)m);
#endif
        if (expect >= 8.0 && (hits < 0.6 * expect || hits > 1.7 * expect)) {
            thr = estimate(res, g, ad, n, unit, nsample, &rng, AIM * (double)k, samp, hist, (double)k, &tz);
            st.estimates++;
        }
    }
    if (!(tz >= thr) || !isfinite(tz)) tz = thr;
    pass_t p;
    int exact = 0;
    for (int attempt = 0;; attempt++) {
        int truncate = attempt >= MAX_TRIES;
        if (truncate && !exact) {
            /* exact fallback: the k-th largest score over everything (res == acc now) */
            if (unit == 1) {
                thr = kth_largest_key(res, n, k, hist);
            } else {
                float *all = malloc((size_t)nu * sizeof(float));
                if (!all) {
                    free(hist);
                    free(samp);
                    return STELLA_E_NOMEM;
                }
                for (int64_t b = 0; b < nu; b++) {
                    int64_t s = b * 16;
                    all[b] = block_score(res + s, n - s < 16 ? (int)(n - s) : 16);
                }
                thr = kth_largest_key(all, nu, k, hist);
                free(all);
            }
            if (!(thr > 0.f)) thr = tiny();
            tz = thr;
            exact = 1;
            st.exact_fallback = 1;
        }
        p = run_pass(res, g, ad, n, unit, thr, tz, idx, val, score, cap_units, truncate, AIM * (double)k,
                     args->threads);
        g = NULL; /* the gradient (or the adds) is in the residual from now on */
        ad = NULL;
        st.passes++;
#ifdef STELLA_CDEBUG
        fprintf(stderr, "  attempt %d thr %g tz %g total %ld units %ld overflow %d (k %ld)\n", attempt,
                thr, tz, (long)p.total, (long)p.units, p.overflow, (long)k);
#endif
        /* Too many candidates for the buffer (raise the threshold) or too few (lower
         * it): make the residual whole again, re-estimate on it, and take the new
         * estimate if it moves the right way, else a fixed step. */
        const int dir = p.overflow ? 1 : (p.units < lo && thr > tiny() && !truncate) ? -1 : 0;
        if (!dir) break;
        if (dir < 0) /* an overflowing pass has already given everything back */
            for (int64_t j = 0; j < p.elems; j++) res[idx[j]] = val[j];
        st.givebacks++;
        float z2, t2 = estimate(res, NULL, NULL, n, unit, nsample, &rng, AIM * (double)k, samp, hist, (double)k, &z2);
        st.estimates++;
        if (dir > 0 ? t2 > thr : t2 < thr) {
            thr = t2;
            tz = z2;
        } else {
            thr *= dir > 0 ? (unit == 1 ? 1.25f : 1.6f) : (unit == 1 ? 0.8f : 0.64f);
            tz = thr;
        }
    }
    int64_t before = p.units;
    float tk = finalize(res, unit, idx, val, score, k, lo, hi, thr, tz, &p, hist);
    if (p.units != before) st.trims++;
    /* Next step's thresholds: the ones that would have given CARRY_AIM * k (emit)
     * and k (zero) units this step (from the local slope of the count of scores
     * against the threshold), times the step-to-step drift of the selection
     * threshold (the residual grows over the first steps). Emitting more
     * candidates than kept is deliberate: cutting candidates costs a pass over
     * them, too few costs a pass over the whole tensor. */
    float next = 0.f, next_z = 0.f;
    if (tk > tiny() && p.units > 0 && k < nu) {
        /* The slope where the next thresholds aim, just below tk: p.total scores reached
         * thr and p.units were kept at tk or above. Each step cuts the residual near tk,
         * so its scores pile up just under it, and the tail above tk (the count at tk
         * against the count at 1.25 tk, used when the pass drew fewer than 4 more than
         * the cut kept) is far flatter: at 1% pushes and W = 2 it gave a slope of about 1.4
         * where the count below rose as the 5th power. The threshold carried from it
         * came out 10% low, drew 3x the candidates expected, and was estimated again
         * from a sample every step. */
        double slope;
        if (!exact && p.total >= p.units + 4 && (double)tk > 1.0001 * (double)thr) {
            slope = log((double)p.total / (double)p.units) / log((double)tk / (double)thr);
        } else {
            const float *sv = unit == 1 ? val : score;
            float t125 = tk * 1.25f;
            int64_t c2 = 0;
            for (int64_t u = 0; u < p.units; u++) c2 += fabsf(sv[u]) >= t125;
            slope = (c2 >= 8 && c2 < p.units) ? log((double)p.units / (double)c2) / log(1.25)
                                              : (unit == 1 ? 4.0 : 2.0);
        }
        if (slope < 0.5) slope = 0.5;
        if (slope > 30.0) slope = 30.0;
        double drift = 1.0;
        double prev = state->last_threshold;
        if (prev > 0.0 && isfinite(prev) && !exact) {
            /* magnitudes (unit 1): half the relative drift, in [0.9, 1.2].
             * Block scores are sums of squares that grow about linearly while
             * the residual builds up, with a steep tail (a few % of threshold
             * is a factor in count): extrapolate the increment, damped. */
            double r = (double)tk / prev;
            if (unit == 1) {
                r = sqrt(r);
                drift = r < 0.9 ? 0.9 : (r > 1.2 ? 1.2 : r);
            } else {
                double lin = 1.0 + 0.75 * (r - 1.0);
                drift = lin < 0.8 ? 0.8 : (lin > 1.5 ? 1.5 : lin);
            }
        }
        double f = pow((double)p.units / (CARRY_AIM * (double)k), 1.0 / slope) * drift;
        double fz = pow((double)p.units / (double)k, 1.0 / slope) * drift;
        f = f < 0.5 ? 0.5 : (f > 2.0 ? 2.0 : f);
        fz = fz < 0.5 ? 0.5 : (fz > 2.0 ? 2.0 : fz);
        next = (float)(tk * f);
        next_z = (float)(tk * fz);
        if (!(next > 0.f) || !isfinite(next)) next = next_z = 0.f;
        if (!(next_z >= next) || !isfinite(next_z)) next_z = next;
    }
    state->emit_threshold = next;
    state->last_threshold = tk > tiny() ? tk : 0.f;
    state->zero_threshold = next_z;
    st.units = p.units;
    if (stats) *stats = st;
    free(hist);
    free(samp);
    return p.elems;
}

int64_t STELLA_ISA_FN(stella_ef_topk)(float *res, const float *grad, int64_t n, const stella_topk_args *args,
                                      stella_topk_state *state, const stella_topk_out *out,
                                      stella_topk_stats *stats) {
    return ef_topk(res, grad, NULL, n, args, state, out, stats);
}

/* res[adds[l].idx[j]] += adds[l].val[j] for every list l < nadds in order, then
 * stella_ef_topk(res, NULL, ...): the same selection, residual and state, bit for bit,
 * but the first pass adds the lists a tile at a time as it goes (unit 1 only). Each
 * list's indices must be strictly increasing and in [0, n): checked before anything is
 * written. */
int64_t STELLA_ISA_FN(stella_ef_topk_add)(float *res, int64_t n, const stella_sparse_list *adds, int32_t nadds,
                                          const stella_topk_args *args, stella_topk_state *state,
                                          const stella_topk_out *out, stella_topk_stats *stats) {
    if (!args || args->unit != 1 || nadds < 0 || nadds > STELLA_TOPK_MAX_ADDS || (nadds > 0 && !adds))
        return STELLA_E_ARG;
    if (n < 0 || n > INT32_MAX) return STELLA_E_ARG;
    const int rc = stella_check_lists(adds, nadds, n);
    if (rc != STELLA_OK) return rc;
    stella_sparse_list kept[STELLA_TOPK_MAX_ADDS];
    int32_t nk = 0;
    for (int32_t l = 0; l < nadds; l++)
        if (adds[l].n > 0) kept[nk++] = adds[l];
    const adds_t ad = {kept, nk};
    return ef_topk(res, NULL, nk > 0 ? &ad : NULL, n, args, state, out, stats);
}

#if !STELLA_ISA_VARIANT /* not dispatched: defined once, whether dispatch is on or off */
int64_t stella_topk_cap_units(int64_t k_units, int64_t units) {
    const int64_t room = 3 * k_units + 1024; /* CARRY_AIM * k drawn, with room for the residual's drift */
    return room < units ? room : units;
}
#endif

#if STELLA_ISA_BASE
STELLA_ISA_VARIANTS(stella_ef_topk);
STELLA_ISA_VARIANTS(stella_ef_topk_add);

int64_t stella_ef_topk(float *res, const float *grad, int64_t n, const stella_topk_args *args,
                       stella_topk_state *state, const stella_topk_out *out, stella_topk_stats *stats) {
    return STELLA_ISA_PICK(stella_ef_topk)(res, grad, n, args, state, out, stats);
}

int64_t stella_ef_topk_add(float *res, int64_t n, const stella_sparse_list *adds, int32_t nadds,
                           const stella_topk_args *args, stella_topk_state *state, const stella_topk_out *out,
                           stella_topk_stats *stats) {
    return STELLA_ISA_PICK(stella_ef_topk_add)(res, n, adds, nadds, args, state, out, stats);
}
#endif
