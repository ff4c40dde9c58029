"""Beam search (mlm_jax/beam.py) against a literal numpy restatement of Megatron-LM's
algorithm on full uncached logits (no top-2W merge, no cache), the exhaustive one-token case,
W=1 against greedy decoding, and input validation."""

import numpy as np
import pytest

from mlm_jax.beam import beam_search
from mlm_jax.errors import UsageError
from tests.gen_util import log_softmax, memory_model

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [42]]
NEW = 8
WINDOW, ROWS = 32, 4  # the reference's fixed logits input: one compile for every W
PROGRAMS: dict = {}


@pytest.fixture(scope="module")
def lm():
    return memory_model(1, "gpt2")


def run(lm, prompt, new, width, stop=None, penalty=1.0, colon=None):
    dec = lm.decoder()
    return beam_search(dec.graphdef, dec.params, dec.vocab, prompt, new, width, stop, penalty, colon,
                       dec.max_positions, dec.mesh, dec.rules, PROGRAMS)


class Hyps:
    """Hugging Face's BeamHypotheses, restated (early_stopping False)."""

    def __init__(self, n, penalty):
        self.n, self.penalty, self.beams, self.worst = n, penalty, [], 1e9

    def add(self, hyp, logprobs, length):
        score = logprobs / length ** self.penalty
        if len(self.beams) < self.n or score > self.worst:
            self.beams.append((score, hyp))
            if len(self.beams) > self.n:
                ranked = sorted((s, i) for i, (s, _) in enumerate(self.beams))
                del self.beams[ranked[0][1]]
                self.worst = ranked[1][0]
            else:
                self.worst = min(score, self.worst)

    def is_done(self, best, length):
        return len(self.beams) >= self.n and self.worst >= best / length ** self.penalty


def reference(lm, prompt, new, width, stop=None, penalty=1.0, colon=None):
    """Megatron's beam_search_and_return_on_first_stage over the full [W, V] scores, each step
    from the uncached logits of every beam's whole sequence (fp64 log-softmax)."""
    p = len(prompt)
    tokens = [list(prompt) for _ in range(width)]
    scores = np.zeros(width)
    hyps, done = Hyps(width, penalty), False
    for c in range(p, p + new):
        buf = np.zeros((ROWS, WINDOW), np.int64)
        for i, s in enumerate(tokens):
            buf[i, : len(s)] = s
        logits = lm.logits(buf)[:width, c - 1].astype(np.float64)  # [W, V]
        if colon is not None:
            for i, s in enumerate(tokens):
                if s[-1] == colon[0]:
                    logits[i, colon[1]] = -1e10
        new_scores = log_softmax(logits) + scores[:, None]
        v = new_scores.shape[1]
        flat = new_scores[0] if c == p else new_scores.reshape(-1)
        order = np.argsort(-flat, kind="stable")[: 2 * width]
        nxt = []
        for rank, idx in enumerate(order):
            beam, tok = idx // v, idx % v
            if tok == stop:
                if rank >= width:
                    continue
                hyps.add(list(tokens[beam]), flat[idx], c + 1 - p)
            else:
                nxt.append((tok, flat[idx], beam))
            if len(nxt) == width:
                break
        done = hyps.is_done(max(s for _, s, _ in nxt), c + 1 - p)
        tokens = [tokens[b] + [int(t)] for t, _, b in nxt]
        scores = np.array([s for _, s, _ in nxt])
        if done:
            break
    if not done:
        for s, sc in zip(tokens, scores):
            hyps.add(s, sc, c + 1 - p)
    return sorted(hyps.beams, key=lambda b: b[0], reverse=True)[:width]


def assert_same(got, want):
    assert [b.tokens for b in got] == [h for _, h in want]
    np.testing.assert_allclose([b.score for b in got], [s for s, _ in want], rtol=0, atol=1e-5)


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_matches_reference(lm, width, penalty):
    for prompt in PROMPTS:
        assert_same(run(lm, prompt, NEW, width, None, penalty), reference(lm, prompt, NEW, width, None, penalty))


@pytest.mark.parametrize("width", [1, 2, 4])
def test_stop_token_and_newline_rule_match_reference(lm, width):
    prompt = PROMPTS[0]
    free = run(lm, prompt, NEW, width)
    path = free[0].tokens[len(prompt):]  # the best beam's new tokens without stop or rule
    # A stop token the best beam meets first at step >= 2 (the search must still go on a while),
    # and a (colon, newline) pair it emits: both change the search.
    stop = next((t for j, t in enumerate(path) if j >= 2 and t not in path[:j]), path[-1])
    colon = (path[0], path[1])
    got = run(lm, prompt, NEW, width, stop, 1.0)
    assert_same(got, reference(lm, prompt, NEW, width, stop, 1.0))
    assert all(stop not in b.tokens[len(prompt):] for b in got)
    assert any(len(b.tokens) < len(prompt) + NEW for b in got), "no beam ended at the stop token"
    assert [b.tokens for b in got] != [b.tokens for b in free]
    got = run(lm, prompt, NEW, width, None, 0.5, colon)
    assert [b.tokens for b in got] != [b.tokens for b in run(lm, prompt, NEW, width, None, 0.5)]
    assert_same(got, reference(lm, prompt, NEW, width, None, 0.5, colon))
    assert all(colon[1] != b.tokens[i + 1] for b in got for i in range(len(b.tokens) - 1)
               if b.tokens[i] == colon[0] and i + 1 >= len(prompt))
    assert_same(run(lm, prompt, NEW, width, stop, 0.5, colon), reference(lm, prompt, NEW, width, stop, 0.5, colon))


def test_one_token_is_the_top_log_probs(lm):
    width = 4
    for prompt in PROMPTS:
        buf = np.zeros((ROWS, WINDOW), np.int64)
        buf[0, : len(prompt)] = prompt
        logp = log_softmax(lm.logits(buf)[0, len(prompt) - 1].astype(np.float64))
        top = np.argsort(-logp, kind="stable")[:width]
        got = run(lm, prompt, 1, width)
        assert [b.tokens for b in got] == [prompt + [int(t)] for t in top]
        np.testing.assert_allclose([b.score for b in got], logp[top], rtol=0, atol=1e-5)


def test_width_one_is_greedy(lm):
    outs = lm.decoder()(PROMPTS, NEW)
    for prompt, out in zip(PROMPTS, outs):
        (beam,) = run(lm, prompt, NEW, 1)
        assert beam.tokens == prompt + out.tokens


def test_programs_are_reused(lm):
    before = len(PROGRAMS)
    run(lm, PROMPTS[0], NEW, 2)
    run(lm, PROMPTS[1], NEW - 1, 2, penalty=0.5)
    run(lm, PROMPTS[0], NEW, 2)
    assert len(PROGRAMS) <= before + 2


@pytest.mark.parametrize("kwargs, name", [
    (dict(width=0), "beam_width"), (dict(width=51), "beam_width"), (dict(new=0), "tokens_to_generate"),
    (dict(prompt=[]), "prompt"), (dict(prompt=[1, 100]), "prompt"), (dict(prompt=[-1]), "prompt"),
    (dict(stop=100), "stop_token"), (dict(colon=(1, 100)), "newline_after_colon"),
    (dict(prompt=list(range(64))), "prompt")])
def test_bad_inputs(lm, kwargs, name):
    args = dict(prompt=[1, 2], new=4, width=2, stop=None, penalty=1.0, colon=None)
    args.update(kwargs)
    with pytest.raises(UsageError, match=name):
        run(lm, args["prompt"], args["new"], args["width"], args["stop"], args["penalty"], args["colon"])
