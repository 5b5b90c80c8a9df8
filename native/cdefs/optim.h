/* The lazy optimizer kernel (optim_state.c, merge.c, update.c, union.c): merged
 * apply of sparse pushes with the lazy SGD / Adam / AdamW optimizers, gather, field
 * copies (snapshot, checkpoints) and k-way union of sorted index lists.
 * Semantics: docs/optimizer.md; executable reference: server/stella_ps/optim_ref.py.
 * Push values use the STELLA_VAL_* dtypes of cdefs/core.h. */
#define STELLA_OPT_SGD 0
#define STELLA_OPT_ADAM 1
#define STELLA_OPT_ADAMW 2

/* Fields of a tensor state; SGD has PARAM and MOMENTUM_BUF (= 1), Adam/AdamW all four. */
#define STELLA_FIELD_PARAM 0
#define STELLA_FIELD_MOMENTUM_BUF 1
#define STELLA_FIELD_EXP_AVG 1
#define STELLA_FIELD_EXP_AVG_SQ 2
#define STELLA_FIELD_STEP 3

typedef struct stella_optim stella_optim;

/* One worker's push: idx NULL means dense (n == numel); val holds n values of dtype. */
typedef struct {
    const int32_t *idx;
    const void *val;
    int64_t n;
    int32_t dtype;
} stella_push;

/* Hyper-parameters, rounded to float32 by the caller exactly as the reference rounds
 * them; lr_d/beta1_d/beta2_d stay float64 for the bias-correction factors. */
typedef struct {
    int32_t kind;
    int32_t nesterov;
    int32_t has_momentum;
    int32_t has_weight_decay;
    float lr;
    float weight_decay;
    float momentum;
    float one_minus_dampening;
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float eps;
    float decay_factor;
    double lr_d;
    double beta1_d;
    double beta2_d;
} stella_optim_cfg;

/* NULL when out of memory or for a bad kind / size. */
stella_optim *stella_optim_new(int32_t kind, int64_t numel, int32_t hugepages);
void stella_optim_free(stella_optim *st);
int64_t stella_optim_bytes(const stella_optim *st);
int stella_optim_set_field(stella_optim *st, int32_t field, const void *src, int64_t n);
int stella_optim_get_field(const stella_optim *st, int32_t field, void *dst, int64_t n);
/* Records (every field, interleaved) of coordinates start..start+n-1, copied out or in. */
int stella_optim_get_records(const stella_optim *st, void *dst, int64_t start, int64_t n);
int stella_optim_set_records(stella_optim *st, const void *src, int64_t start, int64_t n);
/* Returns the number of touched coordinates written to out_idx (sorted), or STELLA_E_*;
 * STELLA_E_NONFINITE when a value it would write is NaN or +-Inf: then nothing changed.
 * A coordinate's sum (in push order) is multiplied by scale, or, when count_scale is not
 * NULL (npush + 1 floats, npush <= 65535), by count_scale[n], n the pushes that carried it. */
int64_t stella_optim_apply(stella_optim *st, const stella_push *pushes, int32_t npush, float scale,
                           const float *count_scale, const stella_optim_cfg *cfg, int32_t *out_idx,
                           int64_t out_cap, int32_t nthreads);
/* What the last successful apply did to the parameters at its out_idx (n: its count):
 * out[j] = p_now - p_before, float32, as the apply wrote it (a copy, no gather). */
int stella_optim_last_changes(const stella_optim *st, int64_t n, float *out);
/* Undo the last successful apply (idx: its out_idx, n: its count); then it changed nothing. */
int stella_optim_rollback(stella_optim *st, const int32_t *idx, int64_t n);
int stella_optim_gather(const stella_optim *st, const int32_t *idx, int64_t n, float *out,
                        int32_t nthreads);
/* dst[idx[j]] += src[j] (idx in [0, numel), checked first: nothing changes on a bad one). */
int stella_scatter_add(float *dst, int64_t numel, const int32_t *idx, const float *src, int64_t n);
/* dst[lists[l].idx[j]] += lists[l].val[j] for every list l < nlists in turn (each sorted, unique, in
 * [0, numel), all checked first: nothing changes on a bad one), so a coordinate gets its adds
 * in list order, as one stella_scatter_add per list would give them; done tile by tile over
 * dst (one sweep of its lines, not one random access per entry). */
int stella_scatter_add_lists(float *dst, int64_t numel, const stella_sparse_list *lists, int32_t nlists);
int64_t stella_union_indices(const int32_t *const *lists, const int64_t *lens, int32_t k,
                             int32_t *out, int64_t out_cap);
