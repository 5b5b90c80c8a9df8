/* core.c: ABI version and input validation of sparse pushes. */
int stella_abi_version(void);
int64_t stella_check_sparse(const int32_t *idx, int64_t n, int64_t numel);
int64_t stella_first_nonfinite_f32(const float *val, int64_t n);
