/* core.c: ABI version and the order/range check of sparse index arrays. */
int stella_abi_version(void);
int64_t stella_check_sparse(const int32_t *idx, int64_t n, int64_t numel);
