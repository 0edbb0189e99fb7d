"""Preflight: compile a run for a TPU slice or GPU node without the hardware, and read off
what it needs (memory per device, FLOPs, collectives, a step-time bound, device-hours).

Needs libtpu and the CUDA plugin matching jax, kept off other processes' import path
(`compilers`): python -m trainkit.preflight.compilers
"""

__all__: list[str] = []  # Modules only: each caller imports the one it uses.
