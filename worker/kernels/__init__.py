"""GPU kernels the worker installs into exllamav2 (Triton paged attention instead of flash-attn)."""
