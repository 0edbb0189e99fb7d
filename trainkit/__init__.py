"""Training kit shared by fairmoe_jax and causal_attn_jax: mesh, optimiser, checkpoints, loop, logging."""
