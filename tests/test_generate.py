"""KV-cached decoding (mlm_jax/generate.py): equal to decoding without a cache (the argmax of
full-sequence logits) for GPT-2- and Llama-style models on tp1 and tp2, imported Hugging Face
models against an independent numpy decoder, sampling, stop token, log-probs, buckets, CLI."""

import os
import subprocess
import sys

import numpy as np
import pytest

import mlm_jax
from mlm_jax.config import ParallelConfig
from mlm_jax.generate import Decoder, filter_logits, greedy, main
from mlm_jax.sharding.mesh import make_mesh
from tests.gen_util import (gpt2_reference, llama_reference, log_softmax, make_gpt2,
                            make_llama, memory_model, numpy_decoder, uncached_greedy)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], list(range(10, 21))]
NEW = 10
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", params=[("gpt2", 1), ("gpt2", 2), ("llama", 1), ("llama", 2)],
                ids=lambda p: f"{p[0]}-tp{p[1]}")
def model(request):
    style, tp = request.param
    return memory_model(tp, style)


def test_cached_equals_uncached(model):
    outs = model.generate(PROMPTS, max_new_tokens=NEW, logprobs=True)
    want = uncached_greedy(model.logits, PROMPTS, NEW, 32)
    assert [o.tokens for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)
    # Log-probs: the log-softmax of the uncached logits at each chosen token (fp32, 1e-4).
    full = [p + w for p, w in zip(PROMPTS, want)]
    buf = np.zeros((len(full), 32), np.int64)
    for i, s in enumerate(full):
        buf[i, : len(s)] = s
    lp = log_softmax(model.logits(buf).astype(np.float64))
    for i, (p, o) in enumerate(zip(PROMPTS, outs)):
        ref = [lp[i, t - 1, full[i][t]] for t in range(1, len(full[i]))]
        np.testing.assert_allclose(o.prompt_logprobs + o.logprobs, ref, atol=1e-4)


def test_cache_is_sharded_like_the_heads():
    """The compiled program keeps the [layers, batch, len, kv_heads, head_dim] cache split on
    kv_heads over tensor: each device's cache buffer holds kv_heads / tp heads."""
    from mlm_jax.generate import _decode_program
    from mlm_jax.parallel import tracing

    m = memory_model(2, "gpt2")
    dec = m.decoder()
    shape = (1, 8, 16)  # one row, prompt bucket 8, cache bucket 16
    with tracing(m.mesh, dec.rules):
        hlo = _decode_program(dec.graphdef, dec.vocab, 16, False).lower(m.params, *_arrays(shape)).compile().as_text()
    per_device = f"f32[{m.config.num_layers},1,16,{m.config.query_groups // 2},{m.config.head_dim}]"
    whole = f"f32[{m.config.num_layers},1,16,{m.config.query_groups},{m.config.head_dim}]"
    assert per_device in hlo and whole not in hlo, per_device


def _arrays(shape):
    b, p, t = shape[:3]
    return (np.zeros((b, p), np.int32), np.ones(b, np.int32), np.ones(b, np.int32), np.zeros(b, np.float32),
            np.zeros(b, np.int32), np.zeros(b, np.float32), np.full(b, -1, np.int32), np.zeros((b, 2), np.uint32))


@pytest.fixture(scope="module")
def gpt():
    return memory_model(1, "gpt2")


def test_sampling_seeds_and_rows_independent(gpt):
    kw = dict(max_new_tokens=8, temperature=1.5, top_k=20)
    a = gpt.generate(PROMPTS, seed=3, **kw)
    b = gpt.generate(PROMPTS, seed=3, **kw)
    c = gpt.generate(PROMPTS, seed=4, **kw)
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert [o.tokens for o in a] != [o.tokens for o in c]
    # Row i draws with fold_in(key(seed), i) whatever it is batched with.
    alone = gpt.decoder()([PROMPTS[2]], 8, 1.5, 20, 0.0, [(3, 2)])
    assert alone[0].tokens == a[2].tokens
    # top_k=1 at any temperature is the argmax; a tiny nucleus likewise.
    greedy_out = [o.tokens for o in gpt.generate(PROMPTS, max_new_tokens=8)]
    assert [o.tokens for o in gpt.generate(PROMPTS, max_new_tokens=8, temperature=2.0, top_k=1)] == greedy_out
    assert [o.tokens for o in gpt.generate(PROMPTS, max_new_tokens=8, temperature=2.0, top_p=1e-6)] == greedy_out


def test_filter_logits_against_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 50)).astype(np.float32)
    top_k, top_p = np.array([0, 5, 0]), np.array([0.0, 0.0, 0.6], np.float32)
    got = np.asarray(filter_logits(x, top_k, top_p))
    assert np.array_equal(got[0], x[0])
    assert set(np.flatnonzero(np.isfinite(got[1]))) == set(np.argsort(-x[1])[:5])
    order = np.argsort(-x[2])
    p = np.exp(x[2] - x[2].max())
    p = p[order] / p.sum()
    keep = order[(np.cumsum(p) - p) <= 0.6]  # tokens before it sum to at most top_p
    assert set(np.flatnonzero(np.isfinite(got[2]))) == set(keep)


def test_stop_token_buckets_and_train_greedy(gpt):
    full = gpt.generate([PROMPTS[0]], max_new_tokens=8)[0].tokens
    stop = full[3]
    first = full.index(stop)
    out = gpt.generate([PROMPTS[0]], max_new_tokens=8, stop_token=stop)[0]
    assert out.tokens == full[: first + 1] and out.finish_reason == "stop"
    # Different lengths and token counts within one bucket reuse one program.
    dec = gpt.decoder()
    gpt.generate([[1, 2, 3]], max_new_tokens=5)
    n = dec.programs()
    gpt.generate([[4, 5, 6, 7, 8, 9]], max_new_tokens=3)
    gpt.generate([[9]], max_new_tokens=7, temperature=0.7, top_p=0.9, seed=1)
    assert dec.programs() == n
    # train's end-of-run sample: the same tokens through greedy(graphdef, params, ...).
    assert greedy(dec.graphdef, gpt.params, PROMPTS[0], 8, 64) == full


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_import_generates_numpy_decoders_tokens(tmp_path, kind):
    folder = str(tmp_path / kind)
    cfg, w = (make_gpt2 if kind == "gpt2" else make_llama)(folder)
    ref = gpt2_reference if kind == "gpt2" else llama_reference
    m = mlm_jax.load(folder, mesh=make_mesh(ParallelConfig(tensor_model_parallel_size=2)))
    prompts = [[5, 9, 13], [40, 2, 77, 3, 61]]
    # GPT-2's folder has a tokenizer: its first prompt goes in as a string.
    first = "w5 w9 w13" if kind == "gpt2" else prompts[0]
    outs = m.generate([first, prompts[1]], max_new_tokens=6)
    assert [o.tokens for o in outs] == [numpy_decoder(ref, w, cfg, p, 6) for p in prompts]
    if kind == "gpt2":
        assert outs[0].text == " ".join(f"w{t}" for t in outs[0].tokens)


def test_cli(tmp_path):
    folder = str(tmp_path / "gpt2")
    cfg, w = make_gpt2(folder)
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "mlm_jax.generate", "--load", folder, "--prompt", "w5 w9 w13",
                        "--tokens-to-generate", "4", "--logprobs"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    want = numpy_decoder(gpt2_reference, w, cfg, [5, 9, 13], 4)
    lines = r.stdout.strip().splitlines()
    assert lines[-2] == " ".join(f"w{t}" for t in want)
    assert lines[-1].startswith("logprobs: ") and len(lines[-1].split()) == 5


@pytest.mark.parametrize("argv, needle", [
    (["--load", "/nonexistent/ckpt", "--prompt", "x"], "--load /nonexistent/ckpt"),
    (["--load", ".", "--prompt", "x", "--top-p", "1.5"], "--top-p"),
    (["--load", ".", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["--load", ".", "--prompt-ids", "1 x"], "--prompt-ids"),
    (["--load", "."], "--prompt"),
])
def test_cli_bad_input(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and needle in err[-1] and "Traceback" not in "\n".join(err)


def test_decoder_rejects_bad_prompts(gpt):
    from mlm_jax.errors import UsageError

    with pytest.raises(UsageError, match="prompt 0 is empty"):
        gpt.generate([[]], max_new_tokens=2)
    with pytest.raises(UsageError, match="exceed the model's 64 positions"):
        gpt.generate([[1] * 60], max_new_tokens=5)
    with pytest.raises(UsageError, match=r"token ids must be in \[0, 100\)"):
        gpt.generate([[100]], max_new_tokens=1)
    assert isinstance(gpt.decoder(), Decoder)
