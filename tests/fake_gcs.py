"""An offline stand-in for Google Cloud Storage, for the tests of remote workdirs.

`gs://BUCKET/PATH` is served from `<root>/BUCKET/PATH`, where root is a directory the test
chose (`$FAKE_GCS_ROOT`):

- etils.epath reaches gs:// through fsspec's "gcs" protocol (without TensorFlow, which is not
  installed here and is turned off below); `install` registers a file system under that
  protocol that maps the bucket to `root`, so every file the project writes through the path
  library lands there, and nowhere else.
- Orbax writes a gs:// checkpoint's arrays through TensorStore's own gcs driver, not through
  epath; `install` points Orbax's kvstore for gs:// at TensorStore's file driver on the same
  `root`, and answers "no hierarchical namespace" for the bucket (a call to the GCS API
  otherwise). Everything else of Orbax runs its gs:// code: the checkpoint is committed with
  commit_success.txt in place, not by a rename.

What passes through the real network client libraries (gcsfs, TensorStore's gcs driver) is not
tested here; what is tested is that every read and write of a run goes through them, i.e. to the
bucket, and that nothing lands in a local directory named after the URI.

Run a module with it: `python tests/fake_gcs.py fairmoe_jax.main --workdir=gs://bucket/run ...`.
"""

from __future__ import annotations

import os
import runpy
import sys

os.environ["EPATH_USE_TF"] = "false"  # epath would take gs:// to TensorFlow's gfile if installed.

ROOT_VARIABLE = "FAKE_GCS_ROOT"


def install(root: str) -> None:
  """Serves gs:// from `root` for this process (epath, tensorboardX through it, and Orbax)."""
  import fsspec
  from fsspec.implementations.dirfs import DirFileSystem
  from fsspec.implementations.local import LocalFileSystem

  class FakeGCSFileSystem(DirFileSystem):
    protocol = ("gs", "gcs")

    def __init__(self, *args, **kwargs):
      # An object store needs no parent "directories" before a write: auto_mkdir.
      super().__init__(path=root, fs=LocalFileSystem(auto_mkdir=True))

  fsspec.register_implementation("gcs", FakeGCSFileSystem, clobber=True)
  fsspec.register_implementation("gs", FakeGCSFileSystem, clobber=True)

  from orbax.checkpoint._src.path import gcs_utils

  def file_kvstore(path: str) -> dict:
    bucket, key = gcs_utils.parse_gcs_path(path, add_trailing_slash=False)
    return {"driver": "file", "path": os.path.join(root, bucket, key)}

  gcs_utils.get_kvstore_for_gcs = file_kvstore
  gcs_utils.is_hierarchical_namespace_enabled = lambda path: False


if __name__ == "__main__":
  install(os.environ[ROOT_VARIABLE])
  module, arguments = sys.argv[1], sys.argv[2:]
  sys.argv = [module, *arguments]
  runpy.run_module(module, run_name="__main__", alter_sys=True)
