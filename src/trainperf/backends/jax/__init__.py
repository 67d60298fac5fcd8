"""The JAX backend (flax linen models, optax SGD, one ``shard_map`` training step): its
environment and launch (``backend.py``), models, heads, step and worker."""
