/* Lazy sparse optimizers: the merge of sorted pushes fused with the update.
 *
 * One pass per thread over its contiguous coordinate range: the W sorted index
 * streams are merged (merge.c: duplicates summed in push order, then scaled once)
 * into a small tile that stays in cache, and the tile is applied to the state
 * while the next tile's state lines are already being prefetched. State is
 * interleaved per coordinate ({p, buf} for SGD, {p, m, v, step} for Adam/AdamW:
 * one 16-byte record, four per cache line), so a random update costs one cache
 * line instead of four. Design and measurements: docs/optimizer.md.
 * Every float operation follows server/stella_ps/optim_ref.py in order and in
 * float32, so results are bit-identical to the reference (the build is ISO C11:
 * GCC does not contract a*b+c into FMAs there).
 *
 * The finite-step guard: each tile copies the records it is about to change into
 * the state's undo log (sequential writes, in the order of the touched indices) and
 * checks that every value it writes is finite. A step with one non-finite result
 * anywhere puts every touched record back and returns STELLA_E_NONFINITE, so a step
 * either applies whole or changes nothing; stella_optim_rollback undoes the last
 * successful apply the same way (a step over several tensors fails as a whole).
 */
#define _GNU_SOURCE
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "optim_internal.h"

/* Prefetch the state of the coordinate `ahead` positions on: from this tile, or
 * from the head of the next one. */
static inline int32_t ahead_index(const uint32_t *ix, int n, const uint32_t *nx, int nn, int j, int pd) {
    int a = j + pd;
    if (a < n) return (int32_t)ix[a];
    a -= n;
    return a < nn ? (int32_t)nx[a] : -1;
}

static inline void prefetch_coord(float *mem, int64_t stride, int32_t i, int pmode) {
    if (i < 0) return;
    float *base = mem + (int64_t)i * stride;
    if (pmode == 1)
        __builtin_prefetch(base, 0, 2);
    else
        __builtin_prefetch(base, 1, 3);
}

/* |x| <= FLT_MAX: false for NaN and +-Inf. */
#define FINITE(x) ((uint32_t)(fabsf(x) <= FLT_MAX))

/* One record per coordinate: {p, buf} (stride 2). Returns 1 when every value
 * written is finite; U receives the records as they were. */
static inline __attribute__((always_inline)) uint32_t sgd_tile(float *mem,
                                                               const uint32_t *ix, const float *g, int n,
                                                               const uint32_t *nx, int nn,
                                                               const stella_optim_cfg *c, int pd, int pmode,
                                                               float *STELLA_RESTRICT U, float *STELLA_RESTRICT D) {
    const float lr = c->lr, wd = c->weight_decay, mom = c->momentum, omd = c->one_minus_dampening;
    const int has_wd = c->has_weight_decay, has_mom = c->has_momentum, nest = c->nesterov;
    uint32_t ok = 1;
    for (int j = 0; j < n; j++) {
        if (pd) prefetch_coord(mem, 2, ahead_index(ix, n, nx, nn, j, pd), pmode);
        float *P = mem + (int64_t)ix[j] * 2;
        float *B = P + 1;
        float p = *P, d = g[j];
        U[2 * j] = p;
        U[2 * j + 1] = *B;
        if (has_wd) d = d + wd * p;
        if (has_mom) {
            float buf = mom * *B + omd * d;
            *B = buf;
            ok &= FINITE(buf);
            d = nest ? d + mom * buf : buf;
        }
        const float np = p - lr * d;
        *P = np;
        D[j] = np - p;
        ok &= FINITE(np);
    }
    return ok;
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
static inline __attribute__((always_inline)) uint32_t adam_tile(float *mem,
                                                                const uint32_t *ix, const float *g, int n,
                                                                const uint32_t *nx, int nn,
                                                                const stella_optim_cfg *c, int pd, int pmode,
                                                                const float *sstab, uint32_t last1,
                                                                const float *tab2, uint32_t last2,
                                                                float *buf, float *STELLA_RESTRICT U,
                                                                float *STELLA_RESTRICT D, uint32_t *ok) {
    float *tp = buf, *tm = buf + TILE_BUF, *tv = buf + 2 * TILE_BUF;
    uint32_t *tk = (uint32_t *)(buf + 3 * TILE_BUF);
    for (int j = 0; j < n; j++) {
        if (pd) prefetch_coord(mem, 4, ahead_index(ix, n, nx, nn, j, pd), pmode);
        const float *R = mem + (int64_t)ix[j] * 4;
        memcpy(U + 4 * j, R, 16);
        tp[j] = R[0];
        tm[j] = R[1];
        tv[j] = R[2];
        tk[j] = ((const uint32_t *)R)[3];
    }
    const uint32_t kmax = adam_math(tp, tm, tv, tk, g, n, c, sstab, last1, tab2, last2);
    uint32_t good = 1;
    for (int j = 0; j < n; j++) good &= FINITE(tp[j]) & FINITE(tm[j]) & FINITE(tv[j]);
    *ok &= good;
    for (int j = 0; j < n; j++) D[j] = tp[j] - U[4 * j];
    for (int j = 0; j < n; j++) {
        float *R = mem + (int64_t)ix[j] * 4;
        R[0] = tp[j];
        R[1] = tm[j];
        R[2] = tv[j];
        ((uint32_t *)R)[3] = tk[j];
    }
    return kmax;
}

/* ----------------------------------------------------------------- apply */

typedef struct {
    stella_optim *st;
    const stella_push *pushes;
    int32_t npush;
    float scale;
    const float *cs; /* NULL, or npush + 1 scales by the pushes that carried a coordinate */
    const stella_optim_cfg *cfg;
    int64_t lo, hi;
    uint32_t *out; /* this range's slice of the output */
    float *undo;   /* and of the undo log (records, in the order of out) */
    float *delta;  /* and of the parameters' changes (in the order of out) */
    int64_t count;
    uint32_t kmax;
    uint32_t finite; /* every value written was finite */
    int rc;
} range_job;

/* Pushed entries per coordinate of a range below which two sparse pushes are merged
 * by comparison rather than through the window (about 5% density each). */
#define TWO_WAY_BELOW 0.1
/* Pushed entries per 64-coordinate block up to which the window's sweep tries a few
 * scalar slots before its vector path (merge.c sweep_block): about 2.5 a block at
 * W = 4 x 1% (+8% SGD at 100M), and a mispredicted branch at W = 8 x 1% (about 5). */
#define SWEEP_FEW_BELOW 3.0
/* Pushed entries per coordinate below which three or four sparse pushes are merged by
 * chained two-way merges rather than through the window (whose sweep costs per block
 * of coordinates, however few entries it finds). */
#define CHAIN_BELOW 0.02
/* ... and for at most this many pushes: the chain handles each entry again at every
 * later stage (W = 4 at 0.1%: 30 -> 40 M upd/s against the window; W = 8: 34 -> 30). */
#define CHAIN_MAX 4

static void run_range(range_job *job) {
    stella_optim *st = job->st;
    const int W = job->npush;
    stream_t streams[W > 0 ? W : 1];
    int live = 0;
    for (int w = 0; w < W; w++) {
        const stella_push *ps = &job->pushes[w];
        stream_t s = {ps->idx, ps->val, 0, 0, SENTINEL, ps->dtype};
        if (ps->idx) {
            s.pos = stella_lower_bound(ps->idx, ps->n, job->lo);
            s.end = stella_lower_bound(ps->idx, ps->n, job->hi);
        } else {
            s.pos = job->lo;
            s.end = job->hi;
        }
        if (s.pos >= s.end) continue; /* nothing of this push in the range */
        s.head = stream_head(&s);
        streams[live++] = s;
    }
    const int tile = TUNE_TILE, pd = TUNE_PREFETCH, pmode = TUNE_PREFETCH_KIND;
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
    window_merge wm = {streams, live, job->scale, job->hi, 0, 0, 0, 0, NULL, NULL, 0, job->cs, NULL};
    int64_t pushed = 0;
    for (int w = 0; w < live; w++) pushed += streams[w].end - streams[w].pos;
    const double per_coord = job->hi > job->lo ? (double)pushed / (double)(job->hi - job->lo) : 0.0;
    /* Two sparse pushes: the comparison merge, below the density where the window's
     * sweep catches up with it (merge.c; measured in docs/optimizer.md). */
    int sparse = 1;
    for (int w = 0; w < live; w++) sparse &= streams[w].idx != NULL;
    /* Three or four sparse pushes, few entries a coordinate: the first W - 1 merged into
     * one float32 stream by chained two-way merges, in push order and unscaled (so the
     * sums are the reference's bit for bit), then the last one as a two-way merge. With a
     * scale by count each chained entry carries how many pushes it holds (chain_c). */
    uint32_t *chain_buf = NULL;
    const uint16_t *chain_c = NULL;
    if (live > 2 && live <= CHAIN_MAX && sparse && per_coord < CHAIN_BELOW) {
        int64_t cap = 0;
        for (int w = 0; w < live - 1; w++) cap += streams[w].end - streams[w].pos;
        const int64_t half = 3 * cap; /* 32-bit words a half: indices, sums, counts (16 bits, rounded up) */
        chain_buf = malloc((size_t)half * 2 * sizeof(uint32_t));
        if (!chain_buf) {
            free(scratch);
            job->rc = STELLA_E_NOMEM;
            return;
        }
        const early_prefetch none = {NULL, 0};
        stream_t acc = streams[0];
        for (int w = 1; w < live - 1; w++) {
            uint32_t *oi = chain_buf + (w & 1) * half; /* the two halves take turns */
            float *og = (float *)(oi + cap);
            uint16_t *oc = (uint16_t *)(og + cap);
            int64_t n = 0;
            for (int got; (got = job->cs ? STELLA_ISA_FN(stella_merge_two_count_tile)(&acc, chain_c, &streams[w], NULL,
                                                                                       oi + n, og + n, oc + n,
                                                                                       TILE_MAX, &none)
                                         : STELLA_ISA_FN(stella_merge_two_tile)(&acc, &streams[w], 1.0f, 1.0f, oi + n,
                                                                                og + n, TILE_MAX, &none)) > 0;)
                n += got;
            acc = (stream_t){(const int32_t *)oi, og, 0, n, SENTINEL, STELLA_VAL_F32};
            acc.head = stream_head(&acc);
            if (job->cs) chain_c = oc;
        }
        streams[0] = acc;
        streams[1] = streams[live - 1];
        live = 2;
    }
    const int two = live == 2 && sparse && (chain_buf || per_coord < TWO_WAY_BELOW);
    if (live > 1 && !two) {
        /* Window: about 256 pushed entries, between 1 and 64 Ki coordinates. */
        int64_t B = 64;
        while (B < 65536 && (double)B * per_coord < 256.0 && B < job->hi - job->lo) B *= 2;
        wm.B = B;
        wm.few = per_coord * 64.0 <= SWEEP_FEW_BELOW;
        const size_t flag_bytes = ((size_t)B / 8 + 63) & ~(size_t)63; /* B bits, whole cache lines */
        wm.acc = aligned_alloc(64, (size_t)B * sizeof(float));
        wm.flag = aligned_alloc(64, flag_bytes);
        wm.cnt = job->cs ? aligned_alloc(64, (size_t)B * sizeof(uint16_t)) : NULL;
        if (!wm.acc || !wm.flag || (job->cs && !wm.cnt)) {
            free(chain_buf);
            free(wm.acc);
            free(wm.flag);
            free(wm.cnt);
            free(scratch);
            job->rc = STELLA_E_NOMEM;
            return;
        }
        memset(wm.acc, 0, (size_t)B * sizeof(float));
        memset(wm.flag, 0, flag_bytes);
        if (wm.cnt) {
            memset(wm.cnt, 0, (size_t)B * sizeof(uint16_t));
            wm.ncs = W + 1;
            memset(wm.cs32, 0, sizeof wm.cs32);
            memcpy(wm.cs32, job->cs, (size_t)(wm.ncs < 32 ? wm.ncs : 32) * sizeof(float));
        }
    }
    const early_prefetch ep = {TUNE_EARLY ? st->mem : NULL, st->nfields};
    /* a sum that one push carried, and one that two did */
    const float s1 = job->cs ? job->cs[1] : job->scale, s2 = job->cs && W >= 2 ? job->cs[2] : job->scale;
#define NEXT_TILE(oi, og)                                                                                \
    (chain_c ? STELLA_ISA_FN(stella_merge_two_count_tile)(streams, chain_c, streams + 1, job->cs, (oi), (og),   \
                                                          NULL, tile, &ep)                                     \
     : two      ? STELLA_ISA_FN(stella_merge_two_tile)(streams, streams + 1, s1, s2, (oi), (og), tile, &ep) \
     : live > 1 ? STELLA_ISA_FN(stella_merge_window_tile)(&wm, (oi), (og), tile, &ep)                      \
     : live     ? STELLA_ISA_FN(stella_merge_single_tile)(streams, s1, (oi), (og), tile, &ep)              \
                : 0)
    int cur = 0;
    int n = NEXT_TILE(ibuf[0], gbuf[0]);
    int64_t total = 0;
    uint32_t kmax = 0;
    const stella_optim_cfg *c = job->cfg;
    float *mem = st->mem;
    const uint32_t last1 = (uint32_t)(st->len1 - 1), last2 = (uint32_t)(st->len2 - 1);
    const int64_t nf = st->nfields;
    uint32_t finite = 1;
    while (n > 0) {
        int nxt = cur ^ 1;
        int nn = NEXT_TILE(ibuf[nxt], gbuf[nxt]);
        const uint32_t *ix = ibuf[cur], *nx = ibuf[nxt];
        const float *g = gbuf[cur];
        float *U = job->undo + total * nf, *D = job->delta + total;
        if (st->kind == STELLA_OPT_SGD) {
            finite &= sgd_tile(mem, ix, g, n, nx, nn, c, pd, pmode, U, D);
        } else {
            uint32_t k = adam_tile(mem, ix, g, n, nx, nn, c, pd, pmode, st->sstab, last1, st->tab2, last2, abuf,
                                   U, D, &finite);
            kmax = k > kmax ? k : kmax;
        }
        memcpy(job->out + total, ix, (size_t)n * 4);
        total += n;
        n = nn;
        cur = nxt;
    }
#undef NEXT_TILE
    free(chain_buf);
    free(scratch);
    free(wm.acc);
    free(wm.flag);
    free(wm.cnt);
    job->count = total;
    job->kmax = kmax;
    job->finite = finite;
    job->rc = STELLA_OK;
}

static void *run_range_thread(void *arg) {
    run_range(arg);
    return NULL;
}

#define MAX_THREADS STELLA_MAX_RANGES
#define PARALLEL_MIN_WORK ((int64_t)1 << 15)

/* Dispatched by ISA level (stella_isa.h): each level's copy runs that level's merge
 * (merge.c: AVX-512 sweep, F16C loads) and Adam arithmetic (vectorised to its
 * width); all give the same bits (no FMA contraction in ISO C mode). */
int64_t STELLA_ISA_FN(stella_optim_apply)(stella_optim *st, const stella_push *pushes, int32_t npush,
                                          float scale, const float *count_scale, const stella_optim_cfg *cfg,
                                          int32_t *out_idx, int64_t out_cap, int32_t nthreads) {
    if (!st || npush < 0 || (npush > 0 && !pushes) || !cfg || cfg->kind != st->kind) return STELLA_E_ARG;
    if (count_scale && npush > 65535) return STELLA_E_ARG; /* the window's counters are 16 bits */
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
    st->undo_len = 0;
    st->nseg = 0;
    if (bound == 0) return 0;
    if (stella_optim_reserve_undo(st, bound) != STELLA_OK) return STELLA_E_NOMEM;
    if (st->kind != STELLA_OPT_SGD) {
        int rc = stella_optim_tables(st, cfg->lr_d, cfg->beta1_d, cfg->beta2_d, (int64_t)st->max_step + 1);
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
            cnt += p->idx ? stella_lower_bound(p->idx, p->n, hi) - stella_lower_bound(p->idx, p->n, lo) : hi - lo;
        }
        if (cnt > hi - lo) cnt = hi - lo;
        jobs[t] = (range_job){st, pushes, npush, scale, count_scale, cfg, lo, hi, (uint32_t *)out_idx + off,
                              st->undo + off * st->nfields, st->delta + off, 0, 0, 1, STELLA_OK};
        off += cnt;
    }
    stella_run_jobs(run_range_thread, jobs, sizeof jobs[0], T);
    const int64_t nf = st->nfields;
    int failed = 0;
    int rc = STELLA_OK;
    for (int t = 0; t < T; t++) {
        if (jobs[t].rc != STELLA_OK) rc = jobs[t].rc;
        failed |= jobs[t].rc != STELLA_OK || !jobs[t].finite;
    }
    if (failed) { /* the whole step is undone: every range's touched records back as they were */
        for (int t = 0; t < T; t++)
            for (int64_t j = 0; j < jobs[t].count; j++)
                memcpy(st->mem + (int64_t)jobs[t].out[j] * nf, jobs[t].undo + j * nf, (size_t)nf * sizeof(float));
        return rc != STELLA_OK ? rc : STELLA_E_NONFINITE;
    }
    /* out_idx is compacted (4 B an entry); the undo records and changes stay where each
     * range wrote them (nf + 1 floats an entry: moving them was a serial copy of up to a
     * fifth of a threaded apply's time), their readers follow the segments */
    int64_t total = 0;
    uint32_t kmax = st->max_step;
    for (int t = 0; t < T; t++) {
        if ((uint32_t *)out_idx + total != jobs[t].out)
            memmove(out_idx + total, jobs[t].out, (size_t)jobs[t].count * 4);
        st->seg_off[t] = jobs[t].delta - st->delta;
        st->seg_len[t] = jobs[t].count;
        total += jobs[t].count;
        kmax = jobs[t].kmax > kmax ? jobs[t].kmax : kmax;
    }
    st->nseg = T;
    st->max_step = kmax;
    st->undo_len = total;
    return total;
}

#if STELLA_ISA_BASE
STELLA_ISA_VARIANTS(stella_optim_apply);

int64_t stella_optim_apply(stella_optim *st, const stella_push *pushes, int32_t npush, float scale,
                           const float *count_scale, const stella_optim_cfg *cfg, int32_t *out_idx,
                           int64_t out_cap, int32_t nthreads) {
    return STELLA_ISA_PICK(stella_optim_apply)(st, pushes, npush, scale, count_scale, cfg, out_idx, out_cap,
                                               nthreads);
}
#endif

/* ----------------------------------------------------------------- gather */

#if !STELLA_ISA_VARIANT /* not dispatched: the gather is bound by memory latency */

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
    const int64_t s = st->nfields, numel = st->numel, n = job->n;
    const int pd = TUNE_PREFETCH;
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
    for (int t = 0; t < T; t++) {
        int64_t lo = n * t / T, hi = n * (t + 1) / T;
        jobs[t] = (gather_job){st, idx + lo, hi - lo, out + lo, STELLA_OK};
    }
    stella_run_jobs(run_gather_thread, jobs, sizeof jobs[0], T);
    int rc = STELLA_OK;
    for (int t = 0; t < T; t++)
        if (jobs[t].rc != STELLA_OK) rc = jobs[t].rc;
    return rc;
}
#endif
