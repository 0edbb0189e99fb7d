"""`benchmarks/grouped_gemm_flops.py`: the rows tokamax's grouped-GEMM tiles run, by hand."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, os.path.join(str(REPO_ROOT), "benchmarks"))

import grouped_gemm_flops as ggf  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def test_forward_tiles_fixed_and_aligned():
  # Rows 0-16 | (empty) | 17-47 | 48-71, 32-row tiles. Fixed tiles [0, 32), [32, 64), [64, 96):
  # the first group runs tile 0, the third tiles 0 and 1, the last tiles 1 and 2 (5 tiles). Aligned
  # to 8: tiles from 0, 16 and 48, one each (3 tiles). The empty group runs none.
  sizes = [17, 0, 31, 24]
  assert ggf.forward_rows(sizes, tile=32) == 5 * 32
  assert ggf.forward_rows(sizes, tile=32, align=8) == 3 * 32


def test_weight_gradient_blocks():
  # Rows 0-99 | (empty, at row 100) | 100-299 | 300-311 in 128-row blocks: block 0; block 0 again
  # (an empty group at an unaligned offset); blocks 0, 1, 2; block 2: 6 blocks.
  assert ggf.weight_gradient_rows([100, 0, 200, 12]) == 6 * 128


def test_executed_over_dense():
  # Two groups of 64 rows: the forward and input gradient run exactly 128 rows, the weight
  # gradient one 128-row block per group (256 rows): (2 * 128 + 256) / (3 * 128).
  assert ggf.executed_vs_dense([64, 64]) == pytest.approx(4 / 3)
