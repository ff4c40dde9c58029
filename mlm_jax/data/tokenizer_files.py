"""What every tokenizer module shares: its error, and reading the files a tokenizer is built from
with errors that name the flag and the file (mlm_jax/data/tokenizers.py, tiktoken_tokenizers.py)."""

from __future__ import annotations

import json
import os

from mlm_jax.errors import UsageError


class TokenizerError(UsageError):
    """A tokenizer that cannot be built from the flags given, or text it cannot encode; the
    message names the flag, the file (and line) or the text."""


class TokenizerFileNotFound(TokenizerError, FileNotFoundError):
    """A tokenizer file that does not exist (still a `FileNotFoundError`)."""


def need_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    """`path`, which `flag` gave for `tokenizer_type`; an error naming both when absent."""
    if not path:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise TokenizerFileNotFound(f"{flag} {path}: no such file (needed by --tokenizer-type {tokenizer_type})")
    return path


def read_json(path: str, what: str):
    """A JSON file's value; TokenizerError naming the file and line when it is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{what} {path}: not UTF-8 text (byte {e.start}); expected a JSON file") from None
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{what} {path}: not valid JSON at line {e.lineno} column {e.colno} ({e.msg})") from None
    except OSError as e:
        raise TokenizerError(f"{what} {path}: cannot read ({e.strerror or e})") from None
