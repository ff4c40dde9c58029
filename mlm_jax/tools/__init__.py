"""Command-line tools: `python -m mlm_jax.tools.checkpoint import-hf | export-hf`."""
