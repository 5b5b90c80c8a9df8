/* Merge of the sorted pushes of one step into tiles of (coordinate, scaled sum):
 * the windowed scatter/sweep for several pushes, a plain copy for one. Values may
 * be float32, float16 or bfloat16 (converted by stella_half.h). The sum per
 * coordinate is taken in push order, as the reference (optim_ref.py) does, and
 * multiplied by one scale, or by cs[n] where n pushes carried the coordinate (update
 * mode's count_exponent: the count is taken in the same pass as the sum). */
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "optim_internal.h"
#include "stella_half.h"

static inline float load_val(const void *val, int32_t dt, int64_t i) {
    if (dt == STELLA_VAL_F32) return ((const float *)val)[i];
    if (dt == STELLA_VAL_F16) return stella_half_to_float(((const uint16_t *)val)[i]);
    return stella_bf16_to_float(((const uint16_t *)val)[i]);
}

/* Sets bits [lo, hi) of a bitmap. */
static inline void set_bits(uint64_t *bits, int64_t lo, int64_t hi) {
    if (lo >= hi) return;
    int64_t w0 = lo >> 6, w1 = (hi - 1) >> 6;
    const uint64_t first = ~(uint64_t)0 << (lo & 63), last = ~(uint64_t)0 >> (63 - ((hi - 1) & 63));
    if (w0 == w1) {
        bits[w0] |= first & last;
        return;
    }
    bits[w0] |= first;
    for (int64_t w = w0 + 1; w < w1; w++) bits[w] = ~(uint64_t)0;
    bits[w1] |= last;
}

/* Merge of W >= 2 streams through a window of the coordinate space.
 *
 * A comparison merge has to decide, for every output, which of the W heads hold
 * the next coordinate; that is random, and it cost 18-20 ns per output even
 * branch-free (a loop-carried chain: load head -> min -> compare -> advance), and
 * 13 ns for W = 4 on the AVX2 machine (two streams are the exception: below).
 * Instead each window [a, a + len) is filled stream by stream, in push order:
 * acc[idx - a] += value and bit idx - a of flag set (no comparisons between
 * streams; entries depend on each other only through a shared 64-bit flag word),
 * and then swept in coordinate order, emitting the flagged coordinates with
 * AVX-512 compress (no data-dependent branch) or bit scans. Per
 * coordinate the sum is ((0 + v_first) + v_next) + ..., in push order, exactly
 * the reference's `acc[pos] += vals`. The window is sized from the push density
 * so that it holds a few hundred entries and fits L1/L2, and the sweep can stop
 * anywhere when the output tile is full. */
static inline void scatter_stream(stream_t *st, int64_t a, int64_t lim, float *acc, uint64_t *flag,
                                  uint16_t *cnt) {
    if (!st->idx) { /* dense: every coordinate of the window, position == coordinate */
        int64_t e = lim < st->end ? lim : st->end;
        const int64_t p0 = st->pos;
        float *A = acc + (p0 - a);
        const int64_t m = e - p0;
        switch (st->dt) {
        case STELLA_VAL_F32: {
            const float *v = (const float *)st->val + p0;
            for (int64_t j = 0; j < m; j++) A[j] += v[j];
            break;
        }
        case STELLA_VAL_F16: {
            const uint16_t *v = (const uint16_t *)st->val + p0;
            for (int64_t j = 0; j < m; j++) A[j] += stella_half_to_float(v[j]);
            break;
        }
        default: {
            const uint16_t *v = (const uint16_t *)st->val + p0;
            for (int64_t j = 0; j < m; j++) A[j] += stella_bf16_to_float(v[j]);
        }
        }
        set_bits(flag, p0 - a, e - a);
        if (cnt)
            for (int64_t j = 0; j < m; j++) cnt[p0 - a + j]++;
        st->pos = e;
        st->head = stream_head(st);
        return;
    }
    const int32_t *ix = st->idx;
    int64_t p = st->pos, e = st->end;
    /* Either the rest of the stream lies in the window, or some entry ends the
     * loop: one compare per entry either way. */
    const int rest = (int64_t)ix[e - 1] < lim;
#define SCATTER_LOOP(LOAD, COUNT)                                                              \
    if (rest) {                                                                                \
        for (; p < e; p++) {                                                                   \
            const int64_t j = (int64_t)ix[p] - a;                                              \
            acc[j] += LOAD;                                                                    \
            flag[j >> 6] |= (uint64_t)1 << (j & 63);                                           \
            COUNT;                                                                             \
        }                                                                                      \
    } else {                                                                                   \
        for (; (int64_t)ix[p] < lim; p++) {                                                    \
            const int64_t j = (int64_t)ix[p] - a;                                              \
            acc[j] += LOAD;                                                                    \
            flag[j >> 6] |= (uint64_t)1 << (j & 63);                                           \
            COUNT;                                                                             \
        }                                                                                      \
    }
    /* the count's increment is its own loop copy: none where there is no count */
#define SCATTER(LOAD)                                                                          \
    if (cnt) {                                                                                 \
        SCATTER_LOOP(LOAD, cnt[j]++)                                                           \
    } else {                                                                                   \
        SCATTER_LOOP(LOAD, (void)0)                                                            \
    }
    switch (st->dt) {
    case STELLA_VAL_F32: {
        const float *v = st->val;
        SCATTER(v[p])
        break;
    }
    case STELLA_VAL_F16: {
        const uint16_t *v = st->val;
        SCATTER(stella_half_to_float(v[p]))
        break;
    }
    default: {
        const uint16_t *v = st->val;
        SCATTER(stella_bf16_to_float(v[p]))
    }
    }
#undef SCATTER
#undef SCATTER_LOOP
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
        if (wm->s[w].head < lim) scatter_stream(&wm->s[w], a, lim, wm->acc, wm->flag, wm->cnt); /* cnt: NULL without a count */
    wm->a = a;
    wm->len = (lim - a + 63) & ~(int64_t)63;
    wm->sweep = 0;
    return 1;
}

/* Emits the flagged coordinates of block [off, off + 64) and clears it; returns
 * how many. Writes up to 64 entries at oi/og. The block's flags are one word of the
 * bitmap: at 1% density most blocks hold one flagged coordinate or none, and the
 * sweep visits every block of the window (a byte per flag, tested 32 at a time, cost
 * 15-30% more of the merge at 0.1-1% density; docs/optimizer.md). */
#define SWEEP_FEW 4
static inline int sweep_block(window_merge *wm, int64_t off, uint32_t *oi, float *og) {
    uint64_t m = wm->flag[off >> 6];
    if (!m) return 0;
    wm->flag[off >> 6] = 0;
    float *A = wm->acc + off;
    const uint32_t base = (uint32_t)(wm->a + off);
    const int p = wm->few ? __builtin_popcountll(m) : SWEEP_FEW + 1;
    if (p <= SWEEP_FEW) {
        /* A few flags (most blocks at 1-5% density): a fixed number of slots without
         * branches; the slots past p repeat coordinate 63, which is unflagged or
         * already emitted and cleared, and land past the count. */
        if (wm->cs) { /* cs[0] is read for a slot past p (its count is 0) and lands past the count too */
            uint16_t *C = wm->cnt + off;
            for (int e = 0; e < SWEEP_FEW; e++) {
                const int j = __builtin_ctzll(m | ((uint64_t)1 << 63));
                oi[e] = base + (uint32_t)j;
                og[e] = A[j] * wm->cs[C[j]];
                A[j] = 0.0f;
                C[j] = 0;
                m &= m - 1;
            }
            return p;
        }
        const float sc = wm->scale;
        for (int e = 0; e < SWEEP_FEW; e++) {
            const int j = __builtin_ctzll(m | ((uint64_t)1 << 63));
            oi[e] = base + (uint32_t)j;
            og[e] = A[j] * sc;
            A[j] = 0.0f;
            m &= m - 1;
        }
        return p;
    }
#if defined(__AVX512F__)
    const __m512 sc = _mm512_set1_ps(wm->scale);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int n = 0;
    uint16_t *C = wm->cnt ? wm->cnt + off : NULL;
    for (int c = 0; c < 4; c++) {
        const __mmask16 k = (__mmask16)(m >> (16 * c));
        __m512 f = sc;
        if (wm->cs) { /* each lane's cs[count] (cs[0] where nothing was pushed), then the counts cleared */
            const __m512i n = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(C + 16 * c)));
            /* up to 31 pushes a permute of two registers (a gather is a load a lane: 12 a
             * pushed entry at W = 8 x 1%, +45% of the kernel's time) */
            f = wm->ncs <= 32 ? _mm512_permutex2var_ps(_mm512_loadu_ps(wm->cs32), n, _mm512_loadu_ps(wm->cs32 + 16))
                              : _mm512_i32gather_ps(n, wm->cs, 4);
            _mm256_storeu_si256((__m256i *)(C + 16 * c), _mm256_setzero_si256());
        }
        const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(A + 16 * c), f);
        const __m512i ix = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(base + 16 * c)));
        _mm512_storeu_si512(oi + n, _mm512_maskz_compress_epi32(k, ix));
        _mm512_storeu_ps(og + n, _mm512_maskz_compress_ps(k, g));
        _mm512_storeu_ps(A + 16 * c, _mm512_setzero_ps());
        n += __builtin_popcount(k);
    }
    return n;
#else
    int n = 0;
    uint16_t *C = wm->cnt ? wm->cnt + off : NULL;
    while (m) {
        const int j = __builtin_ctzll(m);
        oi[n] = base + (uint32_t)j;
        if (wm->cs) {
            og[n] = A[j] * wm->cs[C[j]];
            C[j] = 0;
        } else {
            og[n] = A[j] * wm->scale;
        }
        A[j] = 0.0f;
        n++;
        m &= m - 1;
    }
    return n;
#endif
}

#define PREFETCH_W(addr) __builtin_prefetch((addr), 1, 3)

/* Early prefetch: the state lines of a tile are requested while the tile is being
 * merged, one tile before it is applied, so the memory system also works during
 * the merge (otherwise it idles there, with only the apply loop's few lookahead
 * prefetches in flight). mem == NULL: off. */
static inline void prefetch_new(const early_prefetch *ep, const uint32_t *oi, int from, int to) {
    if (!ep->mem) return;
    for (int e = from; e < to; e++) PREFETCH_W(ep->mem + (int64_t)oi[e] * ep->stride);
}

int STELLA_ISA_FN(stella_merge_window_tile)(window_merge *wm, uint32_t *oi, float *og, int cap,
                                            const early_prefetch *ep) {
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

/* The rest of one stream of the counted two-way merge: its own counts (c: NULL, 1
 * each), scaled by cs[count] (cs: NULL, written unscaled with their counts to oc). */
static int count_tail(stream_t *s, const uint16_t *c, const float *cs, uint32_t *oi, float *og, uint16_t *oc,
                      int cap, const early_prefetch *ep) {
    int64_t take = s->end - s->pos;
    if (take > cap) take = cap;
    for (int64_t j = 0; j < take; j++) {
        const int64_t p = s->pos + j;
        const uint32_t n = c ? c[p] : 1;
        const float v = 0.0f + load_val(s->val, s->dt, p);
        oi[j] = (uint32_t)s->idx[p];
        if (cs) {
            og[j] = v * cs[n];
        } else {
            og[j] = v;
            oc[j] = (uint16_t)n;
        }
    }
    prefetch_new(ep, oi, 0, (int)take);
    s->pos += take;
    s->head = stream_head(s);
    return (int)take;
}

/* Two sparse streams: a comparison merge, branch-free. With two pushes the union is
 * sparse at the densities pushes have (2% of the coordinates at 1% each), and the
 * window's sweep spends most of its time on empty blocks and on mispredicted exits
 * from the emit loop (11-14 ns per output here); this loop's only data-dependent
 * decisions are selects (2-3x faster, docs/optimizer.md). The sum is the reference's:
 * 0 + the first push's value, + the second's where both hold the coordinate, then
 * scaled. One body for both entry points below (`counted` is a constant in each):
 * plain, by scale1 where one push carried the coordinate and scale2 where both did;
 * counted, a's entries carrying counts ca (NULL: 1 each), b's 1, each sum times
 * cs[count], or (cs NULL) written unscaled with its count to oc. */
static inline __attribute__((always_inline)) int merge_two(stream_t *a, const uint16_t *ca, stream_t *b, float scale1,
                                                           float scale2, const float *cs, uint32_t *oi, float *og,
                                                           uint16_t *oc, int cap, const early_prefetch *ep,
                                                           const int counted) {
    const int32_t *ia = a->idx, *ib = b->idx;
    const void *va = a->val, *vb = b->val;
    const int32_t da = a->dt, db = b->dt;
    int64_t pa = a->pos, pb = b->pos;
    const int64_t ea = a->end, eb = b->end;
    int n = 0;
    while (pa < ea && pb < eb && n < cap) {
        const uint32_t x = (uint32_t)ia[pa], y = (uint32_t)ib[pb];
        const uint32_t ta = x <= y, tb = y <= x;
        const uint32_t ma = 0u - ta, mboth = 0u - (ta & tb);
        const float fx = load_val(va, da, pa), fy = load_val(vb, db, pb);
        /* selects on the bits: a float ?: here compiles to a branch the data decides */
        const float first = stella_bits_f32((stella_f32_bits(fx) & ma) | (stella_f32_bits(fy) & ~ma));
        const float s1 = 0.0f + first, s2 = s1 + fy;
        const float s = stella_bits_f32((stella_f32_bits(s2) & mboth) | (stella_f32_bits(s1) & ~mboth));
        oi[n] = (x & ma) | (y & ~ma);
        if (!counted) {
            og[n] = s * stella_bits_f32((stella_f32_bits(scale2) & mboth) | (stella_f32_bits(scale1) & ~mboth));
        } else { /* the cs and ca tests are the same for every entry */
            const uint32_t c = ((ca ? (uint32_t)ca[pa] : 1u) & ma) + tb;
            if (cs) {
                og[n] = s * cs[c];
            } else {
                og[n] = s;
                oc[n] = (uint16_t)c;
            }
        }
        pa += ta;
        pb += tb;
        n++;
    }
    prefetch_new(ep, oi, 0, n);
    a->pos = pa;
    b->pos = pb;
    a->head = stream_head(a);
    b->head = stream_head(b);
    if (n < cap && (pa >= ea) != (pb >= eb)) { /* one stream left: its entries as they are */
        stream_t *rest = pa < ea ? a : b;
        n += counted ? count_tail(rest, rest == a ? ca : NULL, cs, oi + n, og + n, oc ? oc + n : NULL, cap - n, ep)
                     : STELLA_ISA_FN(stella_merge_single_tile)(rest, scale1, oi + n, og + n, cap - n, ep);
    }
    return n;
}

int STELLA_ISA_FN(stella_merge_two_tile)(stream_t *a, stream_t *b, float scale1, float scale2, uint32_t *oi, float *og,
                                         int cap, const early_prefetch *ep) {
    return merge_two(a, NULL, b, scale1, scale2, NULL, oi, og, NULL, cap, ep, 0);
}

/* The two-way merge of the chain under a count (update.c): a stage of the chain
 * (cs NULL: sums and counts out) or its last (each sum times cs[count]). */
int STELLA_ISA_FN(stella_merge_two_count_tile)(stream_t *a, const uint16_t *ca, stream_t *b, const float *cs,
                                               uint32_t *oi, float *og, uint16_t *oc, int cap,
                                               const early_prefetch *ep) {
    return merge_two(a, ca, b, 1.0f, 1.0f, cs, oi, og, oc, cap, ep, 1);
}

/* One pushed stream: no merge at all, values converted and scaled. */
int STELLA_ISA_FN(stella_merge_single_tile)(stream_t *a, float scale, uint32_t *oi, float *og, int cap,
                                            const early_prefetch *ep) {
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
