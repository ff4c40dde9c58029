"""Beam search with Megatron-LM's semantics (the text-generation server's `beam_width`):
Megatron's `beam_search_and_return_on_first_stage` with Hugging Face's `BeamHypotheses`.

    beams = beam_search(graphdef, params, vocab, prompt, tokens_to_generate=16, beam_width=4,
                        stop_token=eos, length_penalty=1.0)
    beams[0].tokens, beams[0].score   # prompt + new tokens, sum of log-probs / length ** penalty

How one call runs: a jitted prefill (one row, the prompt right-padded to a bucket, a cache of
T = bucket(P + N) positions) returns the cache tiled to W rows and the top 2W log-probs of the
last prompt token. Then one jitted step per token: gather the cache rows of the parent beams,
run the W new tokens, return each row's top 2W log-probs ([W, 2W] values and ids). The host
merges the candidates: the global top 2W of the W*V scores lies in the union of each row's top
2W, so ranking those W*2W (score + row's score; ties to the lower flat index, as a stable
descending sort over [W*V]) picks what Megatron's topk over [W*V] picks. The walk over the
ranked candidates, the hypotheses and the stop rule are plain Python, as in Megatron.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlm_jax.errors import UsageError
from mlm_jax.generate import MIN_PROMPT_BUCKET, _prefill, bucket

# Megatron's value for the blocked newline logit (not -inf: log_softmax stays finite).
BLOCKED_LOGIT = -1e10


@dataclasses.dataclass
class Beam:
    """One finished hypothesis: the prompt and its new tokens (no stop token), and its score
    (sum of the new tokens' log-probs / new length ** length_penalty)."""

    tokens: list[int]
    score: float


class BeamHypotheses:
    """Hugging Face's `BeamHypotheses` (early_stopping False), as Megatron uses it."""

    def __init__(self, num_beams: int, length_penalty: float):
        self.num_beams, self.length_penalty = num_beams, length_penalty
        self.beams: list[tuple[float, list[int]]] = []
        self.worst_score = 1e9

    def __len__(self) -> int:
        return len(self.beams)

    def add(self, hyp: list[int], sum_logprobs: float, length: int) -> None:
        score = sum_logprobs / length ** self.length_penalty
        if len(self) < self.num_beams or score > self.worst_score:
            self.beams.append((score, hyp))
            if len(self) > self.num_beams:
                ranked = sorted((s, i) for i, (s, _) in enumerate(self.beams))
                del self.beams[ranked[0][1]]
                self.worst_score = ranked[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs: float, cur_len: int) -> bool:
        if len(self) < self.num_beams:
            return False
        return self.worst_score >= best_sum_logprobs / cur_len ** self.length_penalty


# ------------------------------------------------------------------------------ the programs


def _block_newline(logits_wv, last_w, colon, newline):
    """Megatron's prevent_newline_after_colon: the newline logit at -1e10 in rows whose last
    token is the colon (colon = -1: off)."""
    v = logits_wv.shape[-1]
    hit = (last_w == colon)[:, None] & (jnp.arange(v) == newline)[None, :]  # [w, v]
    return jnp.where(hit, BLOCKED_LOGIT, logits_wv)


def _prefill_program(graphdef, vocab: int, max_len: int, width: int, k: int):
    """(params, tokens [1, P_b], length [1], colon, newline) -> (cache tiled to `width` rows,
    top-k log-probs of the last prompt token: values [k], ids [k])."""

    def run(params, tokens_1p, length_1, colon, newline):
        model = nnx.merge(graphdef, params)
        cache, last_1v, _ = _prefill(model, tokens_1p, length_1, max_len, vocab, False)
        last_tok = jnp.take_along_axis(tokens_1p, (length_1 - 1)[:, None], axis=1)[:, 0]  # [1]
        logp_1v = jax.nn.log_softmax(_block_newline(last_1v, last_tok, colon, newline), axis=-1)
        values, ids = jax.lax.top_k(logp_1v[0], k)
        # All beams start as the prompt: tile its cache rows (batch is axis 1).
        cache = jax.tree.map(lambda c: jnp.repeat(c, width, axis=1), cache)
        return cache, values, ids.astype(jnp.int32)

    return jax.jit(run)


def _step_program(graphdef, vocab: int, k: int):
    """(params, cache [layers, w, T, kv_heads, head_dim], parents [w], tokens [w], position,
    colon, newline) -> (top-k log-probs per row: values [w, k], ids [w, k], the new cache)."""

    def run(params, cache, parents_w, tokens_w, position, colon, newline):
        model = nnx.merge(graphdef, params)
        cache = jax.tree.map(lambda c: jnp.take(c, parents_w, axis=1), cache)
        w = tokens_w.shape[0]
        positions_w1 = jnp.full((w, 1), position, jnp.int32)
        logits, cache = model.forward_cached(tokens_w[:, None], positions_w1, cache)
        logits_wv = _block_newline(logits[:, 0, :vocab], tokens_w, colon, newline)
        values, ids = jax.lax.top_k(jax.nn.log_softmax(logits_wv, axis=-1), k)  # [w, k] each
        return values, ids.astype(jnp.int32), cache

    return jax.jit(run, donate_argnums=(1,))


# ------------------------------------------------------------------------------ the search


def _check(vocab, prompt, tokens_to_generate, beam_width, stop_token, length_penalty,
           newline_after_colon, max_positions):
    if not isinstance(beam_width, (int, np.integer)) or beam_width < 1:
        raise UsageError(f"beam_width must be an integer >= 1, got {beam_width!r}")
    if 2 * beam_width > vocab:
        raise UsageError(f"beam_width {beam_width}: 2 * beam_width must not exceed the vocab size {vocab}")
    if not isinstance(tokens_to_generate, (int, np.integer)) or tokens_to_generate < 1:
        raise UsageError(f"tokens_to_generate must be an integer >= 1, got {tokens_to_generate!r}")
    if len(prompt) == 0:
        raise UsageError("prompt is empty: give at least one token (e.g. a BOS token)")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise UsageError(f"prompt: token ids must be in [0, {vocab})")
    if stop_token is not None and not 0 <= stop_token < vocab:
        raise UsageError(f"stop_token must be in [0, {vocab}), got {stop_token}")
    if not np.isfinite(length_penalty):
        raise UsageError(f"length_penalty must be a finite number, got {length_penalty}")
    if newline_after_colon is not None:
        if len(newline_after_colon) != 2 or not all(0 <= int(t) < vocab for t in newline_after_colon):
            raise UsageError(f"newline_after_colon must be (colon id, newline id) in [0, {vocab}), "
                             f"got {newline_after_colon!r}")
    if max_positions is not None and len(prompt) >= max_positions:
        raise UsageError(f"prompt: {len(prompt)} tokens leave no room in the model's {max_positions} positions")


def _ranked(cand_scores, cand_flat, n: int):
    """The first n candidates by descending score, ties to the lower flat index:
    (scores, flat indices)."""
    order = np.lexsort((cand_flat, -cand_scores))[:n]
    return cand_scores[order], cand_flat[order]


def beam_search(graphdef, params, vocab_size: int, prompt: list[int], tokens_to_generate: int,
                beam_width: int, stop_token: int | None, length_penalty: float = 1.0,
                newline_after_colon: tuple[int, int] | None = None, max_positions: int | None = None,
                mesh=None, rules=None, programs: dict | None = None) -> list[Beam]:
    """Megatron-LM's beam search for one prompt: up to `beam_width` hypotheses, best first.

    `stop_token` ends a hypothesis (it is not kept in its tokens); `length_penalty` divides
    the summed log-probs by length ** penalty; `newline_after_colon=(colon, newline)` forbids
    the newline token right after the colon (Megatron's prevent_newline_after_colon). The
    length is capped at `max_positions`. `mesh`/`rules`: where the parameters live and the
    activation rules (as for `mlm_jax.generate.Decoder`). `programs`: a dict the caller keeps
    so compiled programs are reused across calls (keyed by their static shapes).
    """
    prompt = [int(t) for t in prompt]
    _check(vocab_size, prompt, tokens_to_generate, beam_width, stop_token, length_penalty,
           newline_after_colon, max_positions)
    w, p, v = int(beam_width), len(prompt), vocab_size
    final_len = p + int(tokens_to_generate)
    if max_positions is not None:
        final_len = min(final_len, max_positions)
    k = 2 * w
    pb, t = bucket(p, MIN_PROMPT_BUCKET), bucket(final_len, MIN_PROMPT_BUCKET)
    programs = {} if programs is None else programs
    if ("beam_prefill", pb, t, w) not in programs:
        programs[("beam_prefill", pb, t, w)] = _prefill_program(graphdef, v, t, w, k)
    if ("beam_step", w, t) not in programs:
        programs[("beam_step", w, t)] = _step_program(graphdef, v, k)
    prefill, step = programs[("beam_prefill", pb, t, w)], programs[("beam_step", w, t)]
    colon, newline = (-1, -1) if newline_after_colon is None else map(int, newline_after_colon)
    colon, newline = np.int32(colon), np.int32(newline)

    def call(fn, *args):
        if mesh is None:
            return fn(params, *args)
        from mlm_jax.parallel import tracing

        with tracing(mesh, rules):
            return fn(params, *args)

    padded = np.zeros((1, pb), np.int32)
    padded[0, :p] = prompt
    cache, values, ids = call(prefill, padded, np.array([p], np.int32), colon, newline)
    tokens = np.zeros((w, final_len), np.int64)  # [beam, position]: prompt + generated
    tokens[:, :p] = prompt
    scores = np.zeros((w,), np.float64)
    hyps = BeamHypotheses(w, length_penalty)
    done = False
    context = p
    for context in range(p, final_len):
        if context == p:
            # Every row is the prompt: rank row 0 only (Megatron's first step).
            cand_scores = np.asarray(values, np.float64)
            cand_flat = np.asarray(ids, np.int64)
        else:
            cand_scores = (np.asarray(values, np.float64) + scores[:, None]).reshape(-1)  # [w*k]
            cand_flat = (np.arange(w)[:, None] * v + np.asarray(ids, np.int64)).reshape(-1)
        best, flat = _ranked(cand_scores, cand_flat, k)
        next_beams: list[tuple[int, float, int]] = []  # (token, score, parent beam)
        for rank, (score, index) in enumerate(zip(best, flat)):
            beam, token = int(index) // v, int(index) % v
            if stop_token is not None and token == stop_token:
                if rank >= w:
                    continue
                hyps.add([int(x) for x in tokens[beam, :context]], float(score), context + 1 - p)
            else:
                next_beams.append((token, float(score), beam))
            if len(next_beams) == w:
                break
        done = hyps.is_done(max(s for _, s, _ in next_beams), context + 1 - p)
        parents = np.array([b for _, _, b in next_beams], np.int32)
        new_tokens = np.array([tok for tok, _, _ in next_beams], np.int32)
        tokens = tokens[parents]
        tokens[:, context] = new_tokens
        scores = np.array([s for _, s, _ in next_beams], np.float64)
        if done or context + 1 == final_len:
            break
        # The new token sits at position `context`; the cache rows follow their parents.
        values, ids, cache = call(step, cache, parents, new_tokens, np.int32(context), colon, newline)
    if not done:
        for i in range(w):
            hyps.add([int(x) for x in tokens[i, : context + 1]], float(scores[i]), context + 1 - p)
    ranked = sorted(hyps.beams, key=lambda b: b[0], reverse=True)[:w]
    return [Beam(tokens=hyp, score=float(score)) for score, hyp in ranked]
