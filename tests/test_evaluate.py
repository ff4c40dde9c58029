"""Zero-shot evaluation (mlm_jax/evaluate.py) against a plain numpy computation of Megatron's
definitions, on a tiny Hugging Face GPT-2 (numpy fp64 reference forward) and files written here.

The reference scores each target token once, from the context Megatron's windows give it:
with seq length L and stride o, target j <= L is scored in window 0 (context tokens[:j]),
a later one in window ceil((j - L) / o) (context tokens[i*o : j]).
"""

import json
import math

import numpy as np
import pytest

import mlm_jax
from mlm_jax.config import ParallelConfig
from mlm_jax.evaluate import evaluate, main, result_line, wikitext_detokenize
from mlm_jax.sharding.mesh import make_mesh
from tests.gen_util import gpt2_reference, log_softmax, make_gpt2

L = 8


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("eval") / "gpt2")
    cfg, w = make_gpt2(folder)
    model = mlm_jax.load(folder, mesh=make_mesh(ParallelConfig(tensor_model_parallel_size=2)))
    return folder, cfg, w, model


def _next_logp(cfg, w, context):
    return log_softmax(gpt2_reference(w, cfg, np.asarray([context]))[0, -1])


def reference_lm(cfg, w, tokens, overlap):
    """Megatron's summed loss over the windows, by scoring each target from its context."""
    stride = overlap or L
    total = 0.0
    for j in range(1, len(tokens)):
        start = 0 if j <= L else math.ceil((j - L) / stride) * stride
        total -= _next_logp(cfg, w, tokens[start:j])[tokens[j]]
    return total / (len(tokens) - 1)


WIKI = (" = Valkyria = \n w1 w2 @-@ w3 , w4 ( w5 w6 ) w7 . w8 w9 w10 's w11 ; w12 \n"
        " w13 w14 w15 @,@ w16 w17 \" w18 w19 \" w20 w21 w22 w23 w24 w25 . \n")


@pytest.mark.parametrize("overlap", [3, 0])
def test_wikitext(hf, tmp_path, overlap):
    folder, cfg, w, model = hf
    path = tmp_path / "wiki.tokens"
    path.write_text(WIKI, encoding="utf-8")
    r = evaluate(model, "WIKITEXT103", str(path), L, 2, overlap)
    tokens = model.tokenizer.tokenize(wikitext_detokenize(WIKI))
    words = len(WIKI.strip().split(" "))
    loss = reference_lm(cfg, w, tokens, overlap)
    ratio = (len(tokens) - 1) / (words - 1)
    assert r["tokens"] == len(tokens) and r["words"] == words
    np.testing.assert_allclose(r["avg_loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(r["ppl"], math.exp(loss), rtol=1e-5)
    np.testing.assert_allclose(r["token_ratio"], ratio, rtol=1e-12)
    np.testing.assert_allclose(r["adjusted_ppl"], math.exp(loss * ratio), rtol=1e-5)
    assert result_line(r).startswith(" validation results on WIKITEXT103 | avg loss: ")


def test_wikitext_detokenizer():
    assert wikitext_detokenize(" w1 @-@ w2 @,@ w3 @.@ w4 , w5 . w6 ") == " w1-w2,w3.w4, w5. w6 "
    assert wikitext_detokenize("( a b ) [ c ] \" d \" = = = x = = =") == '(a b) [c] "d" === x ==='
    assert wikitext_detokenize("he 's 3 \N{DEGREE SIGN} C \n  N ") == "he's 3\N{DEGREE SIGN}C\n 1 "


def _lambada_texts(cfg, w):
    """Passages whose last word is, for some, the model's greedy choice (so accuracy is neither
    0 nor 1), and one ending in a multi-token word ("w5.w6": w5 <unk> w6) where strict differs."""
    rng = np.random.default_rng(3)
    texts = []
    for i in range(6):
        ctx = [int(t) for t in rng.integers(1, 99, size=5)]
        best = int(np.argmax(_next_logp(cfg, w, ctx)))
        target = best if i % 2 == 0 and 1 <= best <= 98 else int(rng.integers(1, 99))
        texts.append(" ".join(f"w{t}" for t in ctx + [target]))
    texts.append("w3 w4 w7 w5.w6")
    return texts


def reference_lambada(cfg, w, tok, texts, strict):
    correct = 0
    for text in texts:
        if strict:
            word = text.split()[-1]
            context = tok.tokenize(text[: text.rfind(word)].strip())
            target = tok.tokenize(" " + word)
        else:
            ids = tok.tokenize(text)
            context, target = ids[:-1], ids[-1:]
        ok = all(int(np.argmax(_next_logp(cfg, w, context + target[:k]))) == target[k] for k in range(len(target)))
        correct += ok
    return correct


@pytest.mark.parametrize("strict", [False, True])
def test_lambada(hf, tmp_path, strict):
    folder, cfg, w, model = hf
    texts = _lambada_texts(cfg, w)
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    r = evaluate(model, "LAMBADA", str(path), L, 4, strict=strict)
    want = reference_lambada(cfg, w, model.tokenizer, texts, strict)
    assert 0 < want < len(texts)
    assert (r["number_correct"], r["total_examples"]) == (want, len(texts))
    assert r["avg_accuracy"] == want / len(texts)


def test_valid_and_cli(hf, tmp_path, capsys):
    from mlm_jax.data.indexed_dataset import write_indexed_dataset

    folder, cfg, w, model = hf
    docs = [np.array([5, 9, 13, 2, 7], np.uint16), np.array([40, 41, 3, 3, 8, 60, 1], np.uint16)]
    prefix = str(tmp_path / "valid")
    write_indexed_dataset(prefix, docs)
    out = tmp_path / "r.json"
    # --load an mlm_jax checkpoint (imported from the HF folder), on tp1 (the fixture is tp2).
    from mlm_jax.tools.checkpoint import import_hf

    save = import_hf(folder, str(tmp_path / "ckpt"), log=lambda *_: None)
    code = main(["--task", "VALID", "--valid-data", prefix, "--load", save, "--seq-length", str(L),
                 "--micro-batch-size", "2", "--output-json", str(out)])
    assert code == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith(" validation results on VALID | avg loss: ")
    r = json.loads(out.read_text())
    tokens = [int(t) for d in docs for t in d]
    np.testing.assert_allclose(r["avg_loss"], reference_lm(cfg, w, tokens, 0), rtol=1e-5)


@pytest.mark.parametrize("argv, needle", [
    (["--task", "LAMBADA", "--valid-data", "/nope.jsonl", "--load", ".", "--seq-length", "8"], "--valid-data /nope.jsonl"),
    (["--task", "WIKITEXT103", "--valid-data", __file__, "--load", ".", "--seq-length", "8",
      "--overlapping-eval", "9"], "--overlapping-eval"),
    (["--task", "VALID", "--valid-data", "/nope", "--load", "/missing", "--seq-length", "8"], "--load /missing"),
])
def test_cli_bad_input(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and needle in err[-1]
