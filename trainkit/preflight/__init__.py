"""Preflight: compile a run for a TPU slice or GPU node without the hardware, and read off
what it needs (memory per device, FLOPs, collectives, a step-time bound, device-hours).

Needs the `preflight` extra (libtpu and the CUDA plugin matching jax): pip install -e ".[preflight]".
"""

__all__: list[str] = []  # Modules only: each caller imports the one it uses.
