"""timm checkpoints <-> our ViT / DeiT and Swin models (names map one to one).

A timm state dict converts tensor by tensor; only layouts differ: Linear weight [out, in] <->
kernel [in, out], Conv weight [out, in, kh, kw] <-> kernel [kh, kw, in, out], LayerNorm
weight / bias <-> scale / bias; anything else is kept as is.

MoE blocks have no timm counterpart: their experts export stacked as
`<block>.mlp.experts.fc{1,2}.{weight,bias}` (PyTorch Linear layout per expert, [E, out, in] /
[E, out]) and the router as `<block>.mlp.router.*`. Loading without those names, with
`upcycle_moe=True`, starts every expert from the block's dense `mlp.fc1` / `mlp.fc2` (sparse
upcycling, Komatsuzaki et al. 2022) and keeps the router's initialisation.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fairmoe_jax.moe import SparseMoE
from trainkit.errors import UserError, import_extra
from trainkit.mesh import place

# Non-persistent buffers some timm checkpoints still hold: recomputed by our models.
_BUFFER_SUFFIXES = ("relative_position_index", "attn_mask")
# Expert parameters of a SparseMoE -> (timm sub-name, dense timm Linear it upcycles from).
_EXPERT_NAMES = {
    "w1": ("experts.fc1.weight", "fc1.weight"),
    "b1": ("experts.fc1.bias", "fc1.bias"),
    "w2": ("experts.fc2.weight", "fc2.weight"),
    "b2": ("experts.fc2.bias", "fc2.bias"),
}

Array = np.ndarray
Path = tuple[Any, ...]


def read_state_dict(path: str) -> dict[str, np.ndarray]:
  """Reads a flat {timm name: array} dict from `.safetensors` or `.npz`."""
  if not os.path.isfile(path):
    raise UserError(f"timm checkpoint {path!r} does not exist")
  if path.endswith(".safetensors"):
    load_file = import_extra("safetensors.numpy", "fairsmoe", f"reading {path!r}").load_file
    try:
      return dict(load_file(path))
    except Exception as e:  # Corrupt file or an unsupported dtype such as bfloat16.
      raise UserError(f"cannot read timm checkpoint {path!r}: {e}") from e
  if path.endswith(".npz"):
    try:
      with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}
    except Exception as e:
      raise UserError(f"cannot read timm checkpoint {path!r}: {e}") from e
  raise UserError(
      f"timm checkpoint {path!r}: unknown format; expected a .safetensors or .npz file "
      "holding a flat PyTorch state dict"
  )


def _bilinear_resize(x: np.ndarray, size: tuple[int, int]) -> np.ndarray:
  """[h, w, C] -> [*size, C], like torch's F.interpolate(bilinear, align_corners=False)."""
  if x.shape[:2] == tuple(size):
    return x
  out = jax.image.resize(
      jnp.asarray(x, jnp.float32), (*size, x.shape[-1]), method="linear", antialias=False
  )
  return np.asarray(out).astype(x.dtype)


def resample_pos_embed(pos_embed: np.ndarray, num_tokens: int) -> np.ndarray:
  """Resamples a ViT position embedding [1, 1 + g*g, D] to [1, num_tokens, D].

  The class token's is kept; the grid is resized bilinearly (timm's `resample_abs_pos_embed`
  defaults to bicubic).
  """
  old_grid = pos_embed.shape[1] - 1
  new_grid = num_tokens - 1
  g_old, g_new = math.isqrt(old_grid), math.isqrt(max(new_grid, 0))
  if g_old * g_old != old_grid or g_new * g_new != new_grid or g_new == 0:
    raise ValueError(
        f"cannot resample pos_embed of {pos_embed.shape[1]} tokens to {num_tokens}: "
        "the patch grids must be square"
    )
  prefix, grid = pos_embed[:, :1], pos_embed[0, 1:]
  grid = _bilinear_resize(grid.reshape(g_old, g_old, -1), (g_new, g_new))
  return np.concatenate([prefix, grid.reshape(1, g_new * g_new, -1)], axis=1)


def resample_relative_position_bias_table(table: np.ndarray, window: int) -> np.ndarray:
  """Resamples a Swin bias table [(2w-1)^2, heads] to window `window`, bilinearly.

  Like timm's `resize_rel_pos_bias_table_simple`; timm's Swin loader interpolates along a
  geometric progression instead, so resized tables differ slightly from timm's.
  """
  side = math.isqrt(table.shape[0])
  if side * side != table.shape[0] or side % 2 == 0:
    raise ValueError(f"relative_position_bias_table of {table.shape[0]} rows is not (2w-1)^2")
  new_side = 2 * window - 1
  return _bilinear_resize(table.reshape(side, side, -1), (new_side, new_side)).reshape(
      new_side * new_side, -1
  )


class _Rule(NamedTuple):
  """How one model parameter maps to one timm tensor."""

  name: str
  to_timm: Callable[[Array], Array] = lambda x: x
  from_timm: Callable[[Array], Array] = lambda x: x


def _linear_rule(name: str) -> _Rule:
  """A Linear kernel [in, out] (or the experts' stacked [E, in, out]) <-> weight [out, in]."""
  return _Rule(name, lambda x: x.swapaxes(-1, -2), lambda x: x.swapaxes(-1, -2))


def _generic_rule(path: Path, ndim: int) -> _Rule:
  """Rule for a parameter by its leaf name and rank (Linear, Conv, LayerNorm or raw)."""
  prefix, leaf = ".".join(map(str, path[:-1])), str(path[-1])
  join = lambda n: f"{prefix}.{n}" if prefix else n
  if leaf == "kernel" and ndim == 2:
    return _linear_rule(join("weight"))
  if leaf == "kernel" and ndim == 4:
    return _Rule(
        join("weight"), lambda x: x.transpose(3, 2, 0, 1), lambda x: x.transpose(2, 3, 1, 0)
    )
  if leaf == "kernel":
    raise NotImplementedError(f"no timm layout for a {ndim}-d kernel at {'.'.join(map(str, path))}")
  return _Rule(join("weight")) if leaf == "scale" else _Rule(join(leaf))


def _moe_paths(model: nnx.Module) -> list[Path]:
  return [tuple(p) for p, m in nnx.iter_modules(model) if isinstance(m, SparseMoE)]


def _rules(model: nnx.Module) -> list[tuple[Path, _Rule, Path | None, str | None]]:
  """(param path, rule, owning MoE path or None, expert key w1/b1/w2/b2 or None) per parameter."""
  moes = _moe_paths(model)
  out = []
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    path = tuple(path)
    moe = next((m for m in moes if path[: len(m)] == m), None)
    if moe is not None and len(path) == len(moe) + 1 and path[-1] in _EXPERT_NAMES:
      name = ".".join(map(str, moe)) + "." + _EXPERT_NAMES[path[-1]][0]
      rule = _linear_rule(name) if path[-1] in ("w1", "w2") else _Rule(name)
      out.append((path, rule, moe, path[-1]))
    else:
      out.append((path, _generic_rule(path, len(var.shape)), moe, None))
  return out


def export_timm_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
  """Our model's parameters as a timm-named state dict in PyTorch layouts (numpy; module doc).

  Arrays are C-contiguous (as safetensors requires) and keep the parameter dtype.
  """
  state = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  out = {}
  for path, rule, _, _ in _rules(model):
    out[rule.name] = np.ascontiguousarray(rule.to_timm(np.asarray(state[path][...])))
  return out


def _matches(name: str, prefixes: Sequence[str]) -> bool:
  """`name` starts with one of `prefixes` at a dot boundary ("blocks.1" skips not "blocks.10")."""
  return any(name == p or name.startswith(p.rstrip(".") + ".") for p in prefixes)


def _convert(
    rule: _Rule, value: np.ndarray, target_shape: tuple[int, ...], model: nnx.Module, path: Path
) -> np.ndarray:
  """timm tensor -> our layout and shape; resamples position tables; ValueError if impossible."""
  if rule.name.endswith("relative_position_bias_table") and value.shape != target_shape:
    attn = model
    for p in path[:-1]:
      attn = attn[p] if isinstance(p, int) else getattr(attn, p)
    if value.ndim != 2 or value.shape[1] != target_shape[1]:
      raise ValueError("different number of heads")
    value = resample_relative_position_bias_table(value, attn.window)
  elif rule.name == "pos_embed" and value.shape != target_shape:
    if value.ndim != 3 or value.shape[2] != target_shape[2]:
      raise ValueError("different width")
    value = resample_pos_embed(value, target_shape[1])
  out = rule.from_timm(value)
  if out.shape != target_shape:
    raise ValueError("shape mismatch")
  return out


def load_timm_checkpoint(
    model: nnx.Module, path: str, *, skip: Sequence[str] = ("head",), upcycle_moe: bool = True
) -> list[str]:
  """Loads a timm ViT / DeiT / Swin state dict (`.safetensors` or `.npz`) into `model` in place.

  `skip`: timm-name prefixes (at dot boundaries) of parameters to keep at their initialisation,
  e.g. "head" when fine-tuning on new classes. `upcycle_moe`: module doc; with False, MoE blocks
  need the expert entries (or a `skip` prefix such as "blocks.11.mlp"). ViT `pos_embed` of
  another grid and Swin bias tables of another window are resampled. Returns human-readable
  notes (what was kept at init, upcycled, resampled or left unused); a UserError lists every
  missing or unconvertible parameter.
  """
  ckpt = read_state_dict(path)
  rules = _rules(model)
  notes: list[str] = []
  params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  used: set[str] = set()
  missing: list[str] = []
  misshapen: list[str] = []
  skipped: list[str] = []
  new_values: dict[Path, np.ndarray] = {}
  upcycled: list[str] = []
  moe_names = {moe: ".".join(map(str, moe)) for _, _, moe, _ in rules if moe is not None}

  def take(name: str, rule: _Rule, ppath: Path, target: tuple[int, ...]) -> np.ndarray | None:
    value = ckpt[name]
    used.add(name)
    expected = tuple(rule.to_timm(np.empty(target, np.int8)).shape)
    try:
      out = _convert(rule, value, target, model, ppath)
    except ValueError:
      misshapen.append(f"{name} (expected {expected}, found {tuple(value.shape)})")
      return None
    if tuple(value.shape) != expected:
      notes.append(f"{name}: resampled from {tuple(value.shape)} to {expected}")
    return out

  # Expert weights first: whether a block is upcycled decides its router's fate.
  ordered = sorted(rules, key=lambda r: r[3] is None)
  for ppath, rule, moe, expert in ordered:
    target = tuple(params[ppath].shape)
    if _matches(rule.name, skip):
      skipped.append(rule.name)
      continue
    value = None
    if expert is not None:
      dense = f"{moe_names[moe]}.{_EXPERT_NAMES[expert][1]}"
      if rule.name in ckpt:
        value = take(rule.name, rule, ppath, target)
      elif upcycle_moe and dense in ckpt and not _matches(dense, skip):
        dense_rule = _linear_rule(dense) if expert in ("w1", "w2") else _Rule(dense)
        one = take(dense, dense_rule, ppath, target[1:])
        if one is not None:
          value = np.broadcast_to(one, target)
        if moe_names[moe] not in upcycled:
          upcycled.append(moe_names[moe])
      else:
        missing.append(rule.name + (f" (or {dense} to upcycle)" if upcycle_moe else ""))
        continue
    elif rule.name in ckpt:
      value = take(rule.name, rule, ppath, target)
    elif moe is not None and moe_names[moe] in upcycled:
      continue  # The router of an upcycled block keeps its init (noted below).
    else:
      missing.append(rule.name)
      continue
    if value is not None:
      new_values[ppath] = value

  if missing or misshapen:
    parts = []
    if missing:
      parts.append(f"missing: {', '.join(missing)}")
    if misshapen:
      parts.append(f"shape cannot be converted (timm layout): {'; '.join(misshapen)}")
    raise UserError(
        f"timm checkpoint {path!r} does not fit the model: {' | '.join(parts)} "
        "(pass skip=(...) with timm-name prefixes to keep such parameters at init)"
    )

  for ppath, value in new_values.items():
    var = params[ppath]
    old = var[...]
    new = jnp.asarray(value, dtype=old.dtype)
    sharding = getattr(old, "sharding", None)
    var[...] = place(new, sharding) if sharding is not None else new

  for name in upcycled:
    notes.append(
        f"{name}: experts upcycled from the dense {name}.fc1 / {name}.fc2; router kept at init"
    )
  if skipped:
    notes.append(f"kept at init (skip={tuple(skip)}): {', '.join(skipped)}")
  unused = [
      k
      for k in ckpt
      if k not in used and not _matches(k, skip) and not k.endswith(_BUFFER_SUFFIXES)
  ]
  if unused:
    notes.append(f"unused checkpoint tensors: {', '.join(sorted(unused))}")
  return notes
