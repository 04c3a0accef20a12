"""Packed documents trained with ``segment_ids`` and ``normalization="sequence_mean"`` in JAX and
torch: full batch, K micro-batches and D replicas give the same step; the naive per-micro-batch
mean does not (issue: packed-documents demo). See ``demo.py``."""
