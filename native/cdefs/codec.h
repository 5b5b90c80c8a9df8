/* codec.c: wire coding of sorted sparse indices (raw32, varint, u16 chunks, Rice,
 * block16) and of values (f16, bf16, q4, q2), and the finiteness check of value frames. */
#define STELLA_IDX_RAW32 0
#define STELLA_IDX_VARINT 1
#define STELLA_IDX_U16CHUNK 2
#define STELLA_IDX_RICE 3
#define STELLA_IDX_BLOCK16 4

int64_t stella_idx_encode(const int32_t *idx, int64_t count, int64_t numel, int32_t coding,
                          uint8_t *out, int64_t cap);
int64_t stella_idx_decode(const uint8_t *buf, int64_t len, int64_t count, int64_t numel,
                          int32_t coding, int32_t *out);
int64_t stella_idx_bound(int64_t count, int64_t numel, int32_t coding);
int32_t stella_rice_param(const int32_t *idx, int64_t count);
void stella_f32_to_f16(const float *in, int64_t n, uint16_t *out);
void stella_f16_to_f32(const uint16_t *in, int64_t n, float *out);
void stella_f32_to_bf16(const float *in, int64_t n, uint16_t *out);
void stella_bf16_to_f32(const uint16_t *in, int64_t n, float *out);
/* STELLA_OK when all n values (of STELLA_VAL_* dtype) are finite, else STELLA_E_NONFINITE. */
int stella_values_check(const void *val, int64_t n, int32_t dtype);
/* The sum of the squares of n values (STELLA_VAL_F32/F16/BF16), in float64, into *out. */
int stella_values_sumsq(const void *val, int64_t n, int32_t dtype, double *out);

/* q4/q2 (STELLA_VAL_Q4/Q2): values in chunks of STELLA_QCHUNK, each with a float32
 * scale (its largest magnitude) and 4-/2-bit level codes; codec.c has the format. */
#define STELLA_QCHUNK 64
/* Bytes of a q frame of n values, or STELLA_E_ARG for a bad dtype or n. */
int64_t stella_q_size(int64_t n, int32_t dtype);
/* Quantise n float32 values into out (cap >= stella_q_size bytes; NULL: no frame) and
 * write the values the frame decodes to into deq (NULL: none; may be in itself).
 * Returns the frame's size, STELLA_E_NONFINITE for a NaN/Inf input, STELLA_E_ARG. */
int64_t stella_q_encode(const float *in, int64_t n, int32_t dtype, uint8_t *out, int64_t cap,
                        float *deq);
/* A q frame of len bytes -> n float32 values. Returns n, STELLA_E_CORRUPT when len is
 * not stella_q_size(n) or a pad bit is set, STELLA_E_SCALE for a bad scale. */
int64_t stella_q_decode(const uint8_t *buf, int64_t len, int64_t n, int32_t dtype, float *out);
