"""Triton kernels (no launch logic here: see `megatron_overlap.ops`)."""
