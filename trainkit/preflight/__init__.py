"""Preflight: compile a run for a TPU slice or GPU node without the hardware, and read off
what it needs (memory per device, FLOPs, collectives, a step-time bound, device-hours).

Needs the `preflight` extra (libtpu and the CUDA plugin matching jax): pip install -e ".[preflight]".
"""

from trainkit.preflight.compile import Program, compile_run, preflight
from trainkit.preflight.targets import TARGETS, Target, get_target

__all__ = ["Program", "TARGETS", "Target", "compile_run", "get_target", "preflight"]
