"""Parallelism applied to a plain model from outside (the model package never imports `torch.distributed`)."""

from flashnext.parallel.owner_embedding import OwnerRoutedEmbedding, row_ranges, swap_ngram_embeddings

__all__ = ["OwnerRoutedEmbedding", "row_ranges", "swap_ngram_embeddings"]
