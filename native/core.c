/* ABI version of the native module (see STELLA_ABI_VERSION in stella_native.h). */
#include "stella_native.h"

int stella_abi_version(void) { return STELLA_ABI_VERSION; }
