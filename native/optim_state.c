/* The optimizer state of one tensor: allocation (huge pages), field copies for
 * snapshots and checkpoints, and the bias-correction tables of Adam/AdamW. */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "optim_internal.h"

#define HUGE_2M ((size_t)2 << 20)

/* ---------------------------------------------------------------- allocation */

stella_optim *stella_optim_new(int32_t kind, int64_t numel, int32_t hugepages) {
    if (kind < STELLA_OPT_SGD || kind > STELLA_OPT_ADAMW) return NULL;
    if (numel < 1 || numel > INT32_MAX) return NULL;
    stella_optim *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->kind = kind;
    st->numel = numel;
    st->nfields = kind == STELLA_OPT_SGD ? 2 : 4;
    int64_t padded = (numel + 15) & ~(int64_t)15;
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
    free(st->undo);
    free(st->delta);
    free(st);
}

int64_t stella_optim_bytes(const stella_optim *st) { return (int64_t)st->bytes; }

/* Fields are copied as bits: the step field is uint32. */
int stella_optim_set_field(stella_optim *st, int32_t field, const void *src, int64_t n) {
    if (!st || field < 0 || field >= st->nfields || n != st->numel || !src) return STELLA_E_ARG;
    const uint32_t *in = src;
    uint32_t *out = (uint32_t *)st->mem + field;
    const int64_t s = st->nfields;
    for (int64_t i = 0; i < n; i++) out[i * s] = in[i];
    if (st->kind != STELLA_OPT_SGD && field == STELLA_FIELD_STEP) {
        uint32_t mx = 0;
        for (int64_t i = 0; i < n; i++) mx = in[i] > mx ? in[i] : mx;
        st->max_step = mx;
    }
    return STELLA_OK;
}

int stella_optim_get_field(const stella_optim *st, int32_t field, void *dst, int64_t n) {
    if (!st || field < 0 || field >= st->nfields || n != st->numel || !dst) return STELLA_E_ARG;
    const uint32_t *in = (const uint32_t *)st->mem + field;
    uint32_t *out = dst;
    if (st->nfields == 2) {
        for (int64_t i = 0; i < n; i++) out[i] = in[2 * i];
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = in[4 * i];
    }
    return STELLA_OK;
}

/* Put back the records the last apply changed, from its undo log: `idx` is that
 * apply's out_idx (n entries, as it returned them). */
int stella_optim_rollback(stella_optim *st, const int32_t *idx, int64_t n) {
    if (!st || n < 0 || n != st->undo_len || (n > 0 && !idx)) return STELLA_E_ARG;
    const int64_t s = st->nfields;
    int64_t j = 0;
    for (int32_t r = 0; r < st->nseg; r++) { /* each range's records where it wrote them */
        const float *u = st->undo + st->seg_off[r] * s;
        for (int64_t i = 0; i < st->seg_len[r]; i++, j++) {
            if (STELLA_UNLIKELY(idx[j] < 0 || idx[j] >= st->numel)) return STELLA_E_RANGE;
            memcpy(st->mem + (int64_t)idx[j] * s, u + i * s, (size_t)s * sizeof(float));
        }
    }
    st->undo_len = 0;
    st->nseg = 0;
    return STELLA_OK;
}

/* What the last apply did to the parameters: out[j] = p_now - p_before at its out_idx[j]
 * (n entries), float32, as its tile loops wrote it beside the undo log (the server's
 * broadcast adds it to its residual). */
int stella_optim_last_changes(const stella_optim *st, int64_t n, float *out) {
    if (!st || n < 0 || n != st->undo_len || (n > 0 && !out)) return STELLA_E_ARG;
    for (int32_t r = 0; r < st->nseg; r++) { /* range after range, in out_idx's order */
        memcpy(out, st->delta + st->seg_off[r], (size_t)st->seg_len[r] * sizeof(float));
        out += st->seg_len[r];
    }
    return STELLA_OK;
}

/* Whole records (all fields of coordinates start..start+n-1, interleaved as held):
 * one memcpy, for checkpoints that copy a state a slice at a time between steps. */
int stella_optim_get_records(const stella_optim *st, void *dst, int64_t start, int64_t n) {
    if (!st || !dst || start < 0 || n < 0 || start > st->numel - n) return STELLA_E_ARG;
    memcpy(dst, (const uint32_t *)st->mem + start * st->nfields, (size_t)n * (size_t)st->nfields * 4u);
    return STELLA_OK;
}

int stella_optim_set_records(stella_optim *st, const void *src, int64_t start, int64_t n) {
    if (!st || !src || start < 0 || n < 0 || start > st->numel - n) return STELLA_E_ARG;
    uint32_t *out = (uint32_t *)st->mem + start * st->nfields;
    memcpy(out, src, (size_t)n * (size_t)st->nfields * 4u);
    if (st->kind != STELLA_OPT_SGD) {
        uint32_t mx = st->max_step;
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = out[i * 4 + STELLA_FIELD_STEP];
            mx = v > mx ? v : mx;
        }
        st->max_step = mx;
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

/* Grow *tab (elements of elem bytes, capacity *cap) by doubling, from 64, until it
 * holds want entries. */
static int grow(void **tab, size_t elem, int64_t *cap, int64_t want) {
    if (want <= *cap) return STELLA_OK;
    int64_t c = *cap ? *cap : 64;
    while (c < want) c *= 2;
    void *t = realloc(*tab, (size_t)c * elem);
    if (!t) return STELLA_E_NOMEM;
    *tab = t;
    *cap = c;
    return STELLA_OK;
}

int stella_optim_reserve_undo(stella_optim *st, int64_t n) {
    int rc = grow((void **)&st->undo, (size_t)st->nfields * sizeof(float), &st->undo_cap, n);
    return rc != STELLA_OK ? rc : grow((void **)&st->delta, sizeof(float), &st->delta_cap, n);
}

/* Make tab1/tab2 valid for every step up to `need` (or their saturation step). */
int stella_optim_tables(stella_optim *st, double lr, double b1, double b2, int64_t need) {
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
    if (grow((void **)&st->tab1, sizeof *st->tab1, &st->cap1, want1) != STELLA_OK ||
        grow((void **)&st->tab2, sizeof *st->tab2, &st->cap2, want2) != STELLA_OK)
        return STELLA_E_NOMEM;
    for (int64_t k = st->len1; k < want1; k++) st->tab1[k] = 1.0 - pow(b1, (double)k);
    for (int64_t k = st->len2; k < want2; k++) st->tab2[k] = (float)sqrt(1.0 - pow(b2, (double)k));
    if (want1 > st->len1) st->len1 = want1;
    if (want2 > st->len2) st->len2 = want2;
    /* The learning rate changes with schedules, often every step: this table is
     * short (up to beta1's saturation step, 264 entries for 0.9). */
    if (grow((void **)&st->sstab, sizeof *st->sstab, &st->sscap, st->cap1) != STELLA_OK) return STELLA_E_NOMEM;
    if (lr != st->sslr) st->sslen = 0;
    for (int64_t k = st->sslen ? st->sslen : 1; k < st->len1; k++) st->sstab[k] = (float)(lr / st->tab1[k]);
    st->sstab[0] = 0.0f;
    st->sslen = st->len1;
    st->sslr = lr;
    return STELLA_OK;
}
