"""Training data: the built-in synthetic dataset and micro-batch iteration."""

from bebop_megatron.data.synthetic import MarkovDataset, Batch, batch_iterator

__all__ = ["MarkovDataset", "Batch", "batch_iterator"]
