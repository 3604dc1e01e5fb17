"""Tensor parallelism: collectives as graph nodes, local modules, and the shard layouts they need."""
