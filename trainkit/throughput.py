"""Model FLOPs (XLA's cost analysis of the compiled step, per device) and utilisation (MFU)."""

from __future__ import annotations

from typing import Any

# Dense bf16 peak FLOP/s per device (vendor data sheets, without sparsity).
PEAK_FLOPS_BY_KIND = {
    "NVIDIA H100": 989e12,  # SXM; the PCIe card is lower: set the peak in the config.
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
    "TPU v3": 61.5e12,  # Per TensorCore, JAX's device on a v3 (123 TFLOP/s per 2-core chip).
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p
    "TPU v6 lite": 918e12,  # Trillium
}


def peak_flops_per_device(device: Any, override: float = 0.0) -> float | None:
  """Peak FLOP/s of `device`: the override if > 0, else the table entry whose name starts
  its `device_kind` (longest match), else None (e.g. CPU: no MFU is reported)."""
  if override > 0:
    return float(override)
  kind = getattr(device, "device_kind", "")
  matches = [k for k in PEAK_FLOPS_BY_KIND if kind.startswith(k)]
  return PEAK_FLOPS_BY_KIND[max(matches, key=len)] if matches else None


def compile_ahead(jitted: Any, *args: Any) -> Any | None:
  """`jitted` compiled for `args` (the call that follows reuses it), or None where that fails."""
  try:
    return jitted.lower(*args).compile()
  except Exception:  # pylint: disable=broad-except  # Best effort: the call reports errors.
    return None


def flops_of(compiled: Any | None) -> float | None:
  """FLOPs per call of a compiled program from XLA's cost analysis, or None."""
  from trainkit.preflight.analysis import cost  # pylint: disable=import-outside-toplevel  # jax

  flops = (cost(compiled) or {}).get("flops") if compiled is not None else None
  return float(flops) if flops and flops > 0 else None


def throughput_scalars(
    steps_per_second: float,
    *,
    examples_per_step: int,
    tokens_per_example: int = 0,
    flops_per_step: float | None = None,
    peak_flops: float | None = None,
) -> dict[str, float]:
  """examples/s, tokens/s and MFU (`flops_per_step` is per device) for a measured step rate."""
  scalars = {
      "steps_per_second": steps_per_second,
      "examples_per_second": steps_per_second * examples_per_step,
  }
  if tokens_per_example:
    scalars["tokens_per_second"] = scalars["examples_per_second"] * tokens_per_example
  if flops_per_step:
    scalars["model_tflops_per_second_per_device"] = flops_per_step * steps_per_second / 1e12
    if peak_flops:
      scalars["mfu"] = flops_per_step * steps_per_second / peak_flops
  return scalars
