"""Hand-written shard_map pieces that the compiler cannot derive: context-parallel attention
(ring p2p, all-gather, all-to-all over the `context` mesh axis) and its causal load balance."""

from mlm_jax.parallel.chunks import local_order, permute_seq, seq_order, unpermute_seq
from mlm_jax.parallel.context import (COMM_TYPES, context_attention, context_size,
                                      use_comm_type)

__all__ = ["COMM_TYPES", "context_attention", "context_size", "local_order", "permute_seq",
           "seq_order", "unpermute_seq", "use_comm_type"]
