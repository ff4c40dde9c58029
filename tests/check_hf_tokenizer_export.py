"""By hand, not run by the tests: transformers' AutoTokenizer loads the tokenizer `export-hf`
writes and tokenizes as mlm_jax does (issue 53: the export once wrote gpt2-vocab.json /
gpt2-merges.txt / spm.model, names transformers does not read).

Two steps, two venvs (the suite never imports transformers):

    # 1. this project's venv: a tiny GPT-2 BPE run (Megatron's file names), its export-hf, and the
    #    ids mlm_jax's tokenizer gives some texts -> DIR/expected.json
    PYTHONPATH=. python tests/check_hf_tokenizer_export.py make DIR
    # 2. a venv with transformers (pip install transformers; no torch needed)
    python tests/check_hf_tokenizer_export.py check DIR

Step 2 prints the class AutoTokenizer chose and `ok`, or the first text whose ids differ.
"""

from __future__ import annotations

import json
import os
import sys

TEXTS = ["hello world", "word for word, or not", " leading space", "<|endoftext|>", "naïve café ✓"]


def make(out: str) -> None:
    import subprocess

    from tokenizers.pre_tokenizers import ByteLevel

    os.makedirs(out)
    tok = os.path.join(out, "tok")
    os.makedirs(tok)
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab.update({"Ġw": 256, "or": 257, "<|endoftext|>": 258})
    with open(os.path.join(tok, "gpt2-vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(tok, "gpt2-merges.txt"), "w") as f:
        f.write("#version: 0.2\nĠ w\no r\n")
    flags = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
             "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
             "--global-batch-size", "1", "--train-iters", "1", "--tokenizer-type", "GPT2BPETokenizer",
             "--vocab-file", os.path.join(tok, "gpt2-vocab.json"), "--merge-file", os.path.join(tok, "gpt2-merges.txt"),
             "--save", os.path.join(out, "ck"), "--run-dir", os.path.join(out, "run"), "--sample-tokens", "0"]
    env = dict(os.environ, MLM_JAX_CPU_DEVICES="1")
    subprocess.run([sys.executable, "-m", "mlm_jax.train", *flags], check=True, env=env)
    subprocess.run([sys.executable, "-m", "mlm_jax.tools.checkpoint", "export-hf", "--load", os.path.join(out, "ck"),
                    "--hf-dir", os.path.join(out, "hf")], check=True, env=env)
    import mlm_jax

    tokenizer = mlm_jax.load(os.path.join(out, "hf")).tokenizer
    expected = {text: list(map(int, tokenizer.tokenize(text))) for text in TEXTS if text != "<|endoftext|>"}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(f"wrote {out}/hf and {out}/expected.json; now run step 2 in a venv with transformers")


def check(out: str) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(out, "hf"))
    print(type(tokenizer).__name__, "eos", tokenizer.eos_token, tokenizer.eos_token_id)
    with open(os.path.join(out, "expected.json")) as f:
        expected = json.load(f)
    for text, ids in expected.items():
        got = tokenizer(text, add_special_tokens=False)["input_ids"]
        if got != ids:
            print(f"differs on {text!r}: transformers {got}, mlm_jax {ids}")
            return 1
    print(f"ok: {len(expected)} texts tokenized alike")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        sys.exit(__doc__)
    sys.exit(make(sys.argv[2]) if sys.argv[1] == "make" else check(sys.argv[2]))
