"""The one error a Megatron checkpoint that cannot be read raises."""

from __future__ import annotations

from mlm_jax.errors import ConfigError


class MegatronCheckpointError(ConfigError):
    """A Megatron-LM checkpoint that cannot be read; the message names the file and the key
    (a usage error: the CLI prints one `error:` line and exits 2)."""
