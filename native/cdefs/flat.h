/* flat.c: a model's parameters, each its own tensor wherever the user's framework put
 * it, read and written as one flat float32 vector (stella.flat.FlatParams). A table of
 * parts, one per tensor in flat order, says where each tensor is and how it is stored. */

/* One tensor of the flat vector: coordinates [start, start + numel). */
typedef struct {
    void *data;    /* its first element (contiguous); NULL: a tensor of zeros (a missing gradient), read-only */
    int64_t start; /* its first flat coordinate: the previous part's start + numel (0 for the first) */
    int64_t numel;
    int32_t dtype; /* STELLA_VAL_F32, STELLA_VAL_F16 or STELLA_VAL_BF16 */
} stella_flat_part;

/* Dense ranges: coordinates [lo, hi) of the flat vector; out, anchor and val hold hi - lo
 * floats, the range's first coordinate at [0]. Every call returns STELLA_OK or
 * STELLA_E_ARG (a part table that does not tile [0, its end) in order, a bad dtype, NULL
 * data where it is written, a range outside it). */

/* out = w[lo, hi), exactly (f16 and bf16 widen without rounding). */
int stella_flat_gather(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi, float *out);
/* out = anchor - w[lo, hi) in float32 (out may be anchor). */
int stella_flat_residual(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi,
                         const float *anchor, float *out);
/* w[lo, hi) += val: val rounded to the part's dtype, then added in float32 and rounded
 * again (torch's w.add_(val.to(w.dtype))). */
int stella_flat_add_range(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi, const float *val);
/* w[lo, hi) = val rounded to the part's dtype (to nearest even; beyond f16's range: inf). */
int stella_flat_set_range(const stella_flat_part *parts, int32_t nparts, int64_t lo, int64_t hi, const float *val);

/* Sparse: w[base + idx[j]] op= val[j] for j < n, idx strictly increasing in
 * [0, end - base), rounded as the dense forms round (add: torch's
 * w.index_add_(0, idx, val.to(w.dtype)); set: index_copy_). Returns STELLA_OK,
 * STELLA_E_RANGE / STELLA_E_ORDER for bad indices (nothing written), STELLA_E_ARG. */
int stella_flat_add_at(const stella_flat_part *parts, int32_t nparts, int64_t base, const int32_t *idx,
                       const float *val, int64_t n);
int stella_flat_set_at(const stella_flat_part *parts, int32_t nparts, int64_t base, const int32_t *idx,
                       const float *val, int64_t n);
/* Update mode's install at the server's coordinates (the merge rule w <- w + (a_new - a) + c,
 * docs/optimizer.md): the anchor (the replica of the server's model, float32; anchor[i] is
 * coordinate base + i, anchor_n of them) takes val[j] at idx[j], added (set == 0: a
 * broadcast step) or in place of its value (set != 0: exact values), and the weight moves
 * by the anchor's change in float32, a_new - a_old, rounded as stella_flat_add_at rounds.
 * One walk: torch's before = a[idx]; a.index_add_(0, idx, val) (or index_copy_);
 * w.index_add_(0, idx, (a[idx] - before).to(w.dtype)). idx < anchor_n as well. */
int stella_flat_merge_at(const stella_flat_part *parts, int32_t nparts, int64_t base, const int32_t *idx,
                         const float *val, int64_t n, float *anchor, int64_t anchor_n, int32_t set);
