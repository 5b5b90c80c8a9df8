/* Lazy sparse optimizers: merge of sorted pushes fused with the update.
 *
 * One pass per thread over its contiguous coordinate range: the W sorted index
 * streams are merged (duplicates summed in push order, then scaled once) into a
 * small tile that stays in cache, and the tile is applied to the state while the
 * next tile's state lines are already being prefetched. State is interleaved per
 * coordinate ({p, buf} for SGD, {p, m, v, step} for Adam/AdamW: one 16-byte record,
 * four per cache line), so a random update costs one cache line instead of four.
 * Design and measurements: docs/optimizer.md.
 * Every float operation follows server/stella_ps/optim_ref.py in order and in
 * float32, so results are bit-identical to the reference (the build is ISO C11:
 * GCC does not contract a*b+c into FMAs there).
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "stella_native.h"

#include "cdefs/optim.h"

#define HUGE_2M ((size_t)2 << 20)
#define TILE_MAX 4096
#define SENTINEL UINT32_MAX /* never a valid index: numel <= INT32_MAX */

struct stella_optim {
    int32_t kind;
    int32_t layout;
    int64_t numel;
    int32_t nfields;
    int64_t stride;  /* floats between consecutive coordinates of one field */
    int64_t fstride; /* floats between fields of one coordinate */
    float *mem;
    size_t bytes;
    uint32_t max_step; /* largest per-coordinate step count (Adam) */
    /* Bias-correction tables for the betas they were built with; entry k for step k.
     * tab1[k] = 1 - beta1^k (float64), tab2[k] = (float)sqrt(1 - beta2^k). */
    double tb1, tb2;
    double *tab1;
    float *tab2;
    float *sstab; /* (float)(lr / tab1[k]) for the lr it was built with */
    double sslr;
    int64_t sslen, sscap;
    int64_t len1, len2; /* entries built (index 0 unused) */
    int64_t cap1, cap2;
    int64_t sat1, sat2; /* first k with beta^k < 2^-40: later steps reuse entry sat */
};

/* Defaults measured in docs/optimizer.md; changed only by benchmarks. */
static int g_prefetch = 96;
static int g_tile = 2048;
static int g_prefetch_mode = 1; /* 0: prefetchw into L1, 1: prefetcht1 into L2 */
static int g_early_prefetch = 0; /* also prefetch a tile's lines while merging it */

void stella_optim_set_tuning(int32_t prefetch_distance, int32_t tile, int32_t mode) {
    if (prefetch_distance >= 0) g_prefetch = prefetch_distance > 1024 ? 1024 : prefetch_distance;
    if (tile > 0) g_tile = tile > TILE_MAX ? TILE_MAX : (tile < 16 ? 16 : tile);
    if (mode >= 0 && mode <= 3) {
        g_prefetch_mode = mode & 1;
        g_early_prefetch = mode >> 1;
    }
}

/* ---------------------------------------------------------------- allocation */

stella_optim *stella_optim_new(int32_t kind, int64_t numel, int32_t layout, int32_t hugepages) {
    if (kind < STELLA_OPT_SGD || kind > STELLA_OPT_ADAMW) return NULL;
    if (layout != STELLA_LAYOUT_INTERLEAVED && layout != STELLA_LAYOUT_PLANAR) return NULL;
    if (numel < 1 || numel > INT32_MAX) return NULL;
    stella_optim *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->kind = kind;
    st->layout = layout;
    st->numel = numel;
    st->nfields = kind == STELLA_OPT_SGD ? 2 : 4;
    int64_t padded = (numel + 15) & ~(int64_t)15; /* each planar field starts on a line */
    if (layout == STELLA_LAYOUT_INTERLEAVED) {
        st->stride = st->nfields;
        st->fstride = 1;
    } else {
        st->stride = 1;
        st->fstride = padded;
    }
    size_t bytes = (size_t)padded * (size_t)st->nfields * sizeof(float);
    size_t align = 64;
    if (hugepages && bytes >= HUGE_2M) {
        align = HUGE_2M;
        bytes = (bytes + HUGE_2M - 1) & ~(HUGE_2M - 1);
    }
    void *p = NULL;
    if (posix_memalign(&p, align, bytes) != 0) {
        free(st);
        return NULL;
    }
#ifdef MADV_HUGEPAGE
    /* Random updates over gigabytes miss the TLB on almost every access with 4 KiB
     * pages; 2 MiB pages cover the state with a few hundred entries. */
    if (align == HUGE_2M) madvise(p, bytes, MADV_HUGEPAGE);
#endif
    memset(p, 0, bytes);
    st->mem = p;
    st->bytes = bytes;
    st->tb1 = st->tb2 = st->sslr = NAN;
    return st;
}

void stella_optim_free(stella_optim *st) {
    if (!st) return;
    free(st->mem);
    free(st->tab1);
    free(st->tab2);
    free(st->sstab);
    free(st);
}

int64_t stella_optim_bytes(const stella_optim *st) { return (int64_t)st->bytes; }

int stella_optim_set_field(stella_optim *st, int32_t field, const void *src, int64_t n) {
    if (field < 0 || field >= st->nfields || n != st->numel) return STELLA_E_ARG;
    float *dst = st->mem + field * st->fstride;
    const int64_t s = st->stride;
    if (s == 1) {
        memcpy(dst, src, (size_t)n * 4);
    } else {
        const uint32_t *in = src; /* copy bits: the step field is uint32 */
        uint32_t *out = (uint32_t *)dst;
        for (int64_t i = 0; i < n; i++) out[i * s] = in[i];
    }
    if (st->kind != STELLA_OPT_SGD && field == STELLA_FIELD_STEP) {
        const uint32_t *k = src;
        uint32_t mx = 0;
        for (int64_t i = 0; i < n; i++) mx = k[i] > mx ? k[i] : mx;
        st->max_step = mx;
    }
    return STELLA_OK;
}

int stella_optim_get_field(const stella_optim *st, int32_t field, void *dst, int64_t n) {
    if (field < 0 || field >= st->nfields || n != st->numel) return STELLA_E_ARG;
    const uint32_t *in = (const uint32_t *)(st->mem + field * st->fstride);
    const int64_t s = st->stride;
    uint32_t *out = dst;
    if (s == 1) {
        memcpy(out, in, (size_t)n * 4);
    } else if (s == 2) {
        for (int64_t i = 0; i < n; i++) out[i] = in[2 * i];
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = in[4 * i];
    }
    return STELLA_OK;
}

/* ------------------------------------------------------- bias-correction tables */

static int64_t saturation_step(double b) {
    const double tiny = 0x1p-40;
    if (b <= 0.0) return 1;
    double k0 = ceil(-40.0 / log2(b));
    int64_t k = k0 > 4e9 ? (int64_t)4e9 : (int64_t)k0;
    if (k < 1) k = 1;
    while (k > 1 && pow(b, (double)(k - 1)) < tiny) k--;
    while (pow(b, (double)k) >= tiny && k < (int64_t)4e9) k++;
    return k;
}

/* Make tab1/tab2 valid for every step up to `need` (or their saturation step). */
static int ensure_tables(stella_optim *st, double lr, double b1, double b2, int64_t need) {
    if (b1 != st->tb1) {
        st->tb1 = b1;
        st->len1 = 1;
        st->sslen = 0;
        st->sat1 = saturation_step(b1);
    }
    if (b2 != st->tb2) {
        st->tb2 = b2;
        st->len2 = 1;
        st->sat2 = saturation_step(b2);
    }
    int64_t want1 = (need < st->sat1 ? need : st->sat1) + 1;
    int64_t want2 = (need < st->sat2 ? need : st->sat2) + 1;
    if (want1 > st->cap1) {
        int64_t cap = st->cap1 ? st->cap1 : 64;
        while (cap < want1) cap *= 2;
        double *t = realloc(st->tab1, (size_t)cap * sizeof *t);
        if (!t) return STELLA_E_NOMEM;
        st->tab1 = t;
        st->cap1 = cap;
    }
    if (want2 > st->cap2) {
        int64_t cap = st->cap2 ? st->cap2 : 64;
        while (cap < want2) cap *= 2;
        float *t = realloc(st->tab2, (size_t)cap * sizeof *t);
        if (!t) return STELLA_E_NOMEM;
        st->tab2 = t;
        st->cap2 = cap;
    }
    for (int64_t k = st->len1; k < want1; k++) st->tab1[k] = 1.0 - pow(b1, (double)k);
    for (int64_t k = st->len2; k < want2; k++) st->tab2[k] = (float)sqrt(1.0 - pow(b2, (double)k));
    if (want1 > st->len1) st->len1 = want1;
    if (want2 > st->len2) st->len2 = want2;
    /* The learning rate changes with schedules, often every step: this table is
     * short (up to beta1's saturation step, 264 entries for 0.9). */
    if (st->len1 > st->sscap) {
        float *t = realloc(st->sstab, (size_t)st->cap1 * sizeof *t);
        if (!t) return STELLA_E_NOMEM;
        st->sstab = t;
        st->sscap = st->cap1;
    }
    if (lr != st->sslr) st->sslen = 0;
    for (int64_t k = st->sslen ? st->sslen : 1; k < st->len1; k++) st->sstab[k] = (float)(lr / st->tab1[k]);
    st->sstab[0] = 0.0f;
    st->sslen = st->len1;
    st->sslr = lr;
    return STELLA_OK;
}

/* ----------------------------------------------------------------- merge */

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        u = sign | ((e + 112) << 23) | (m << 13);
    } else if (m) { /* subnormal: normalise */
        e = 113;
        while (!(m & 0x400)) {
            m <<= 1;
            e--;
        }
        u = sign | (e << 23) | ((m & 0x3ff) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load_val(const void *val, int32_t dt, int64_t i) {
    if (dt == STELLA_VAL_F32) return ((const float *)val)[i];
    if (dt == STELLA_VAL_F16) return f16_to_f32(((const uint16_t *)val)[i]);
    return bf16_to_f32(((const uint16_t *)val)[i]);
}

typedef struct {
    const int32_t *idx; /* NULL: dense */
    const void *val;
    int64_t pos, end;
    uint32_t head; /* idx[pos], or SENTINEL when exhausted */
    int32_t dt;
} stream_t;

static inline uint32_t stream_head(const stream_t *s) {
    if (s->pos >= s->end) return SENTINEL;
    return s->idx ? (uint32_t)s->idx[s->pos] : (uint32_t)s->pos;
}

static int64_t lower_bound(const int32_t *a, int64_t n, int64_t x) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if ((int64_t)a[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Merge of W >= 2 streams through a window of the coordinate space.
 *
 * A comparison merge has to decide, for every output, which of the W heads hold
 * the next coordinate; that is random, and it cost 18-20 ns per output even
 * branch-free (a loop-carried chain: load head -> min -> compare -> advance).
 * Instead each window [a, a + len) is filled stream by stream, in push order:
 * acc[idx - a] += value, flag[idx - a] = 1 (no comparisons between streams, no
 * dependency between entries), and then swept in coordinate order, emitting the
 * flagged coordinates with AVX-512 compress (no data-dependent branch). Per
 * coordinate the sum is ((0 + v_first) + v_next) + ..., in push order, exactly
 * the reference's `acc[pos] += vals`. The window is sized from the push density
 * so that it holds a few hundred entries and fits L1/L2, and the sweep can stop
 * anywhere when the output tile is full. */
typedef struct {
    stream_t *s;
    int W;
    float scale;
    int64_t hi;    /* end of the thread's range */
    int64_t B;     /* window capacity in coordinates, a multiple of 64 */
    int64_t a;     /* window start */
    int64_t len;   /* coordinates in the current window, rounded up to 64 */
    int64_t sweep; /* next 64-coordinate block to sweep */
    float *acc;    /* B floats, zero outside the current window's pending part */
    uint8_t *flag; /* B bytes, likewise */
} window_merge;

#define MERGE_SLACK 64 /* the sweep may store up to 64 entries past the count */
#define TILE_BUF (TILE_MAX + MERGE_SLACK)

static inline void scatter_stream(stream_t *st, int64_t a, int64_t lim, float *acc, uint8_t *flag) {
    if (!st->idx) { /* dense: every coordinate of the window, position == coordinate */
        int64_t e = lim < st->end ? lim : st->end;
        const int64_t p0 = st->pos;
        float *A = acc + (p0 - a);
        uint8_t *F = flag + (p0 - a);
        const int64_t m = e - p0;
        switch (st->dt) {
        case STELLA_VAL_F32: {
            const float *v = (const float *)st->val + p0;
            for (int64_t j = 0; j < m; j++) A[j] += v[j];
            break;
        }
        case STELLA_VAL_F16: {
            const uint16_t *v = (const uint16_t *)st->val + p0;
            for (int64_t j = 0; j < m; j++) A[j] += f16_to_f32(v[j]);
            break;
        }
        default: {
            const uint16_t *v = (const uint16_t *)st->val + p0;
            for (int64_t j = 0; j < m; j++) A[j] += bf16_to_f32(v[j]);
        }
        }
        memset(F, 1, (size_t)m);
        st->pos = e;
        st->head = stream_head(st);
        return;
    }
    const int32_t *ix = st->idx;
    int64_t p = st->pos, e = st->end;
    /* Either the rest of the stream lies in the window, or some entry ends the
     * loop: one compare per entry either way. */
    const int rest = (int64_t)ix[e - 1] < lim;
#define SCATTER(LOAD)                                                                          \
    if (rest) {                                                                                \
        for (; p < e; p++) {                                                                   \
            const int64_t j = (int64_t)ix[p] - a;                                              \
            acc[j] += LOAD;                                                                    \
            flag[j] = 1;                                                                       \
        }                                                                                      \
    } else {                                                                                   \
        for (; (int64_t)ix[p] < lim; p++) {                                                    \
            const int64_t j = (int64_t)ix[p] - a;                                              \
            acc[j] += LOAD;                                                                    \
            flag[j] = 1;                                                                       \
        }                                                                                      \
    }
    switch (st->dt) {
    case STELLA_VAL_F32: {
        const float *v = st->val;
        SCATTER(v[p])
        break;
    }
    case STELLA_VAL_F16: {
        const uint16_t *v = st->val;
        SCATTER(f16_to_f32(v[p]))
        break;
    }
    default: {
        const uint16_t *v = st->val;
        SCATTER(bf16_to_f32(v[p]))
    }
    }
#undef SCATTER
    st->pos = p;
    st->head = stream_head(st);
}

/* Starts the next window at the smallest head (skipping empty stretches); 0 when
 * every stream is exhausted. */
static int window_fill(window_merge *wm) {
    uint32_t a = SENTINEL;
    for (int w = 0; w < wm->W; w++) a = wm->s[w].head < a ? wm->s[w].head : a;
    if (a == SENTINEL) return 0;
    int64_t lim = (int64_t)a + wm->B;
    if (lim > wm->hi) lim = wm->hi;
    for (int w = 0; w < wm->W; w++)
        if (wm->s[w].head < lim) scatter_stream(&wm->s[w], a, lim, wm->acc, wm->flag);
    wm->a = a;
    wm->len = (lim - a + 63) & ~(int64_t)63;
    wm->sweep = 0;
    return 1;
}

/* Emits the flagged coordinates of block [off, off + 64) and clears it; returns
 * how many. Writes up to 64 entries at oi/og. */
static inline int sweep_block(window_merge *wm, int64_t off, uint32_t *oi, float *og) {
    uint8_t *F = wm->flag + off;
    float *A = wm->acc + off;
    const uint32_t base = (uint32_t)(wm->a + off);
#if defined(__AVX512BW__) && defined(__AVX512F__)
    const __m512i f = _mm512_loadu_si512(F);
    uint64_t m = _mm512_test_epi8_mask(f, f);
    if (!m) return 0;
    const __m512 sc = _mm512_set1_ps(wm->scale);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int n = 0;
    for (int c = 0; c < 4; c++) {
        const __mmask16 k = (__mmask16)(m >> (16 * c));
        const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(A + 16 * c), sc);
        const __m512i ix = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(base + 16 * c)));
        _mm512_storeu_si512(oi + n, _mm512_maskz_compress_epi32(k, ix));
        _mm512_storeu_ps(og + n, _mm512_maskz_compress_ps(k, g));
        _mm512_storeu_ps(A + 16 * c, _mm512_setzero_ps());
        n += __builtin_popcount(k);
    }
    _mm512_storeu_si512(F, _mm512_setzero_si512());
    return n;
#else
    uint64_t m = 0;
    for (int j = 0; j < 64; j++) m |= (uint64_t)(F[j] != 0) << j;
    if (!m) return 0;
    int n = 0;
    while (m) {
        const int j = __builtin_ctzll(m);
        oi[n] = base + (uint32_t)j;
        og[n] = A[j] * wm->scale;
        A[j] = 0.0f;
        n++;
        m &= m - 1;
    }
    memset(F, 0, 64);
    return n;
#endif
}

#define PREFETCH_W(addr) __builtin_prefetch((addr), 1, 3)

/* Early prefetch: the state lines of a tile are requested while the tile is being
 * merged, one tile before it is applied, so the memory system also works during
 * the merge (otherwise it idles there, with only the apply loop's few lookahead
 * prefetches in flight). mem == NULL: off. */
typedef struct {
    float *mem;
    int64_t stride, fstride;
    int nf;
} early_prefetch;

static inline void prefetch_new(const early_prefetch *ep, const uint32_t *oi, int from, int to) {
    if (!ep->mem) return;
    for (int e = from; e < to; e++) {
        float *base = ep->mem + (int64_t)oi[e] * ep->stride;
        PREFETCH_W(base);
        if (ep->fstride != 1)
            for (int f = 1; f < ep->nf; f++) PREFETCH_W(base + f * ep->fstride);
    }
}

static int window_tile(window_merge *wm, uint32_t *oi, float *og, int cap, const early_prefetch *ep) {
    int n = 0;
    for (;;) {
        while (wm->sweep < wm->len) {
            if (n + 64 > cap + MERGE_SLACK) return n;
            const int got = sweep_block(wm, wm->sweep, oi + n, og + n);
            prefetch_new(ep, oi, n, n + got);
            n += got;
            wm->sweep += 64;
        }
        if (n >= cap || !window_fill(wm)) return n;
    }
}

/* One pushed stream: no merge at all, values converted and scaled. */
static int single_tile(stream_t *a, float scale, uint32_t *oi, float *og, int cap, const early_prefetch *ep) {
    int64_t take = a->end - a->pos;
    if (take > cap) take = cap;
    for (int64_t j = 0; j < take; j++) {
        int64_t p = a->pos + j;
        oi[j] = a->idx ? (uint32_t)a->idx[p] : (uint32_t)p;
        og[j] = (0.0f + load_val(a->val, a->dt, p)) * scale;
    }
    prefetch_new(ep, oi, 0, (int)take);
    a->pos += take;
    a->head = stream_head(a);
    return (int)take;
}

/* ----------------------------------------------------------------- updates */

/* Prefetch the state of the coordinate `ahead` positions on: from this tile, or
 * from the head of the next one. */
static inline int32_t ahead_index(const uint32_t *ix, int n, const uint32_t *nx, int nn, int j, int pd) {
    int a = j + pd;
    if (a < n) return (int32_t)ix[a];
    a -= n;
    return a < nn ? (int32_t)nx[a] : -1;
}

static inline void prefetch_coord(float *mem, int64_t stride, int64_t fstride, int nf, int32_t i, int pmode) {
    if (i < 0) return;
    float *base = mem + (int64_t)i * stride;
    if (pmode == 1) {
        __builtin_prefetch(base, 0, 2);
        return;
    }
    PREFETCH_W(base);
    if (fstride != 1)
        for (int f = 1; f < nf; f++) PREFETCH_W(base + f * fstride);
}

/* The kernels take stride/fstride as arguments but are always called with
 * constants so that each layout gets its own specialised loop. */
static inline __attribute__((always_inline)) void sgd_tile(float *mem, int64_t stride, int64_t fstride,
                                                           const uint32_t *ix, const float *g, int n,
                                                           const uint32_t *nx, int nn,
                                                           const stella_optim_cfg *c, int pd, int pmode) {
    const float lr = c->lr, wd = c->weight_decay, mom = c->momentum, omd = c->one_minus_dampening;
    const int has_wd = c->has_weight_decay, has_mom = c->has_momentum, nest = c->nesterov;
    for (int j = 0; j < n; j++) {
        if (pd) prefetch_coord(mem, stride, fstride, 2, ahead_index(ix, n, nx, nn, j, pd), pmode);
        float *P = mem + (int64_t)ix[j] * stride;
        float *B = P + fstride;
        float p = *P, d = g[j];
        if (has_wd) d = d + wd * p;
        if (has_mom) {
            float buf = mom * *B + omd * d;
            *B = buf;
            d = nest ? d + mom * buf : buf;
        }
        *P = p - lr * d;
    }
}

/* The vectorised middle pass of adam_tile (separate so that the restrict
 * qualifiers reach the vectoriser). */
static uint32_t adam_math(float *STELLA_RESTRICT tp, float *STELLA_RESTRICT tm, float *STELLA_RESTRICT tv,
                          uint32_t *STELLA_RESTRICT tk, const float *STELLA_RESTRICT gg, int n,
                          const stella_optim_cfg *c, const float *STELLA_RESTRICT sstab, uint32_t last1,
                          const float *STELLA_RESTRICT tab2, uint32_t last2) {
    const float b1 = c->beta1, b2 = c->beta2, omb1 = c->one_minus_beta1, omb2 = c->one_minus_beta2;
    const float eps = c->eps, wd = c->weight_decay, decay = c->decay_factor;
    const int adamw_decay = c->kind == STELLA_OPT_ADAMW && c->has_weight_decay;
    const int l2 = c->kind == STELLA_OPT_ADAM && c->has_weight_decay;
    uint32_t kmax = 0;
    for (int j = 0; j < n; j++) {
        const uint32_t k = tk[j] + 1;
        tk[j] = k;
        kmax = k > kmax ? k : kmax;
        float p = tp[j];
        p = adamw_decay ? p * decay : p;
        const float d = l2 ? gg[j] + wd * p : gg[j];
        const float m = b1 * tm[j] + omb1 * d;
        const float v = b2 * tv[j] + omb2 * d * d;
        const uint32_t k1 = k < last1 ? k : last1, k2 = k < last2 ? k : last2;
        const float denom = sqrtf(v) / tab2[k2] + eps;
        tp[j] = p - sstab[k1] * (m / denom);
        tm[j] = m;
        tv[j] = v;
    }
    return kmax;
}

/* Adam/AdamW over one tile in three passes: gather the records into small
 * per-field arrays (the loop the prefetches run ahead of), update them with
 * vector arithmetic (AVX-512: 16 coordinates per instruction, the sqrt and the
 * divisions included), scatter them back. The scalar fused loop spent ~6 ns per
 * coordinate in the divider alone. */
static inline __attribute__((always_inline)) uint32_t adam_tile(float *mem, int64_t stride, int64_t fstride,
                                                                const uint32_t *ix, const float *g, int n,
                                                                const uint32_t *nx, int nn,
                                                                const stella_optim_cfg *c, int pd, int pmode,
                                                                const float *sstab, uint32_t last1,
                                                                const float *tab2, uint32_t last2,
                                                                float *buf) {
    float *tp = buf, *tm = buf + TILE_BUF, *tv = buf + 2 * TILE_BUF;
    uint32_t *tk = (uint32_t *)(buf + 3 * TILE_BUF);
    for (int j = 0; j < n; j++) {
        if (pd) prefetch_coord(mem, stride, fstride, 4, ahead_index(ix, n, nx, nn, j, pd), pmode);
        const float *R = mem + (int64_t)ix[j] * stride;
        tp[j] = R[0];
        tm[j] = R[fstride];
        tv[j] = R[2 * fstride];
        tk[j] = ((const uint32_t *)R)[3 * fstride];
    }
    const uint32_t kmax = adam_math(tp, tm, tv, tk, g, n, c, sstab, last1, tab2, last2);
    for (int j = 0; j < n; j++) {
        float *R = mem + (int64_t)ix[j] * stride;
        R[0] = tp[j];
        R[fstride] = tm[j];
        R[2 * fstride] = tv[j];
        ((uint32_t *)R)[3 * fstride] = tk[j];
    }
    return kmax;
}

/* ----------------------------------------------------------------- apply */

typedef struct {
    stella_optim *st;
    const stella_push *pushes;
    int32_t npush;
    float scale;
    const stella_optim_cfg *cfg;
    int64_t lo, hi;
    uint32_t *out; /* this range's slice of the output */
    int64_t count;
    uint32_t kmax;
    int rc;
} range_job;

static void run_range(range_job *job) {
    stella_optim *st = job->st;
    const int W = job->npush;
    stream_t streams[W > 0 ? W : 1];
    int live = 0;
    for (int w = 0; w < W; w++) {
        const stella_push *ps = &job->pushes[w];
        stream_t s = {ps->idx, ps->val, 0, 0, SENTINEL, ps->dtype};
        if (ps->idx) {
            s.pos = lower_bound(ps->idx, ps->n, job->lo);
            s.end = lower_bound(ps->idx, ps->n, job->hi);
        } else {
            s.pos = job->lo;
            s.end = job->hi;
        }
        if (s.pos >= s.end) continue; /* nothing of this push in the range */
        s.head = stream_head(&s);
        streams[live++] = s;
    }
    const int tile = g_tile, pd = g_prefetch, pmode = g_prefetch_mode;
    /* Two merged tiles (double buffering: the next one is merged before the current
     * one is applied, so its first coordinates can be prefetched) and the Adam
     * per-field arrays; on the heap, since callers' threads may have small stacks. */
    char *scratch = aligned_alloc(64, sizeof(uint32_t[2][TILE_BUF]) + sizeof(float[2][TILE_BUF]) +
                                          sizeof(float[4 * TILE_BUF]));
    if (!scratch) {
        job->rc = STELLA_E_NOMEM;
        return;
    }
    uint32_t(*ibuf)[TILE_BUF] = (uint32_t(*)[TILE_BUF])scratch;
    float(*gbuf)[TILE_BUF] = (float(*)[TILE_BUF])(scratch + sizeof(uint32_t[2][TILE_BUF]));
    float *abuf = (float *)(scratch + sizeof(uint32_t[2][TILE_BUF]) + sizeof(float[2][TILE_BUF]));
    window_merge wm = {streams, live, job->scale, job->hi, 0, 0, 0, 0, NULL, NULL};
    if (live > 1) {
        /* Window: about 256 pushed entries, between 1 and 64 Ki coordinates. */
        int64_t pushed = 0;
        for (int w = 0; w < live; w++) pushed += streams[w].end - streams[w].pos;
        double per_coord = (double)pushed / (double)(job->hi - job->lo);
        int64_t B = 64;
        while (B < 65536 && (double)B * per_coord < 256.0 && B < job->hi - job->lo) B *= 2;
        wm.B = B;
        wm.acc = aligned_alloc(64, (size_t)B * sizeof(float));
        wm.flag = aligned_alloc(64, (size_t)B);
        if (!wm.acc || !wm.flag) {
            free(wm.acc);
            free(wm.flag);
            free(scratch);
            job->rc = STELLA_E_NOMEM;
            return;
        }
        memset(wm.acc, 0, (size_t)B * sizeof(float));
        memset(wm.flag, 0, (size_t)B);
    }
    const early_prefetch ep = {g_early_prefetch ? st->mem : NULL, st->stride, st->fstride, st->nfields};
#define NEXT_TILE(oi, og)                                                                      \
    (live > 1 ? window_tile(&wm, (oi), (og), tile, &ep)                                        \
              : live ? single_tile(streams, job->scale, (oi), (og), tile, &ep) : 0)
    int cur = 0;
    int n = NEXT_TILE(ibuf[0], gbuf[0]);
    int64_t total = 0;
    uint32_t kmax = 0;
    const stella_optim_cfg *c = job->cfg;
    float *mem = st->mem;
    const uint32_t last1 = (uint32_t)(st->len1 - 1), last2 = (uint32_t)(st->len2 - 1);
    while (n > 0) {
        int nxt = cur ^ 1;
        int nn = NEXT_TILE(ibuf[nxt], gbuf[nxt]);
        const uint32_t *ix = ibuf[cur], *nx = ibuf[nxt];
        const float *g = gbuf[cur];
        if (st->kind == STELLA_OPT_SGD) {
            if (st->layout == STELLA_LAYOUT_INTERLEAVED)
                sgd_tile(mem, 2, 1, ix, g, n, nx, nn, c, pd, pmode);
            else
                sgd_tile(mem, 1, st->fstride, ix, g, n, nx, nn, c, pd, pmode);
        } else {
            uint32_t k;
            if (st->layout == STELLA_LAYOUT_INTERLEAVED)
                k = adam_tile(mem, 4, 1, ix, g, n, nx, nn, c, pd, pmode, st->sstab, last1, st->tab2, last2, abuf);
            else
                k = adam_tile(mem, 1, st->fstride, ix, g, n, nx, nn, c, pd, pmode, st->sstab, last1, st->tab2, last2,
                              abuf);
            kmax = k > kmax ? k : kmax;
        }
        memcpy(job->out + total, ix, (size_t)n * 4);
        total += n;
        n = nn;
        cur = nxt;
    }
#undef NEXT_TILE
    free(scratch);
    free(wm.acc);
    free(wm.flag);
    job->count = total;
    job->kmax = kmax;
    job->rc = STELLA_OK;
}

static void *run_range_thread(void *arg) {
    run_range(arg);
    return NULL;
}

#define MAX_THREADS 64
#define PARALLEL_MIN_WORK ((int64_t)1 << 15)

int64_t stella_optim_apply(stella_optim *st, const stella_push *pushes, int32_t npush, float scale,
                           const stella_optim_cfg *cfg, int32_t *out_idx, int64_t out_cap,
                           int32_t nthreads) {
    if (!st || npush < 0 || (npush > 0 && !pushes) || !cfg || cfg->kind != st->kind) return STELLA_E_ARG;
    int64_t work = 0;
    int dense = 0, longest = -1;
    for (int w = 0; w < npush; w++) {
        const stella_push *p = &pushes[w];
        if (p->n < 0 || p->dtype < STELLA_VAL_F32 || p->dtype > STELLA_VAL_BF16) return STELLA_E_ARG;
        if (p->n > 0 && !p->val) return STELLA_E_ARG;
        if (!p->idx) {
            if (p->n != st->numel) return STELLA_E_ARG;
            dense = 1;
        } else if (longest < 0 || p->n > pushes[longest].n) {
            longest = w;
        }
        work += p->n;
    }
    int64_t bound = work < st->numel ? work : st->numel;
    if (out_cap < bound || (bound > 0 && !out_idx)) return STELLA_E_ARG;
    if (bound == 0) return 0;
    if (st->kind != STELLA_OPT_SGD) {
        int rc = ensure_tables(st, cfg->lr_d, cfg->beta1_d, cfg->beta2_d, (int64_t)st->max_step + 1);
        if (rc != STELLA_OK) return rc;
    }

    int T = nthreads < 1 ? 1 : (nthreads > MAX_THREADS ? MAX_THREADS : nthreads);
    if (work < PARALLEL_MIN_WORK * T) T = (int)(work / PARALLEL_MIN_WORK) > 1 ? (int)(work / PARALLEL_MIN_WORK) : 1;
    if (T > st->numel) T = (int)st->numel;

    /* Split the coordinate space so that each thread gets about the same number of
     * pushed coordinates: quantiles of the longest sparse push (equal ranges when a
     * dense push makes every coordinate part of the union). */
    int64_t cut[MAX_THREADS + 1];
    cut[0] = 0;
    cut[T] = st->numel;
    for (int t = 1; t < T; t++) {
        if (dense || longest < 0 || pushes[longest].n == 0)
            cut[t] = st->numel * t / T;
        else
            cut[t] = pushes[longest].idx[pushes[longest].n * t / T];
        if (cut[t] < cut[t - 1]) cut[t] = cut[t - 1];
    }
    /* Each range writes its union into its own slice of out_idx, sized by an upper
     * bound (its coordinates, or the pushed entries inside it); slices are then
     * compacted in order, so the result stays sorted. */
    range_job jobs[MAX_THREADS];
    int64_t off = 0;
    for (int t = 0; t < T; t++) {
        int64_t lo = cut[t], hi = cut[t + 1], cnt = 0;
        for (int w = 0; w < npush; w++) {
            const stella_push *p = &pushes[w];
            cnt += p->idx ? lower_bound(p->idx, p->n, hi) - lower_bound(p->idx, p->n, lo) : hi - lo;
        }
        if (cnt > hi - lo) cnt = hi - lo;
        jobs[t] = (range_job){st, pushes, npush, scale, cfg, lo, hi, (uint32_t *)out_idx + off, 0, 0,
                              STELLA_OK};
        off += cnt;
    }
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < T; t++) started[t] = pthread_create(&tid[t], NULL, run_range_thread, &jobs[t]) == 0;
    run_range(&jobs[0]);
    for (int t = 1; t < T; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            run_range(&jobs[t]); /* could not start a thread: do its range here */
    }
    int64_t total = 0;
    uint32_t kmax = st->max_step;
    for (int t = 0; t < T; t++) {
        if (jobs[t].rc != STELLA_OK) return jobs[t].rc;
        if ((uint32_t *)out_idx + total != jobs[t].out)
            memmove(out_idx + total, jobs[t].out, (size_t)jobs[t].count * 4);
        total += jobs[t].count;
        kmax = jobs[t].kmax > kmax ? jobs[t].kmax : kmax;
    }
    st->max_step = kmax;
    return total;
}

/* ----------------------------------------------------------------- gather */

typedef struct {
    const stella_optim *st;
    const int32_t *idx;
    int64_t n;
    float *out;
    int rc;
} gather_job;

static void run_gather(gather_job *job) {
    const stella_optim *st = job->st;
    const float *mem = st->mem;
    const int64_t s = st->stride, numel = st->numel, n = job->n;
    const int pd = g_prefetch;
    for (int64_t j = 0; j < n; j++) {
        if (pd && j + pd < n) {
            uint32_t a = (uint32_t)job->idx[j + pd];
            if (a < (uint64_t)numel) __builtin_prefetch(mem + (int64_t)a * s, 0, 3);
        }
        uint32_t i = (uint32_t)job->idx[j];
        if (STELLA_UNLIKELY(i >= (uint64_t)numel)) {
            job->rc = STELLA_E_RANGE;
            return;
        }
        job->out[j] = mem[(int64_t)i * s];
    }
    job->rc = STELLA_OK;
}

static void *run_gather_thread(void *arg) {
    run_gather(arg);
    return NULL;
}

int stella_optim_gather(const stella_optim *st, const int32_t *idx, int64_t n, float *out, int32_t nthreads) {
    if (!st || n < 0 || (n > 0 && (!idx || !out))) return STELLA_E_ARG;
    int T = nthreads < 1 ? 1 : (nthreads > MAX_THREADS ? MAX_THREADS : nthreads);
    if (n < PARALLEL_MIN_WORK * T) T = (int)(n / PARALLEL_MIN_WORK) > 1 ? (int)(n / PARALLEL_MIN_WORK) : 1;
    gather_job jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < T; t++) {
        int64_t lo = n * t / T, hi = n * (t + 1) / T;
        jobs[t] = (gather_job){st, idx + lo, hi - lo, out + lo, STELLA_OK};
    }
    for (int t = 1; t < T; t++) started[t] = pthread_create(&tid[t], NULL, run_gather_thread, &jobs[t]) == 0;
    run_gather(&jobs[0]);
    int rc = jobs[0].rc;
    for (int t = 1; t < T; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            run_gather(&jobs[t]);
        if (jobs[t].rc != STELLA_OK) rc = jobs[t].rc;
    }
    return rc;
}

/* ----------------------------------------------------------------- union */

/* Union of two sorted unique lists; returns its length. */
static int64_t union2(const int32_t *a, int64_t na, const int32_t *b, int64_t nb, int32_t *out) {
    int64_t i = 0, j = 0, n = 0;
    while (i < na && j < nb) {
        int32_t x = a[i], y = b[j];
        int32_t m = x < y ? x : y;
        out[n++] = m;
        i += x == m;
        j += y == m;
    }
    while (i < na) out[n++] = a[i++];
    while (j < nb) out[n++] = b[j++];
    return n;
}

/* Pairwise rounds of two-way unions: O(N log k) for any k, and every round is a
 * streaming pass that the hardware prefetcher follows. */
int64_t stella_union_indices(const int32_t *const *lists, const int64_t *lens, int32_t k, int32_t *out,
                             int64_t out_cap) {
    if (k < 0 || (k > 0 && (!lists || !lens))) return STELLA_E_ARG;
    int64_t total = 0;
    for (int i = 0; i < k; i++) {
        if (lens[i] < 0 || (lens[i] > 0 && !lists[i])) return STELLA_E_ARG;
        total += lens[i];
    }
    if (out_cap < total || (total > 0 && !out)) return STELLA_E_ARG;
    if (k == 0 || total == 0) return 0;
    if (k == 1) {
        memcpy(out, lists[0], (size_t)lens[0] * 4);
        return lens[0];
    }
    if (k == 2) return union2(lists[0], lens[0], lists[1], lens[1], out);
    /* Runs live back to back in one of two buffers; merge neighbours each round. */
    int32_t *buf[2];
    buf[0] = malloc((size_t)total * 4);
    buf[1] = malloc((size_t)total * 4);
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(k + 1));
    if (!buf[0] || !buf[1] || !start) {
        free(buf[0]);
        free(buf[1]);
        free(start);
        return STELLA_E_NOMEM;
    }
    int64_t pos = 0;
    for (int i = 0; i < k; i++) {
        start[i] = pos;
        memcpy(buf[0] + pos, lists[i], (size_t)lens[i] * 4);
        pos += lens[i];
    }
    start[k] = pos;
    int runs = k, src = 0;
    while (runs > 1) {
        int dst = src ^ 1, nr = 0;
        int64_t wpos = 0;
        for (int r = 0; r < runs; r += 2) {
            int64_t s0 = start[r], e0 = start[r + 1];
            int64_t len;
            if (r + 1 < runs) {
                int64_t e1 = start[r + 2];
                len = union2(buf[src] + s0, e0 - s0, buf[src] + e0, e1 - e0, buf[dst] + wpos);
            } else {
                len = e0 - s0;
                memcpy(buf[dst] + wpos, buf[src] + s0, (size_t)len * 4);
            }
            start[nr++] = wpos;
            wpos += len;
        }
        start[nr] = wpos;
        runs = nr;
        src = dst;
    }
    int64_t n = start[1];
    memcpy(out, buf[src], (size_t)n * 4);
    free(buf[0]);
    free(buf[1]);
    free(start);
    return n;
}
