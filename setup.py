"""Installable package for fairmoe_jax, causal_attn_jax and their shared training kit."""

from setuptools import find_packages, setup

setup(
    name="fairmoe-jax",
    version="0.1.0",
    description=(
        "JAX/Flax NNX reference implementations of FairSMoE (multi-attribute fair "
        "sparse mixture-of-experts) and the Causal Transformer."
    ),
    python_requires=">=3.11",
    packages=find_packages(include=["fairmoe_jax*", "causal_attn_jax*", "trainkit*"]),
    install_requires=[
        "jax>=0.7",  # jax.set_mesh
        "flax>=0.12.4",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "tensorflow-datasets>=4.9",
        "grain>=0.2.10",
        "ml-collections>=1.0",
        "chex>=0.1.89",
        "absl-py>=2.0",
        "numpy>=1.26",
        "pillow>=10",
        "safetensors>=0.4",
        "matplotlib>=3.7",
        "sentencepiece>=0.2",
        "sacrebleu>=2.3",
        "sacremoses>=0.1",  # Detokenising Moses-tokenised references before BLEU.
        "tensorboardX>=2.6",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.5", "fairlearn>=0.10", "scipy>=1.10"],
        "dev": ["pyink>=24"],
    },
)
