/* codec.c: wire coding of sorted sparse indices (raw32, varint, u16 chunks, Rice) and of values (f16, bf16). */
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
