"""Tokenizers selected by Megatron's `--tokenizer-type`, with Megatron's vocab size and EOD rules.

Every tokenizer has `.vocab_size` (the true vocab size, before Megatron's padding),
`.eod`, `.tokenize(text) -> list[int]`, `.detokenize(ids) -> str` and `.files()` (the files a
checkpoint should copy to rebuild it). Nothing is ever downloaded: every path is local.

EOD per type, as Megatron-LM's `megatron/training/tokenizer/tokenizer.py` defines it:

* GPT2BPETokenizer: the id of `<|endoftext|>` in vocab.json.
* SentencePieceTokenizer: Megatron appends `<CLS> <SEP> <EOD> <MASK>` (and `<PAD>`, bos, eos
  pieces when the model lacks them) after the model's pieces; EOD is the id of `<EOD>`.
* GPTSentencePieceTokenizer: the model's own eos id; nothing is appended.
* Llama2Tokenizer: the model's eos id; bos is put before every text (Megatron's _Llama2Tokenizer).
* Llama3Tokenizer, TikTokenizer: `<|end_of_text|>`, `</s>` (mlm_jax/data/tiktoken_tokenizers.py).
* HuggingFaceTokenizer: the eos token named in tokenizer_config.json / special_tokens_map.json.
* NullTokenizer(V): ids are given; EOD = V and the vocab is V + 1, so EOD = vocab_size - 1.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator, Sequence

from mlm_jax.data.tokenizer_files import TokenizerError, TokenizerFileNotFound, need_file, read_json

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "Llama3Tokenizer",
    "TikTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)


def _check_gpt2_files(vocab_file: str, merge_file: str) -> None:
    """GPT-2's vocab.json (token -> id) and merges.txt (`a b` per line) checked before the
    `tokenizers` library reads them, since its errors name neither the file nor the right line."""
    vocab = read_json(vocab_file, "--vocab-file")
    if not isinstance(vocab, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in vocab.values()):
        raise TokenizerError(f"--vocab-file {vocab_file}: expected a JSON object of token -> integer id (GPT-2's vocab.json)")
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"--merge-file {merge_file}: not UTF-8 text (byte {e.start}); expected GPT-2's merges.txt") from None
    for n, line in enumerate(lines, 1):
        if (n == 1 and line.startswith("#version")) or not line.strip():
            continue
        if len(line.split()) != 2:
            raise TokenizerError(
                f"--merge-file {merge_file} line {n}: expected two tokens separated by a space "
                f"(GPT-2's merges.txt), got {line[:60]!r}"
            )


class _TokenizersLibrary:
    """Encoding through a `tokenizers` object in `self._tok` (byte-level BPE, tokenizer.json)."""

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(_TokenizersLibrary):
    """GPT-2 byte-level BPE from vocab.json + merges.txt (`tokenizers` library).

    Like Megatron's, it registers no special tokens: the text `<|endoftext|>` is encoded as
    ordinary bytes; only `eod` is the `<|endoftext|>` id.
    """

    tokenizer_type = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import ByteLevelBPETokenizer

        self.vocab_file = need_file(vocab_file, "--vocab-file", self.tokenizer_type)
        self.merge_file = need_file(merge_file, "--merge-file", self.tokenizer_type)
        _check_gpt2_files(self.vocab_file, self.merge_file)
        try:
            self._tok = ByteLevelBPETokenizer(self.vocab_file, self.merge_file, add_prefix_space=False)
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception
            raise TokenizerError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: {e}") from None
        eod = self._tok.token_to_id("<|endoftext|>")
        if eod is None:
            raise TokenizerError(f"--vocab-file {vocab_file} has no '<|endoftext|>' entry, GPT-2's EOD token")
        self.eod = int(eod)
        self.vocab_size = int(self._tok.get_vocab_size())

    def files(self) -> list[str]:
        return [self.vocab_file, self.merge_file]


class _SentencePieceBase:
    def __init__(self, model_file: str):
        import sentencepiece as spm

        self.model_file = need_file(model_file, "--tokenizer-model", self.tokenizer_type)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.model_file)
        except (RuntimeError, OSError) as e:
            raise TokenizerError(
                f"--tokenizer-model {model_file}: not a SentencePiece model ({' '.join(str(e).split())})"
            ) from None

    def files(self) -> list[str]:
        return [self.model_file]


class GPTSentencePieceTokenizer(_SentencePieceBase):
    """A SentencePiece model used as is; EOD is the model's eos id (Megatron's rule)."""

    tokenizer_type = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self.vocab_size = len(self.sp)
        self.eod = int(self.sp.eos_id())
        if self.eod < 0:
            raise TokenizerError(
                f"--tokenizer-model {model_file} has no eos piece; GPTSentencePieceTokenizer uses eos as "
                "the end-of-document token (train it with eos_id >= 0)"
            )

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode_as_ids(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), num_threads=1)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.sp.decode_ids([int(i) for i in ids])


class Llama2Tokenizer(_SentencePieceBase):
    """Megatron's `_Llama2Tokenizer`: a SentencePiece model used as is (vocab = its pieces),
    every text encoded with the bos id in front and no eos; EOD is the model's eos id."""

    tokenizer_type = "Llama2Tokenizer"

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self.vocab_size = len(self.sp)
        self.bos, self.eod = int(self.sp.bos_id()), int(self.sp.eos_id())
        if self.bos < 0 or self.eod < 0:
            raise TokenizerError(f"--tokenizer-model {model_file} has no bos or eos piece; Llama2Tokenizer "
                                 "puts bos before each text and uses eos as the end-of-document token")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *self.sp.encode_as_ids(text)]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in self.sp.encode(list(texts), num_threads=1)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.sp.decode_ids([int(i) for i in ids])


class SentencePieceTokenizer(_SentencePieceBase):
    """Megatron's `_SentencePieceTokenizer`: the model's pieces plus appended special tokens.

    `<CLS> <SEP> <EOD> <MASK>`, then the pad, bos and eos pieces, are added after the model's
    vocab unless already present (pad/bos/eos fall back to `<PAD>`/`<BOS>`/`<EOS>` when the
    model disables them). Their literal text is recognised in the input, as in Megatron.
    """

    tokenizer_type = "SentencePieceTokenizer"

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self._vocab = {self.sp.id_to_piece(i): i for i in range(len(self.sp))}
        self._special: dict[str, int] = {}

        def add(token: str) -> int:
            if token not in self._vocab:
                self._vocab[token] = len(self._vocab)
            self._special[token] = self._vocab[token]
            return self._vocab[token]

        for token in ("<CLS>", "<SEP>"):
            add(token)
        self.eod = add("<EOD>")
        add("<MASK>")
        for getter, fallback in ((self.sp.pad_id, "<PAD>"), (self.sp.bos_id, "<BOS>"), (self.sp.eos_id, "<EOS>")):
            i = getter()
            add(self.sp.id_to_piece(i) if 0 <= i < len(self.sp) else fallback)
        self._inv_special = {v: k for k, v in self._special.items()}
        self.vocab_size = len(self._vocab)

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        idx = 0
        while True:
            found = {}
            for token in self._special:  # insertion order breaks ties, as in Megatron
                pos = text.find(token, idx)
                if pos >= 0:
                    found[token] = pos
            if not found:
                break
            token = min(found, key=found.get)
            ids.extend(self.sp.encode_as_ids(text[idx : found[token]]))
            ids.append(self._special[token])
            idx = found[token] + len(token)
        ids.extend(self.sp.encode_as_ids(text[idx:]))
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        text, last = "", 0
        for i, tid in enumerate(ids):
            if tid in self._inv_special:
                text += self.sp.decode_ids(ids[last:i]) + " " + self._inv_special[tid] + " "
                last = i + 1
        return text + self.sp.decode_ids(ids[last:])


_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


class HuggingFaceTokenizer(_TokenizersLibrary):
    """A `tokenizer.json` (or a local folder holding one), read with `tokenizers.Tokenizer`.

    EOD is the eos token named in the folder's tokenizer_config.json or special_tokens_map.json,
    else the first of the usual eos spellings present in the vocab.
    """

    tokenizer_type = "HuggingFaceTokenizer"

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        if not path:
            raise TokenizerError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a folder or tokenizer.json)")
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise TokenizerFileNotFound(
                f"--tokenizer-model {path}: no tokenizer.json there. HuggingFaceTokenizer reads a local "
                "folder containing tokenizer.json, or the file itself; hub names are never downloaded"
            )
        self.path = path
        self.tokenizer_file = file
        if not isinstance(read_json(file, "--tokenizer-model"), dict):
            raise TokenizerError(f"--tokenizer-model {file}: expected a JSON object (a tokenizers tokenizer.json)")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception
            raise TokenizerError(f"--tokenizer-model {file}: not a tokenizers tokenizer.json ({e})") from None
        folder = os.path.dirname(os.path.abspath(file))
        self._extra_files = [
            os.path.join(folder, f)
            for f in ("tokenizer_config.json", "special_tokens_map.json")
            if os.path.isfile(os.path.join(folder, f))
        ]
        eos = None
        self.chat_template, self.bos_text = None, ""  # from tokenizer_config.json (the server's chat)
        for f in self._extra_files:
            config = read_json(f, "--tokenizer-model")
            if not isinstance(config, dict):
                raise TokenizerError(f"--tokenizer-model {f}: expected a JSON object")
            if isinstance(config.get("chat_template"), str):
                self.chat_template = config["chat_template"]
            bos = config.get("bos_token")
            bos = bos.get("content") if isinstance(bos, dict) else bos
            if isinstance(bos, str) and not self.bos_text:
                self.bos_text = bos
            entry = config.get("eos_token")
            if isinstance(entry, dict):
                entry = entry.get("content")
            if isinstance(entry, str) and self._tok.token_to_id(entry) is not None:
                eos = entry
                break
        if eos is None:
            eos = next((t for t in _EOS_CANDIDATES if self._tok.token_to_id(t) is not None), None)
        if eos is None:
            raise TokenizerError(
                f"--tokenizer-model {path}: cannot find the eos token (no eos_token in tokenizer_config.json "
                f"or special_tokens_map.json, and none of {', '.join(_EOS_CANDIDATES)} is in the vocab)"
            )
        self.eod = int(self._tok.token_to_id(eos))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def files(self) -> list[str]:
        return [self.tokenizer_file, *self._extra_files]


class NullTokenizer:
    """Pre-tokenized data: text is space-separated ids. Megatron: EOD = V, vocab = V + 1."""

    tokenizer_type = "NullTokenizer"

    def __init__(self, vocab_size: int | None):
        if vocab_size is None or int(vocab_size) <= 0:
            raise TokenizerError("--tokenizer-type NullTokenizer needs a positive --vocab-size")
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def tokenize(self, text: str) -> list[int]:
        """Space-separated ids in [0, --vocab-size); the EOD id (= --vocab-size) is added by
        preprocessing's --append-eod, not written in the text."""
        ids = []
        for word in text.split():
            try:
                ids.append(int(word))
            except ValueError:
                raise TokenizerError(
                    f"NullTokenizer reads space-separated integer token ids; {word[:40]!r} is not one"
                ) from None
        if ids and not 0 <= min(ids) <= max(ids) < self.eod:
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise TokenizerError(
                f"NullTokenizer: token id {bad} is outside [0, {self.eod}) for --vocab-size {self.eod}"
            )
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def files(self) -> list[str]:
        return []


def make_tokenizer(
    tokenizer_type: str | None,
    *,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
    tiktoken_pattern: str = "v2",
    tiktoken_num_special_tokens: int = 1000,
    tokenizer_special_tokens: Sequence[str] | None = None,
):
    """Build a tokenizer from Megatron's tokenizer flags (see `build_tokenizer`)."""
    if tokenizer_type in ("Llama3Tokenizer", "TikTokenizer"):
        from mlm_jax.data.tiktoken_tokenizers import Llama3Tokenizer, TikTokenizer

        if tokenizer_type == "Llama3Tokenizer":
            return Llama3Tokenizer(tokenizer_model)
        return TikTokenizer(tokenizer_model, tiktoken_pattern, tiktoken_num_special_tokens, tokenizer_special_tokens)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise TokenizerError(
        f"unknown --tokenizer-type {tokenizer_type!r}; valid types: {', '.join(TOKENIZER_TYPES)}"
    )


def build_tokenizer(data_cfg, vocab_size: int | None = None):
    """The tokenizer named by `data_cfg.tokenizer_type` (`vocab_size`: NullTokenizer's --vocab-size)."""
    return make_tokenizer(
        data_cfg.tokenizer_type,
        tokenizer_model=data_cfg.tokenizer_model,
        vocab_file=data_cfg.vocab_file,
        merge_file=data_cfg.merge_file,
        vocab_size=vocab_size,
        # TikTokenizer's options (any object with the DataConfig fields will do; these may be absent)
        tiktoken_pattern=getattr(data_cfg, "tiktoken_pattern", "v2"),
        tiktoken_num_special_tokens=getattr(data_cfg, "tiktoken_num_special_tokens", 1000),
        tokenizer_special_tokens=getattr(data_cfg, "tokenizer_special_tokens", None),
    )


# Lossless SentencePiece: no NFKC, whitespace and newlines kept, unknown characters as bytes.
LOSSLESS_SENTENCEPIECE = dict(
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    add_dummy_prefix=False,
    byte_fallback=True,
    character_coverage=1.0,
    split_digits=True,
)


def train_sentencepiece(
    input_files: Sequence[str] | None,
    model_prefix: str,
    vocab_size: int,
    *,
    sentences: Iterable[str] | None = None,
    model_type: str = "bpe",
    num_threads: int | None = None,
    max_sentence_length: int = 16384,
    **options,
) -> str:
    """Train a lossless SentencePiece model; returns the path of `<model_prefix>.model`.

    Decoding what was encoded gives the input back exactly (code, indentation, newlines,
    any Unicode). Pass text files (`input_files`, one sentence per line) or `sentences`.
    The model keeps SentencePiece's default ids: unk=0, bos=1, eos=2 (the GPT EOD), no pad.
    """
    import sentencepiece as spm

    if (input_files is None) == (sentences is None):
        raise TokenizerError("train_sentencepiece needs exactly one of input_files or sentences")
    kwargs = dict(LOSSLESS_SENTENCEPIECE)
    kwargs.update(
        model_prefix=model_prefix,
        vocab_size=int(vocab_size),
        model_type=model_type,
        num_threads=int(num_threads or min(os.cpu_count() or 1, 8)),
        max_sentence_length=max_sentence_length,
        minloglevel=2,
    )
    kwargs.update(options)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    except OSError as e:
        raise TokenizerError(f"--model-prefix {model_prefix}: cannot create its folder ({e.strerror or e})") from None
    try:
        if input_files is not None:
            for f in input_files:
                if not os.path.isfile(f):
                    raise TokenizerFileNotFound(f"--input {f}: no such file (tokenizer training input)")
            spm.SentencePieceTrainer.train(input=",".join(input_files), **kwargs)
        else:
            spm.SentencePieceTrainer.train(sentence_iterator=_nonempty(sentences), **kwargs)
    except RuntimeError as e:  # e.g. a vocab size larger than the text allows
        raise TokenizerError(f"SentencePiece training of {model_prefix}.model failed: {' '.join(str(e).split())}") from None
    return model_prefix + ".model"


def _nonempty(sentences: Iterable[str]) -> Iterator[str]:
    for s in sentences:
        if s:
            yield s
