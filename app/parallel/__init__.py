"""Tensor parallelism: the group a rank belongs to, and how a model is split across it."""
