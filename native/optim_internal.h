/* Internals shared by the optimizer kernel's sources (not part of the cffi API):
 * the state record, the merge streams and the tuning constants.
 *
 *   optim_state.c  allocation, field copies, bias-correction tables
 *   merge.c        merge of sorted pushes into tiles (windowed scatter / sweep)
 *   update.c       the SGD / Adam / AdamW tile updates, apply (threads), gather
 *                  (merge.c and update.c's apply are compiled once per ISA level,
 *                  stella_isa.h; the wrappers are native/isa/merge_v*.c, update_v*.c)
 *   union.c        k-way union of sorted index lists, scatter-add
 *   optim_tuning.h prefetch distance / tile / prefetch kind (constants; knobs in
 *                  the bench-only build)
 */
#ifndef STELLA_OPTIM_INTERNAL_H
#define STELLA_OPTIM_INTERNAL_H

#include "stella_native.h"

#include "cdefs/optim.h"

#define TILE_MAX 4096
#define MERGE_SLACK 64 /* the sweep may store up to 64 entries past the count */
#define TILE_BUF (TILE_MAX + MERGE_SLACK)
#define SENTINEL UINT32_MAX /* never a valid index: numel <= INT32_MAX */

/* Coordinates are interleaved records ({p, buf} for SGD, {p, m, v, step} for
 * Adam/AdamW): a random update costs one cache line, not one per field. */
#define STELLA_MAX_RANGES 64 /* threads (coordinate ranges) of one apply */

struct stella_optim {
    int32_t kind;
    int32_t nfields; /* floats per record: 2 (SGD) or 4 (Adam/AdamW) */
    int64_t numel;
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
    /* The undo log of the last apply: the records of its touched coordinates as they
     * were before it, in the order of its out_idx (stella_optim_rollback). */
    float *undo;
    int64_t undo_cap; /* coordinates */
    int64_t undo_len;
    /* ... and what it did to the parameters there, p_new - p_before in float32, in the
     * same order, written as it went (stella_optim_last_changes copies it out). */
    float *delta;
    int64_t delta_cap;
    /* Each of the last apply's coordinate ranges (one per thread, in order) left its
     * undo records and changes where it wrote them, not compacted: range r's are the
     * seg_len[r] entries from seg_off[r] (undo: x nfields floats), following out_idx's
     * order range after range; undo_len is their sum. */
    int32_t nseg;
    int64_t seg_off[STELLA_MAX_RANGES];
    int64_t seg_len[STELLA_MAX_RANGES];
};

#include "optim_tuning.h"

/* optim_state.c: make the bias-correction tables valid up to step `need`. */
int stella_optim_tables(stella_optim *st, double lr, double b1, double b2, int64_t need);
/* optim_state.c: room for the undo records of `n` coordinates. */
int stella_optim_reserve_undo(stella_optim *st, int64_t n);

/* ---- merge.c ---- */

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

/* The windowed merge of W >= 2 streams (merge.c explains it). */
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
    uint64_t *flag; /* B bits: coordinate a + j holds a sum; likewise zero outside */
    int few;        /* blocks hold few flags (sparse pushes): the sweep's scalar slots first */
    const float *cs; /* NULL: every sum times scale; else times cs[n], n the streams that carried it */
    uint16_t *cnt;   /* with cs: B counters, zero outside the current window's pending part */
    int ncs;         /* cs's length (the pushes + 1) */
    float cs32[32];  /* cs's first 32 values, zero beyond ncs: two registers for the vector sweep */
} window_merge;

/* Early prefetch of a tile's state records while it is merged; mem == NULL: off. */
typedef struct {
    float *mem;
    int64_t stride; /* floats per record */
} early_prefetch;

/* Merge the next tile (up to cap coordinates, sorted, values summed in push order
 * and scaled) into oi/og; returns its length, 0 when the streams are exhausted.
 * One copy per ISA level, called by the same level's stella_optim_apply (stella_isa.h). */
int STELLA_ISA_FN(stella_merge_window_tile)(window_merge *wm, uint32_t *oi, float *og, int cap,
                                            const early_prefetch *ep);
/* The same for two sparse streams (a, then b, in push order): a comparison merge; a sum
 * one stream carried is scaled by scale1, one both carried by scale2. */
int STELLA_ISA_FN(stella_merge_two_tile)(stream_t *a, stream_t *b, float scale1, float scale2, uint32_t *oi, float *og,
                                         int cap, const early_prefetch *ep);
/* The same for two sparse streams of a chain under a count: a's entries carry counts ca
 * (NULL: 1 each), b's 1; with cs each sum times cs[count], without it the sums unscaled
 * and their counts written to oc. */
int STELLA_ISA_FN(stella_merge_two_count_tile)(stream_t *a, const uint16_t *ca, stream_t *b, const float *cs,
                                               uint32_t *oi, float *og, uint16_t *oc, int cap,
                                               const early_prefetch *ep);
/* The same for one stream: no merge, values converted and scaled. */
int STELLA_ISA_FN(stella_merge_single_tile)(stream_t *a, float scale, uint32_t *oi, float *og, int cap,
                                            const early_prefetch *ep);

#endif
