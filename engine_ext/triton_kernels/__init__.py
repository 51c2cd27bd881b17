"""Fused apply kernels (Triton) and their exact torch path. Imported as engine_ext.triton_kernels."""
