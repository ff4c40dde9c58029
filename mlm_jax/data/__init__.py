"""Data: Megatron-compatible tokenizers, indexed datasets, GPT sampling, blending, batches.

What a training script needs:

    datasets = build_datasets(cfg.data, seq_length, seed, megatron_num_samples(...), vocab_size)
    loader = BatchLoader(datasets.train, gbs, sharding, shape, partial(make_batch, eod=...))
"""

from mlm_jax.data.batch import make_batch
from mlm_jax.data.builder import Datasets, build_datasets, megatron_num_samples, parse_blend
from mlm_jax.data.stream import train_batches
from mlm_jax.data.gpt_dataset import DatasetError
from mlm_jax.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    optimal_dtype,
    write_indexed_dataset,
)
from mlm_jax.data.tokenizers import (TOKENIZER_TYPES, TokenizerError, build_tokenizer, make_tokenizer,
                                     train_sentencepiece)
from mlm_jax.data.vocab_check import VocabularyError



def __getattr__(name):
    # The loader imports jax; keep `import mlm_jax.data` light for preprocessing workers.
    if name == "BatchLoader":
        from mlm_jax.data.loader import BatchLoader

        return BatchLoader
    raise AttributeError(f"module 'mlm_jax.data' has no attribute {name!r}")


__all__ = [
    "BatchLoader",
    "DatasetError",
    "Datasets",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "TOKENIZER_TYPES",
    "TokenizerError",
    "VocabularyError",
    "build_datasets",
    "build_tokenizer",
    "make_batch",
    "make_tokenizer",
    "megatron_num_samples",
    "optimal_dtype",
    "parse_blend",
    "train_batches",
    "train_sentencepiece",
    "write_indexed_dataset",
]
