"""The Causal Transformer's front ends of the runner: its results table and the references
that learnt nothing."""
