"""Continuous batching: a fixed set of decode slots, one token per slot per step, and requests
that join at the next step instead of waiting for the batch to finish.

The engine holds a KV cache of `slots` rows x `context` positions and the last logits of each
slot on the devices. Two kinds of compiled program run on them:

- prefill (one per prompt bucket, see `mlm_jax.generate.bucket`): one prompt through the layers
  into its slot's cache row, and the slot's last logits; optionally every prompt position's
  log-prob and top-5 alternatives (OpenAI `echo` + `logprobs`, lm-eval's loglikelihood);
- step (one for the engine): every slot samples its next token from its last logits (its own
  temperature, top-k, top-p and key), returns the token, its log-prob and the top-5, and runs
  the token through the layers at the slot's own position.

A slot's rows never mix with another's (causal masking by position: see
`mlm_jax.models.attention.Attention.cached`), so a prompt gets the same tokens whatever else
is decoding, and a freed slot is reused by the next prefill without clearing. Stop rules that
need text (stop strings, end of line) are checked on the host after each step.

The engine runs on its own thread; `submit` is called from the event loop and its results
come back through `loop.call_soon_threadsafe`. Static batching (`continuous=False`, for the
benchmark) admits new rows only when every slot is free.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlm_jax.generate import MIN_PROMPT_BUCKET, bucket, sample

TOP_N = 5  # the most alternatives per position (OpenAI's logprobs limit)


@dataclasses.dataclass
class Row:
    """One sequence to generate, and what it produced.

    `new_tokens` 0 scores the prompt only. `stop_ids` end the row and are kept in its tokens
    (Megatron's rule); `stop_text(text) -> cut or None` ends it on the generated text (the
    cut: where the text stops). `top_p_decay`/`top_p_bound`: Megatron's per-step nucleus
    decay. `ban`: (after_id, banned_id) - `banned_id` cannot follow `after_id`.
    """

    prompt: list[int]
    new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    key: np.ndarray | None = None  # uint32 key data
    stop_ids: tuple[int, ...] = ()
    stop_text: Callable[[list[int]], int | None] | None = None
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    ban: tuple[int, int] | None = None
    prompt_scores: bool = False  # prompt log-probs and top-5 too
    on_token: Callable[["Row"], None] | None = None  # called (on the engine thread) per token
    # results
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float] | None = None  # prompt[1:] given what precedes
    prompt_top: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    cut: int | None = None  # where stop_text cut the text
    queued_at: float = 0.0
    started_at: float | None = None
    cancelled: bool = False
    error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Request:
    """Rows that finish together: `done(rows)` runs on the event loop once all have ended."""

    def __init__(self, rows: list[Row], loop, done: Callable[[list[Row]], None]):
        self.rows, self.loop, self._done, self._left = rows, loop, done, len(rows)
        self.lock = threading.Lock()

    def row_finished(self):
        with self.lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.loop.call_soon_threadsafe(self._done, self.rows)

    def cancel(self):
        for r in self.rows:
            r.cancelled = True


def _top(logp_bv):
    vals, ids = jax.lax.top_k(logp_bv, TOP_N)
    return vals, ids.astype(jnp.int32)


def _programs(graphdef, vocab: int):
    """(prefill(scores), step) as jitted functions; the cache and last logits are donated."""

    def prefill(params, cache, last, slot, tokens_1p, length, scores: bool):
        model = nnx.merge(graphdef, params)
        p = tokens_1p.shape[1]
        positions = jnp.arange(p, dtype=jnp.int32)[None]
        sub = {k: jax.lax.dynamic_slice_in_dim(c, slot, 1, axis=1) for k, c in cache.items()}
        x = model.embed_tokens(tokens_1p, positions, None)
        x, sub = model.run_layers_cached(x, positions, sub)
        cache = {k: jax.lax.dynamic_update_slice_in_dim(cache[k], sub[k], slot, axis=1) for k in cache}
        x_last = jax.lax.dynamic_slice_in_dim(x, length - 1, 1, axis=1)  # [1, 1, d]
        row = model.logits(x_last)[0, 0, :vocab]
        last = jax.lax.dynamic_update_slice_in_dim(last, row[None], slot, axis=0)
        if not scores:
            return cache, last, None
        logp = jax.nn.log_softmax(model.logits(x[:, :-1])[0, :, :vocab], axis=-1)  # [p-1, v]
        chosen = jnp.take_along_axis(logp, tokens_1p[0, 1:, None], axis=-1)[:, 0]
        return cache, last, (chosen, *_top(logp))

    def step(params, cache, last, positions_b, temperature_b, top_k_b, top_p_b, keys_b2, count_b, ban_b):
        model = nnx.merge(graphdef, params)
        last = jnp.where(jnp.arange(vocab)[None] == ban_b[:, None], -1e10, last)
        logp = jax.nn.log_softmax(last, axis=-1)
        # A row's n-th new token draws with fold_in(its key, n): the same alone or batched.
        keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(keys_b2), count_b)
        tok = sample(last, keys, temperature_b, top_k_b, top_p_b)
        chosen = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
        vals, ids = _top(logp)
        logits, cache = model.forward_cached(tok[:, None], positions_b[:, None], cache)
        return cache, logits[:, 0, :vocab], (tok, chosen, vals, ids)

    return (jax.jit(prefill, static_argnums=6, donate_argnums=(1, 2)),
            jax.jit(step, donate_argnums=(1, 2)))


class Engine:
    """`slots` rows decoding together over a cache of `context` positions (see the module
    docstring). `log(message)` receives the compile lines."""

    def __init__(self, graphdef, params, vocab: int, slots: int, context: int, mesh=None, rules=None,
                 continuous: bool = True, log: Callable[[str], None] = print):
        self.graphdef, self.params, self.vocab = graphdef, params, vocab
        self.slots, self.context, self.mesh, self.rules = bucket(slots), context, mesh, rules
        self.continuous, self.log = continuous, log
        self._prefill, self._step = _programs(graphdef, vocab)
        self._compiled: set = set()
        self.queue: queue.Queue = queue.Queue()
        self.active: list[tuple[Row, Request] | None] = [None] * self.slots
        self.steps = 0  # decode steps run (tests and the health page)
        self.joined_running = 0  # rows admitted while other rows were decoding
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.cache = self.last = None

    # ---------------------------------------------------------------- device state

    def _traced(self, fn, *args):
        if self.mesh is None:
            return fn(*args)
        from mlm_jax.parallel import tracing

        with tracing(self.mesh, self.rules):
            return fn(*args)

    def _compile_note(self, what: tuple, text: str):
        if what not in self._compiled:
            self._compiled.add(what)
            self.log(f"compiling {text} (first use of this shape)")
            return time.perf_counter()
        return None

    def warm(self):
        """Allocate the cache and compile the step program and the smallest prefill."""
        graphdef, slots, context = self.graphdef, self.slots, self.context

        def init(params):
            model = nnx.merge(graphdef, params)
            return model.init_cache(slots, context), jnp.zeros((slots, self.vocab), jnp.float32)

        t = time.perf_counter()
        self.cache, self.last = self._traced(jax.jit(init), self.params)
        self._run_step(np.zeros(slots, np.int32), np.zeros(slots, np.float32), np.zeros(slots, np.int32),
                       np.zeros(slots, np.float32), np.zeros((slots, 2), np.uint32), np.zeros(slots, np.int32),
                       np.full(slots, -1, np.int32))
        self._run_prefill(0, [0], False)
        self.log(f"decode ready: {slots} slots x {context} positions, compiled in {time.perf_counter() - t:.1f} s")

    def _run_prefill(self, slot: int, prompt: list[int], scores: bool):
        p = min(bucket(len(prompt), MIN_PROMPT_BUCKET), self.context)
        t = self._compile_note(("prefill", p, scores), f"the prefill for prompts of up to {p} tokens"
                               + (" with prompt log-probs" if scores else ""))
        tokens = np.zeros((1, p), np.int32)
        tokens[0, : len(prompt)] = prompt
        self.cache, self.last, extra = self._traced(self._prefill, self.params, self.cache, self.last,
                                                    np.int32(slot), tokens, np.int32(len(prompt)), scores)
        if extra is not None:
            extra = [np.asarray(x) for x in extra]
        if t is not None:
            self.log(f"compiled the prefill for {p} tokens in {time.perf_counter() - t:.1f} s")
        return extra

    def _run_step(self, positions, temperature, top_k, top_p, keys, counts, ban):
        self.cache, self.last, out = self._traced(self._step, self.params, self.cache, self.last, positions,
                                                  temperature, top_k, top_p, keys, counts, ban)
        return [np.asarray(x) for x in out]

    # ---------------------------------------------------------------- the loop

    def start(self):
        if self.cache is None:
            self.warm()
        self._thread = threading.Thread(target=self._loop, name="mlm_jax-engine", daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, request: Request):
        now = time.perf_counter()
        for r in request.rows:
            r.queued_at = now
            self.queue.put((r, request))

    def _loop(self):
        while not self._stop.is_set():
            try:
                self._admit()
                if any(a is not None for a in self.active):
                    self._decode_step()
            except Exception as e:  # noqa: BLE001 - the rows in flight fail, the engine lives
                self._fail_all(e)

    def _fail_all(self, exc: Exception):
        for i, a in enumerate(self.active):
            if a is not None:
                row, req = a
                row.finish_reason = "error"
                row.error = exc
                self.active[i] = None
                req.row_finished()

    def _admit(self):
        running = any(a is not None for a in self.active)
        if running and not self.continuous:
            return
        while None in self.active:
            try:
                # Block only when nothing decodes (a short timeout to see the stop flag).
                row, req = self.queue.get(timeout=0.05) if not running else self.queue.get_nowait()
            except queue.Empty:
                return
            if row.cancelled:
                self._finish(row, req, "cancelled")
                continue
            slot = self.active.index(None)
            row.started_at = time.perf_counter()
            try:
                extra = self._run_prefill(slot, row.prompt, row.prompt_scores)
            except Exception as e:  # noqa: BLE001 - this row fails alone
                row.error = e
                self._finish(row, req, "error")
                continue
            if extra is not None:
                n = len(row.prompt) - 1
                chosen, vals, ids = extra
                row.prompt_logprobs = [float(x) for x in chosen[:n]]
                row.prompt_top = [list(zip(map(int, i), map(float, v))) for i, v in zip(ids[:n], vals[:n])]
            if row.new_tokens == 0:
                self._finish(row, req, "length")
                continue
            if running:
                self.joined_running += 1
            self.active[slot] = (row, req)
            running = True

    def _decode_step(self):
        b = self.slots
        positions, temperature = np.zeros(b, np.int32), np.zeros(b, np.float32)
        top_k, top_p = np.zeros(b, np.int32), np.zeros(b, np.float32)
        keys, counts, ban = np.zeros((b, 2), np.uint32), np.zeros(b, np.int32), np.full(b, -1, np.int32)
        for i, a in enumerate(self.active):
            if a is None:
                continue
            row, _ = a
            n = len(row.tokens)
            positions[i] = len(row.prompt) + n
            temperature[i], top_k[i], top_p[i] = row.temperature, row.top_k, _top_p_at(row, n)
            if row.key is not None:
                keys[i], counts[i] = row.key, n
            last = row.tokens[-1] if row.tokens else row.prompt[-1]
            if row.ban is not None and last == row.ban[0]:
                ban[i] = row.ban[1]
        tok, chosen, vals, ids = self._run_step(positions, temperature, top_k, top_p, keys, counts, ban)
        self.steps += 1
        for i, a in enumerate(self.active):
            if a is None:
                continue
            row, req = a
            t = int(tok[i])
            row.tokens.append(t)
            row.logprobs.append(float(chosen[i]))
            row.top.append(list(zip(map(int, ids[i]), map(float, vals[i]))))
            reason = None
            if t in row.stop_ids:
                reason = "stop"
            elif row.stop_text is not None and (cut := row.stop_text(row.tokens)) is not None:
                row.cut, reason = cut, "stop"
            elif len(row.tokens) >= row.new_tokens or len(row.prompt) + len(row.tokens) >= self.context:
                reason = "length"
            if row.cancelled:
                reason = "cancelled"
            if reason is None and row.on_token is not None:
                row.on_token(row)
            elif reason is not None:
                self.active[i] = None
                self._finish(row, req, reason)

    def _finish(self, row: Row, req: Request, reason: str):
        row.finish_reason = reason
        if row.on_token is not None:
            row.on_token(row)
        req.row_finished()


def _top_p_at(row: Row, n: int) -> float:
    """Megatron's decayed nucleus for the n-th new token: p * decay^n, not below the bound."""
    p = row.top_p
    if p > 0 and row.top_p_decay > 0:
        for _ in range(n):
            p *= row.top_p_decay
            if row.top_p_bound > 0:
                p = max(p, row.top_p_bound)
    return p
