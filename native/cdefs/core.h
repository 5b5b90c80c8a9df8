/* core.c: the ABI version the Python wrappers assert at import. */
int stella_abi_version(void);
