"""Reading tfds datasets prepared beforehand (never downloaded), without TensorFlow if possible."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from trainkit.errors import UserError, import_extra


def tfds_builder(name: str, data_dir: str | os.PathLike, extra: str, split: str = "") -> Any:
  """The tfds builder of `name` prepared in `data_dir`, with `split` if given, or a UserError
  (`extra`: the package extra that installs tensorflow_datasets)."""
  tfds = import_extra("tensorflow_datasets", extra, f"tfds dataset {name}")
  hint = (
      f"prepare it there first (e.g. `tfds build {name} --data_dir={data_dir} "
      "--file_format=array_record`); it is never downloaded here."
  )
  try:
    builder = tfds.builder(name, data_dir=os.fspath(data_dir))
  except Exception as e:  # pylint: disable=broad-except
    # Without TensorFlow some builders (glue, wmt) are not registered and tfds
    # looks only in data_dir, so "not found" means "not prepared".
    raise UserError(
        f"tfds dataset {name} is not prepared in {data_dir} ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}); {hint}"
    ) from e
  if not builder.is_prepared():
    raise UserError(
        f"tfds dataset {name} is not prepared in {data_dir} (looked for {builder.data_dir}); "
        f"{hint}"
    )
  if split and split not in builder.info.splits:
    raise UserError(
        f"tfds {name} in {data_dir} has no split {split!r}; available: "
        f"{', '.join(builder.info.splits)}."
    )
  return builder


def tfds_map(
    builder: Any,
    split: str,
    max_examples: int = 0,
    fn: Callable[[Mapping[str, Any]], Any] = lambda example: example,
    num_threads: int = 0,
) -> Iterator[Any]:
  """Yields `fn(example)` over the first `max_examples` (> 0) of a split (numpy values), on
  `num_threads` threads (0: in order, one at a time); array_record data needs no TensorFlow."""
  file_format = str(getattr(builder.info, "file_format", "") or "")
  if "array_record" in file_format or importlib.util.find_spec("tensorflow") is None:
    try:
      source = builder.as_data_source(split=split)
    except Exception as e:  # pylint: disable=broad-except
      raise UserError(
          f"tfds {builder.info.full_name} in {builder.data_dir} is stored as "
          f"{file_format or 'tfrecord'}, which needs TensorFlow to read; install tensorflow "
          f"or prepare it with --file_format=array_record ({type(e).__name__}: {e})."
      ) from e
    n = len(source)
    n = min(n, max_examples) if max_examples > 0 else n
    if not num_threads:
      yield from (fn(source[i]) for i in range(n))
      return
    with concurrent.futures.ThreadPoolExecutor(max_workers=num_threads) as pool:
      yield from pool.map(lambda i: fn(source[i]), range(n))
    return
  dataset = builder.as_dataset(split=split, shuffle_files=False)
  if max_examples > 0:
    dataset = dataset.take(max_examples)
  # tf.data's own numpy view (tfds.as_numpy's, for these dense features): trainkit needs no
  # tensorflow_datasets import of its own, the calling package's extra brought it.
  for example in dataset.as_numpy_iterator():
    yield fn(example)
