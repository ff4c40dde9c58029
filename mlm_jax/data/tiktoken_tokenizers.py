"""Megatron's tiktoken-based tokenizer types, read from LOCAL files with the `tiktoken` library.

* TikTokenizer (Megatron-Core's `TikTokenTokenizer`): `--tokenizer-model` is a JSON list of
  {"rank": i, "token_bytes": base64, "token_str": ...} (rank i at index i, the first 256 the
  single bytes). Ids 0..N-1 are special tokens (`--tiktoken-num-special-tokens` N, default
  1000): the named ones (`--tokenizer-special-tokens`, default `<unk> <s> </s> <mask> <pad>
  <cls> <sep>`) then `<SPECIAL_i>` fillers; rank r is id N + r. EOD is `</s>`. Split pattern
  `--tiktoken-pattern` v1 | v2 (default v2). The vocab is N + the ranks, at most 2^17 (Megatron
  cuts the ranks at its default --vocab-size 131072).
* Llama3Tokenizer (Megatron's former `_Llama3Tokenizer`, over Meta's llama3 `Tokenizer`):
  `--tokenizer-model` is Llama-3's tokenizer.model, a tiktoken BPE file (one "base64 rank" per
  line); 256 special tokens follow the ranks (`<|begin_of_text|>`, `<|end_of_text|>`, ...,
  `<|eot_id|>`, reserved); text is encoded without bos/eos, special-token text recognised;
  EOD is `<|end_of_text|>`.

Both encode special-token text found in the input as that special token (Megatron's
`allowed_special="all"`).
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import Iterable, Sequence

from mlm_jax.data.tokenizer_files import TokenizerError, need_file, read_json

PATTERN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_V2 = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
              r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
              r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
MEGATRON_SPECIAL = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_MAX_VOCAB = 2 ** 17

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_SPECIAL = 256
LLAMA3_SPECIAL = (["<|begin_of_text|>", "<|end_of_text|>"]
                  + [f"<|reserved_special_token_{i}|>" for i in range(4)]
                  + ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
                  + [f"<|reserved_special_token_{i}|>" for i in range(5, LLAMA3_NUM_SPECIAL - 5)])


def _tiktoken():
    try:
        import tiktoken
    except ImportError:
        raise TokenizerError("TikTokenizer and Llama3Tokenizer need the tiktoken package "
                             "(pip install 'tiktoken>=0.14')") from None
    return tiktoken


class _TikTokenBase:
    """Encoding through a `tiktoken.Encoding` in `self._enc`."""

    def tokenize(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def files(self) -> list[str]:
        return [self.model_file]


def _megatron_ranks(path: str, max_ranks: int, offset: int) -> dict[bytes, int]:
    """Megatron's TikTokenizer JSON vocab -> tiktoken mergeable ranks shifted by `offset`."""
    vocab = read_json(path, "--tokenizer-model")
    where = f"--tokenizer-model {path}"
    if not isinstance(vocab, list):
        raise TokenizerError(f"{where}: expected a JSON list of {{rank, token_bytes, token_str}} "
                             "(Megatron's TikTokenizer vocab)")
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(vocab[:max_ranks]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise TokenizerError(f"{where}: entry {i} must be {{\"rank\": {i}, \"token_bytes\": ..., "
                                 f"\"token_str\": ...}}, got {str(entry)[:80]}")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise TokenizerError(f"{where}: entry {i}'s token_bytes is not base64") from None
        if i < 256 and token != bytes([i]):
            raise TokenizerError(f"{where}: entry {i} must be the single byte {i} (the first 256 ranks are the bytes)")
        if token in ranks:
            raise TokenizerError(f"{where}: entry {i} repeats the token of entry {ranks[token] - offset}")
        ranks[token] = i + offset
    if len(ranks) < 256:
        raise TokenizerError(f"{where}: {len(ranks)} ranks; a byte-level vocab needs at least the 256 bytes")
    return ranks


class TikTokenizer(_TikTokenBase):
    """Megatron-Core's TikTokenizer over a local JSON vocab (see the module docstring)."""

    tokenizer_type = "TikTokenizer"

    def __init__(self, model_file: str, pattern: str = "v2", num_special_tokens: int = 1000,
                 special_tokens: Sequence[str] | None = None):
        self.model_file = need_file(model_file, "--tokenizer-model", self.tokenizer_type)
        if pattern not in ("v1", "v2"):
            raise TokenizerError(f"--tiktoken-pattern {pattern!r}: choose one of v1, v2")
        special = list(special_tokens) if special_tokens else list(MEGATRON_SPECIAL)
        missing = [t for t in MEGATRON_SPECIAL if t not in special]
        if missing or len(set(special)) != len(special):
            raise TokenizerError(f"--tokenizer-special-tokens must be unique and include {' '.join(MEGATRON_SPECIAL)}"
                                 + (f" (missing {' '.join(missing)})" if missing else " (a token repeats)"))
        if not len(special) <= num_special_tokens < TIKTOKEN_MAX_VOCAB:
            raise TokenizerError(f"--tiktoken-num-special-tokens {num_special_tokens} must hold the {len(special)} "
                                 f"special tokens and stay below {TIKTOKEN_MAX_VOCAB}")
        self.pattern, self.num_special_tokens, self.named_special = pattern, int(num_special_tokens), tuple(special)
        self.special_tokens = special + [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        ranks = _megatron_ranks(self.model_file, TIKTOKEN_MAX_VOCAB - num_special_tokens, num_special_tokens)
        self._enc = _tiktoken().Encoding(
            name=os.path.basename(self.model_file), pat_str=PATTERN_V1 if pattern == "v1" else PATTERN_V2,
            mergeable_ranks=ranks, special_tokens={t: i for i, t in enumerate(self.special_tokens)})
        self.vocab_size = num_special_tokens + len(ranks)
        self.bos, self.eod = special.index("<s>"), special.index("</s>")

    def options(self) -> dict:
        """The flags besides the file that rebuild this tokenizer (for checkpoints)."""
        return {"tiktoken_pattern": self.pattern, "tiktoken_num_special_tokens": self.num_special_tokens,
                "tokenizer_special_tokens": list(self.named_special)}


def _bpe_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken BPE file (Llama-3's tokenizer.model): one "base64-token rank" per line."""
    ranks: dict[bytes, int] = {}
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise TokenizerError(f"--tokenizer-model {path}: cannot read ({e.strerror or e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (binascii.Error, ValueError):
            raise TokenizerError(f"--tokenizer-model {path} line {n}: expected \"<base64 token> <rank>\" "
                                 "(a tiktoken BPE file such as Llama-3's tokenizer.model)") from None
    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) < 256:
        raise TokenizerError(f"--tokenizer-model {path}: the ranks must be 0..N-1, each once, with N >= 256")
    return ranks


class Llama3Tokenizer(_TikTokenBase):
    """Llama-3's tiktoken tokenizer.model (see the module docstring)."""

    tokenizer_type = "Llama3Tokenizer"

    def __init__(self, model_file: str):
        self.model_file = need_file(model_file, "--tokenizer-model", self.tokenizer_type)
        with open(self.model_file, "rb") as f:
            head = f.read(1)
        if head in (b"{", b"["):
            raise TokenizerError(f"--tokenizer-model {model_file}: a JSON file; Llama3Tokenizer reads Llama-3's "
                                 "tiktoken tokenizer.model (for tokenizer.json use HuggingFaceTokenizer)")
        ranks = _bpe_ranks(self.model_file)
        base = len(ranks)
        special = {t: base + i for i, t in enumerate(LLAMA3_SPECIAL)}
        self._enc = _tiktoken().Encoding(name=os.path.basename(self.model_file), pat_str=LLAMA3_PATTERN,
                                         mergeable_ranks=ranks, special_tokens=special)
        self.vocab_size = base + LLAMA3_NUM_SPECIAL
        self.bos, self.eod = special["<|begin_of_text|>"], special["<|end_of_text|>"]

    def options(self) -> dict:
        return {}
