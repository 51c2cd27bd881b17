"""Device kernels (Triton) and their exact torch paths: the fused apply, and codec v2's decode where the base
lives (its streams and its pass over the base). Above :mod:`engine_ext.format`, whose byte layouts these
kernels read; the format never imports them. Imported as engine_ext.triton_kernels."""
