"""Data-test fixtures: tiny tokenizers trained on a few KB of text, and an isolated cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

# A little text with code, indentation, blank lines and non-ASCII, for training and round trips.
SAMPLE_TEXTS = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 😀\n\ttabbed line\n",
    "for i in range(10):\n        print(i * 2)  # doubled\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "   leading spaces, trailing spaces   \n\n\nthree newlines above\r\nwindows line\n",
] * 4


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """Every test caches under its own directory, never in ~/.cache."""
    monkeypatch.setenv("MLM_JAX_CACHE", str(tmp_path_factory.mktemp("mlm_jax_cache")))


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory) -> str:
    from mlm_jax.data.tokenizers import train_sentencepiece

    d = tmp_path_factory.mktemp("spm")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(SAMPLE_TEXTS * 5), encoding="utf-8")
    return train_sentencepiece([str(corpus)], str(d / "tok"), 400, num_threads=1)


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory) -> tuple[str, str]:
    from tokenizers import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("gpt2")
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(SAMPLE_TEXTS, vocab_size=400, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def random_documents(n: int, seed: int = 0, max_len: int = 50, vocab: int = 1000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, max_len)), dtype=np.int64) for _ in range(n)]
