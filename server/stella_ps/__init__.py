"""stella-ps: the parameter-server daemon."""
