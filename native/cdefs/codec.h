/* codec.c: wire coding of sorted sparse indices (raw32, varint, u16 chunks, Rice,
 * block16) and of values (f16, bf16), and the finiteness check of value frames. */
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
