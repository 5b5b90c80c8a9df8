/* A model's parameters seen as one flat float32 vector, without moving them
 * (stella.flat.FlatParams, on CPU).
 *
 * The user's framework owns the parameters: each is its own allocation, float32, f16
 * or bf16. A table of parts (cdefs/flat.h: data pointer, first flat coordinate, size,
 * dtype), one per tensor in flat order, lets one call walk the whole model: the
 * worker's round (residual = anchor - w, the install of the server's answer) costs
 * one call whatever the number of tensors, where a loop in Python paid a dispatch and
 * a torch op or three per tensor. Memory-bound loops, one thread (the caller's, the GIL
 * released by cffi).
 *
 * Rounding is torch's: a value written into an f16/bf16 tensor is rounded to it (to
 * nearest even, with the one converter of stella_half.h), and an addition rounds the
 * value first and then the float32 sum, as w.index_add_(0, idx, val.to(w.dtype)) and
 * w.add_(val.to(w.dtype)) do (tests/test_flat.py checks it bit for bit against them).
 *
 * The sparse forms take the wire's sorted int32 indices: a part's share is found by a
 * binary search, and its entries are scattered misses (at 1% density each its own
 * cache line, at 0.1% its own page), so each asks for the line of the entry PREFETCH
 * ahead. Measured on the byte LM's layout with cold caches (AMD EPYC, 2 shared cores,
 * load ~4): ~12 ns an entry at 1%, ~33 at 0.1%; the prefetch gained ~5-10% at 0.1%
 * and nothing measurable at 1% (warm, ~1.8 ns an entry either way).
 *
 * Dispatched by ISA level (stella_isa.h): the f16 loops convert with F16C / AVX-512 in
 * the x86-64-v3/v4 copies; the other loops are plain C the compiler vectorises. Every
 * copy gives the same bits.
 */
#include <string.h>

#include "stella_native.h"
#include "stella_half.h"

#include "cdefs/flat.h"

#define CHUNK 256   /* floats converted at a time on the stack (f16 arithmetic) */
#define PREFETCH 16 /* sparse entries ahead whose line is asked for */

static inline int dtype_ok(int32_t d) { return d == STELLA_VAL_F32 || d == STELLA_VAL_F16 || d == STELLA_VAL_BF16; }

/* STELLA_OK when the parts tile [0, *end) in order with known dtypes (and data, when
 * `writes`); the end goes to *end. */
static int check_parts(const stella_flat_part *parts, int32_t nparts, int writes, int64_t *end) {
    if (nparts < 0 || (nparts > 0 && !parts)) return STELLA_E_ARG;
    int64_t at = 0;
    for (int32_t i = 0; i < nparts; i++) {
        const stella_flat_part *p = &parts[i];
        if (p->start != at || p->numel < 0 || !dtype_ok(p->dtype) || (p->numel > 0 && writes && !p->data))
            return STELLA_E_ARG;
        at += p->numel;
    }
    *end = at;
    return STELLA_OK;
}

static int check_range(const stella_flat_part *parts, int32_t nparts, int writes, int64_t lo, int64_t hi,
                       const void *buf) {
    int64_t end = 0;
    const int rc = check_parts(parts, nparts, writes, &end);
    if (rc != STELLA_OK) return rc;
    if (lo < 0 || hi < lo || hi > end || (hi > lo && !buf)) return STELLA_E_ARG;
    return STELLA_OK;
}

/* ---- dense segments: n elements of one part from local offset 0 of w ------------ */

static void gather_seg(int32_t dtype, const void *w, int64_t n, float *out) {
    if (!w) {
        memset(out, 0, (size_t)n * sizeof(float));
    } else if (dtype == STELLA_VAL_F32) {
        memcpy(out, w, (size_t)n * sizeof(float));
    } else if (dtype == STELLA_VAL_F16) {
        stella_f16_to_f32_n((const uint16_t *)w, n, out);
    } else {
        const uint16_t *h = (const uint16_t *)w;
        for (int64_t i = 0; i < n; i++) out[i] = stella_bf16_to_float(h[i]);
    }
}

static void residual_seg(int32_t dtype, const void *w, int64_t n, const float *a, float *out) {
    if (!w) {
        for (int64_t i = 0; i < n; i++) out[i] = a[i] - 0.0f;
    } else if (dtype == STELLA_VAL_F32) {
        const float *x = (const float *)w;
        for (int64_t i = 0; i < n; i++) out[i] = a[i] - x[i];
    } else if (dtype == STELLA_VAL_F16) {
        float buf[CHUNK];
        for (int64_t i = 0; i < n; i += CHUNK) {
            const int64_t m = n - i < CHUNK ? n - i : CHUNK;
            stella_f16_to_f32_n((const uint16_t *)w + i, m, buf);
            for (int64_t j = 0; j < m; j++) out[i + j] = a[i + j] - buf[j];
        }
    } else {
        const uint16_t *h = (const uint16_t *)w;
        for (int64_t i = 0; i < n; i++) out[i] = a[i] - stella_bf16_to_float(h[i]);
    }
}

/* One float to f16, to nearest even: F16C where the copy is compiled for it (the sparse
 * loops' per-entry conversions: the soft one cost ~3x in add_at), the soft one else; the
 * same bits either way (stella_half.h). */
static inline uint16_t f32_to_f16(float v) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
#else
    return stella_f32_to_f16_soft(v);
#endif
}

static inline float f16_round(float v) { return stella_half_to_float(f32_to_f16(v)); }
static inline float bf16_round(float v) { return stella_bf16_to_float(stella_float_to_bf16(v)); }

static void add_seg(int32_t dtype, void *w, int64_t n, const float *v) {
    if (dtype == STELLA_VAL_F32) {
        float *x = (float *)w;
        for (int64_t i = 0; i < n; i++) x[i] += v[i];
    } else if (dtype == STELLA_VAL_F16) {
        uint16_t *h = (uint16_t *)w;
        float acc[CHUNK], inc[CHUNK];
        uint16_t tmp[CHUNK];
        for (int64_t i = 0; i < n; i += CHUNK) {
            const int64_t m = n - i < CHUNK ? n - i : CHUNK;
            stella_f32_to_f16_n(v + i, m, tmp); /* the value rounded to f16 first */
            stella_f16_to_f32_n(tmp, m, inc);
            stella_f16_to_f32_n(h + i, m, acc);
            for (int64_t j = 0; j < m; j++) acc[j] += inc[j];
            stella_f32_to_f16_n(acc, m, h + i);
        }
    } else {
        uint16_t *h = (uint16_t *)w;
        for (int64_t i = 0; i < n; i++)
            h[i] = stella_float_to_bf16(stella_bf16_to_float(h[i]) + bf16_round(v[i]));
    }
}

static void set_seg(int32_t dtype, void *w, int64_t n, const float *v) {
    if (dtype == STELLA_VAL_F32) {
        memcpy(w, v, (size_t)n * sizeof(float));
    } else if (dtype == STELLA_VAL_F16) {
        stella_f32_to_f16_n(v, n, (uint16_t *)w);
    } else {
        uint16_t *h = (uint16_t *)w;
        for (int64_t i = 0; i < n; i++) h[i] = stella_float_to_bf16(v[i]);
    }
}

enum dense_op { GATHER, RESIDUAL, ADD, SET };

/* The op over [lo, hi), part by part; buf (out, or val) and anchor hold the range and
 * move along with it. */
static void dense_walk(enum dense_op op, const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi,
                       const float *anchor, float *buf) {
    for (int32_t i = 0; i < nparts && lo < hi; i++) {
        const stella_flat_part *p = &parts[i];
        const int64_t stop = p->start + p->numel;
        if (stop <= lo) continue;
        const int64_t b = hi < stop ? hi : stop; /* [lo, b): this part's share */
        const int64_t off = lo - p->start, n = b - lo;
        const size_t esize = p->dtype == STELLA_VAL_F32 ? 4 : 2;
        char *w = p->data ? (char *)p->data + off * (int64_t)esize : NULL;
        switch (op) {
        case GATHER: gather_seg(p->dtype, w, n, buf); break;
        case RESIDUAL: residual_seg(p->dtype, w, n, anchor, buf); break;
        case ADD: add_seg(p->dtype, w, n, buf); break;
        case SET: set_seg(p->dtype, w, n, buf); break;
        }
        buf += n;
        if (anchor) anchor += n;
        lo = b;
    }
}

int STELLA_ISA_FN(stella_flat_gather)(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi,
                                      float *out) {
    const int rc = check_range(parts, nparts, 0, lo, hi, out);
    if (rc == STELLA_OK) dense_walk(GATHER, parts, nparts, lo, hi, NULL, out);
    return rc;
}

int STELLA_ISA_FN(stella_flat_residual)(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi,
                                        const float *anchor, float *out) {
    int rc = check_range(parts, nparts, 0, lo, hi, out);
    if (rc == STELLA_OK && hi > lo && !anchor) rc = STELLA_E_ARG;
    if (rc == STELLA_OK) dense_walk(RESIDUAL, parts, nparts, lo, hi, anchor, out);
    return rc;
}

int STELLA_ISA_FN(stella_flat_add_range)(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi,
                                         const float *val) {
    const int rc = check_range(parts, nparts, 1, lo, hi, val);
    if (rc == STELLA_OK) dense_walk(ADD, parts, nparts, lo, hi, NULL, (float *)val); /* val only read */
    return rc;
}

int STELLA_ISA_FN(stella_flat_set_range)(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi,
                                         const float *val) {
    const int rc = check_range(parts, nparts, 1, lo, hi, val);
    if (rc == STELLA_OK) dense_walk(SET, parts, nparts, lo, hi, NULL, (float *)val);
    return rc;
}

/* ---- sparse: entries [j, e) of idx/val land in one part at w[off + idx[j]] ---------- */

enum sparse_op {
    S_ADD,       /* w += v */
    S_SET,       /* w = v */
    S_MERGE_ADD, /* a += v, w += a_new - a_old */
    S_MERGE_SET, /* a = v, w += v - a_old */
};

/* The anchor's part of a merge: anchor entry *a takes v, the change it made (float32). */
static inline float merge_step(enum sparse_op op, float *a, float v) {
    const float old = *a;
    if (op == S_MERGE_ADD) {
        const float now = old + v;
        *a = now;
        return now - old;
    }
    *a = v;
    return v - old;
}

/* The loop over [j, e) with the lines of entry j + PREFETCH asked for (the weight's, and
 * the anchor's when there is one), then the last PREFETCH entries without. STMT sees
 * `at` (the weight), `v` (the value) and `d` (what to add: v, or the anchor's change). */
#define SPARSE_LOOP(T, W, STMT)                                                                    \
    do {                                                                                           \
        T *const w_ = (T *)(W);                                                                    \
        for (int64_t j_ = j; j_ < e; j_++) {                                                       \
            if (j_ + PREFETCH < e) {                                                               \
                __builtin_prefetch(w_ + off + idx[j_ + PREFETCH], 1, 3);                           \
                if (anchor) __builtin_prefetch(anchor + idx[j_ + PREFETCH], 1, 3);                 \
            }                                                                                      \
            T *const at = w_ + off + idx[j_];                                                      \
            const float v = val[j_];                                                               \
            const float d = op == S_ADD || op == S_SET ? v : merge_step(op, anchor + idx[j_], v); \
            STMT;                                                                                  \
        }                                                                                          \
    } while (0)

/* anchor: NULL, or (merges) the anchor's entries for coordinates base, base + 1, ... (anchor_n of them). */
static int sparse_walk(enum sparse_op op, const stella_flat_part *parts, int32_t nparts, int64_t base,
                       const int32_t *idx, const float *val, int64_t n, float *anchor, int64_t anchor_n) {
    int64_t end = 0;
    int rc = check_parts(parts, nparts, 1, &end);
    if (rc != STELLA_OK) return rc;
    if (n < 0 || base < 0 || base > end || (n > 0 && (!idx || !val))) return STELLA_E_ARG;
    int64_t lim = end - base;
    if (op == S_MERGE_ADD || op == S_MERGE_SET) {
        if (anchor_n < 0 || (n > 0 && !anchor)) return STELLA_E_ARG;
        if (anchor_n < lim) lim = anchor_n;
    } else {
        anchor = NULL;
    }
    rc = stella_check_sorted(idx, n, lim, NULL);
    if (rc != STELLA_OK) return rc;
    int64_t j = 0;
    for (int32_t i = 0; i < nparts && j < n; i++) {
        const stella_flat_part *p = &parts[i];
        const int64_t stop = p->start + p->numel;
        if (base + idx[j] >= stop) continue;
        const int64_t e = j + stella_lower_bound(idx + j, n - j, stop - base);
        const int64_t off = base - p->start; /* coordinate base + idx lives at w[off + idx] */
        if (p->dtype == STELLA_VAL_F32) {
            if (op == S_SET)
                SPARSE_LOOP(float, p->data, *at = v);
            else
                SPARSE_LOOP(float, p->data, *at += d);
        } else if (p->dtype == STELLA_VAL_F16) {
            if (op == S_SET)
                SPARSE_LOOP(uint16_t, p->data, *at = f32_to_f16(v));
            else
                SPARSE_LOOP(uint16_t, p->data, *at = f32_to_f16(stella_half_to_float(*at) + f16_round(d)));
        } else {
            if (op == S_SET)
                SPARSE_LOOP(uint16_t, p->data, *at = stella_float_to_bf16(v));
            else
                SPARSE_LOOP(uint16_t, p->data, *at = stella_float_to_bf16(stella_bf16_to_float(*at) + bf16_round(d)));
        }
        j = e;
    }
    return STELLA_OK;
}

int STELLA_ISA_FN(stella_flat_add_at)(const stella_flat_part *parts, int32_t nparts, int64_t base, const int32_t *idx,
                                      const float *val, int64_t n) {
    return sparse_walk(S_ADD, parts, nparts, base, idx, val, n, NULL, 0);
}

int STELLA_ISA_FN(stella_flat_set_at)(const stella_flat_part *parts, int32_t nparts, int64_t base, const int32_t *idx,
                                      const float *val, int64_t n) {
    return sparse_walk(S_SET, parts, nparts, base, idx, val, n, NULL, 0);
}

int STELLA_ISA_FN(stella_flat_merge_at)(const stella_flat_part *parts, int32_t nparts, int64_t base,
                                        const int32_t *idx, const float *val, int64_t n, float *anchor,
                                        int64_t anchor_n, int32_t set) {
    return sparse_walk(set ? S_MERGE_SET : S_MERGE_ADD, parts, nparts, base, idx, val, n, anchor, anchor_n);
}

#if STELLA_ISA_BASE
STELLA_ISA_VARIANTS(stella_flat_gather);
STELLA_ISA_VARIANTS(stella_flat_residual);
STELLA_ISA_VARIANTS(stella_flat_add_range);
STELLA_ISA_VARIANTS(stella_flat_set_range);
STELLA_ISA_VARIANTS(stella_flat_add_at);
STELLA_ISA_VARIANTS(stella_flat_set_at);
STELLA_ISA_VARIANTS(stella_flat_merge_at);

int stella_flat_gather(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi, float *out) {
    return STELLA_ISA_PICK(stella_flat_gather)(parts, nparts, lo, hi, out);
}

int stella_flat_residual(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi, const float *anchor,
                         float *out) {
    return STELLA_ISA_PICK(stella_flat_residual)(parts, nparts, lo, hi, anchor, out);
}

int stella_flat_add_range(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi, const float *val) {
    return STELLA_ISA_PICK(stella_flat_add_range)(parts, nparts, lo, hi, val);
}

int stella_flat_set_range(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi, const float *val) {
    return STELLA_ISA_PICK(stella_flat_set_range)(parts, nparts, lo, hi, val);
}

int stella_flat_add_at(const stella_flat_part *parts, int32_t nparts, int64_t base, const int32_t *idx,
                       const float *val, int64_t n) {
    return STELLA_ISA_PICK(stella_flat_add_at)(parts, nparts, base, idx, val, n);
}

int stella_flat_set_at(const stella_flat_part *parts, int32_t nparts, int64_t base, const int32_t *idx,
                       const float *val, int64_t n) {
    return STELLA_ISA_PICK(stella_flat_set_at)(parts, nparts, base, idx, val, n);
}

int stella_flat_merge_at(const stella_flat_part *parts, int32_t nparts, int64_t base, const int32_t *idx,
                         const float *val, int64_t n, float *anchor, int64_t anchor_n, int32_t set) {
    return STELLA_ISA_PICK(stella_flat_merge_at)(parts, nparts, base, idx, val, n, anchor, anchor_n, set);
}
#endif
