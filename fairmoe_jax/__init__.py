"""FairSMoE in JAX/Flax NNX: multi-attribute fair image classification with sparse MoE."""
