"""Text generation with a KV cache: prefill the prompts, then one token per step in one compiled
loop; greedy, temperature, top-k, top-p, per-row seeds, a stop token and per-token log-probs.

    import mlm_jax
    m = mlm_jax.load("runs/.../checkpoints")
    out = m.generate([[1, 2, 3], "a prompt"], max_new_tokens=32, temperature=0.0)
    out[0].tokens, out[0].logprobs, out[1].text

    python -m mlm_jax.generate --load CKPT --prompt "def f(" --tokens-to-generate 32

How one call runs (`Decoder`): prompts are right-padded to a bucket length P and the batch to a
bucket size B (powers of two), the cache holds T = bucket(P + new tokens) positions. One jitted
program per (B, P, T) does the prefill (all prompt tokens at positions 0..P-1, cache slots
written at their positions) and a `lax.while_loop` of decode steps (row i's k-th new token at
position len_i + k). Right padding is harmless: a padded slot lies past its row's position and
is masked by the causal rule until the row's own token overwrites it. Everything that varies
per request (lengths, token counts, sampling settings, seeds, stop tokens) is a traced array,
so requests within a bucket never retrace, and rows are independent: a prompt generates the
same tokens alone or batched with others (the server's batching relies on it).

The cache is [layers, batch, max_len, kv_heads, head_dim], sharded over `tensor` on kv_heads
like the attention heads and over data on batch (`mlm_jax.models.gpt.KV_CACHE`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlm_jax.arguments import ArgumentParser
from mlm_jax.cli import cli
from mlm_jax.data.vocab_check import prompt_outside_vocab
from mlm_jax.errors import RunFailure, UsageError
from mlm_jax.xla_flags import use_cpu_devices

MIN_PROMPT_BUCKET = 8


@dataclasses.dataclass
class Generated:
    """One prompt's result: the new tokens (a stop token included when it ended the row),
    their log-probs under the model (log-softmax of the raw logits), the prompt tokens'
    log-probs (prompt[1:] given what precedes; Megatron's `logprobs` cover prompt and new
    tokens), why it ended ("stop" or "length") and the new text when a tokenizer is known."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    prompt_logprobs: list[float] | None  # None unless asked for
    finish_reason: str
    text: str | None = None


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= max(n, minimum): the static sizes programs are compiled for."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


# ------------------------------------------------------------------------------ sampling


def filter_logits(logits_bv, top_k_b, top_p_b):
    """Logits with everything outside the top-k (k > 0) and the top-p nucleus (p > 0) at -inf.

    The nucleus keeps the most likely tokens until their probability reaches p, and always the
    first (Megatron's rule: a token is dropped when the tokens before it already sum past p).
    """
    v = logits_bv.shape[-1]
    sorted_bv = -jnp.sort(-logits_bv, axis=-1)  # [b, v] descending
    kth = jnp.take_along_axis(sorted_bv, jnp.clip(top_k_b - 1, 0, v - 1)[:, None], axis=-1)  # [b, 1]
    keep = jnp.where((top_k_b > 0)[:, None], logits_bv >= kth, True)
    sorted_bv = jnp.where(jnp.where((top_k_b > 0)[:, None], sorted_bv >= kth, True), sorted_bv, -jnp.inf)
    probs = jax.nn.softmax(sorted_bv, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
    kept = jnp.where(before <= top_p_b[:, None], sorted_bv, jnp.inf)
    floor = jnp.min(kept, axis=-1, keepdims=True)  # the least likely token of the nucleus
    keep = keep & jnp.where((top_p_b > 0)[:, None], logits_bv >= floor, True)
    return jnp.where(keep, logits_bv, -jnp.inf)


def sample(logits_bv, keys_b, temperature_b, top_k_b, top_p_b):
    """Next tokens [b]: argmax where temperature is 0, else a draw from the filtered,
    temperature-scaled distribution with each row's own key."""
    greedy = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)

    def drawn():
        scaled = logits_bv / jnp.where(temperature_b > 0, temperature_b, 1.0)[:, None]
        tokens = jax.vmap(jax.random.categorical)(keys_b, filter_logits(scaled, top_k_b, top_p_b))
        return jnp.where(temperature_b > 0, tokens.astype(jnp.int32), greedy)

    # An all-greedy batch skips the sort and the draw (a vocab-wide sort per row and step).
    return jax.lax.cond(jnp.any(temperature_b > 0), drawn, lambda: greedy)


def _token_logprob(logits_bv, tokens_b):
    return jnp.take_along_axis(jax.nn.log_softmax(logits_bv, axis=-1), tokens_b[:, None], axis=-1)[:, 0]


# ------------------------------------------------------------------------------ the program


def _prefill(model, tokens_bp, lengths_b, max_len, vocab, prompt_logprobs: bool):
    """(cache, logits of each row's last prompt token [b, v], prompt log-probs [b, p-1]; zeros
    unless `prompt_logprobs`: then the head runs on every prompt position, not only the last)."""
    b, p = tokens_bp.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    x = model.embed_tokens(tokens_bp, positions, None)
    x, cache = model.run_layers_cached(x, positions, model.init_cache(b, max_len))  # x [b, p, d]
    x_last = jnp.take_along_axis(x, (lengths_b - 1)[:, None, None], axis=1)  # [b, 1, d]
    last = model.logits(x_last)[:, 0, :vocab]  # [b, v]
    if not prompt_logprobs:
        return cache, last, jnp.zeros((b, p - 1), jnp.float32)
    logp = jax.nn.log_softmax(model.logits(x[:, :-1])[..., :vocab], axis=-1)  # [b, p-1, v]
    prompt_lp = jnp.take_along_axis(logp, tokens_bp[:, 1:, None], axis=-1)[..., 0]  # [b, p-1]
    return cache, last, prompt_lp


def _decode_program(graphdef, vocab: int, max_len: int, prompt_logprobs: bool):
    """The jitted prefill + decode loop for one bucket (see the module docstring)."""

    def run(params, tokens_bp, lengths_b, new_b, temperature_b, top_k_b, top_p_b, stop_b, keys_b2):
        model = nnx.merge(graphdef, params)
        cache, last, prompt_lp = _prefill(model, tokens_bp, lengths_b, max_len, vocab, prompt_logprobs)
        b = tokens_bp.shape[0]
        keys = jax.random.wrap_key_data(keys_b2)
        out_tok = jnp.zeros((b, max_len), jnp.int32)
        out_lp = jnp.zeros((b, max_len), jnp.float32)
        state = (0, out_tok, out_lp, cache, last, new_b <= 0, jnp.zeros((b,), jnp.int32))

        def cond(s):
            return (s[0] < max_len) & ~jnp.all(s[5])

        def body(s):
            i, out_tok, out_lp, cache, last, done, count = s
            step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, i)
            tok = sample(last, step_keys, temperature_b, top_k_b, top_p_b)
            out_tok = out_tok.at[:, i].set(tok)
            out_lp = out_lp.at[:, i].set(_token_logprob(last, tok))
            count = count + (~done).astype(jnp.int32)
            done = done | (tok == stop_b) | (count >= new_b)
            logits, cache = model.forward_cached(tok[:, None], (lengths_b + i)[:, None], cache)
            return i + 1, out_tok, out_lp, cache, logits[:, 0, :vocab], done, count

        _, out_tok, out_lp, _, _, _, count = jax.lax.while_loop(cond, body, state)
        return out_tok, out_lp, count, prompt_lp

    return jax.jit(run)


class Decoder:
    """Cached decoding for one model's parameters; compiled programs are kept per bucket.

    `mesh`/`rules`: the mesh the parameters live on and the activation rules (None: run
    without sharding constraints, as for parameters on one device).
    """

    def __init__(self, graphdef, params, vocab_size: int, max_positions: int | None = None,
                 mesh=None, rules=None):
        self.graphdef, self.params, self.vocab = graphdef, params, vocab_size
        self.max_positions, self.mesh, self.rules = max_positions, mesh, rules
        self._programs: dict = {}

    def programs(self) -> int:
        """How many bucket programs exist (a test checks requests within a bucket reuse one)."""
        return len(self._programs)

    def _check(self, prompts, new_tokens):
        if not prompts:
            raise UsageError("no prompts given")
        for i, (p, n) in enumerate(zip(prompts, new_tokens)):
            if len(p) == 0:
                raise UsageError(f"prompt {i} is empty: give at least one token (e.g. a BOS token)")
            problem = prompt_outside_vocab(p, self.vocab)
            if problem is not None:
                raise UsageError(f"prompt {i}: {problem}")
            if n < 0:
                raise UsageError(f"max_new_tokens must be >= 0, got {n}")
            if self.max_positions is not None and len(p) + n > self.max_positions:
                raise UsageError(f"prompt {i}: {len(p)} prompt + {n} new tokens exceed the model's "
                                 f"{self.max_positions} positions")

    def __call__(self, prompts: Sequence[Sequence[int]], max_new_tokens, temperature=0.0, top_k=0,
                 top_p=0.0, seeds=0, stop_token=None, prompt_logprobs: bool = False) -> list[Generated]:
        """Generate for each prompt (token-id lists). Every setting is one value for all rows or
        a list with one per row. Row i's random key is fold_in(key(seed), i) for one int `seeds`;
        a list gives each row a seed or a (seed, index) pair (the server: a request's seed and
        the prompt's index in it), so a row draws the same tokens whatever it is batched with.
        `prompt_logprobs`: also score the prompt tokens (`Generated.prompt_logprobs`)."""
        rows = len(prompts)
        per_row = lambda x: list(x) if isinstance(x, (list, tuple)) else [x] * rows  # noqa: E731
        new = [int(n) for n in per_row(max_new_tokens)]
        prompts = [[int(t) for t in p] for p in prompts]
        self._check(prompts, new)
        seeds = [(seeds, i) for i in range(rows)] if not isinstance(seeds, (list, tuple)) else seeds
        keys = [_row_key(*(s if isinstance(s, tuple) else (s, 0))) for s in seeds]
        stop = [-1 if s is None else int(s) for s in per_row(stop_token)]
        b, p = bucket(rows), bucket(max(map(len, prompts)), MIN_PROMPT_BUCKET)
        t = bucket(p + max(new), MIN_PROMPT_BUCKET)
        pad = b - rows
        tokens = np.zeros((b, p), np.int32)
        for i, row in enumerate(prompts):
            tokens[i, : len(row)] = row
        arrays = (tokens, np.array([len(r) for r in prompts] + [1] * pad, np.int32),
                  np.array(new + [0] * pad, np.int32),
                  np.array(per_row(temperature) + [0.0] * pad, np.float32),
                  np.array(per_row(top_k) + [0] * pad, np.int32),
                  np.array(per_row(top_p) + [0.0] * pad, np.float32),
                  np.array(stop + [-1] * pad, np.int32),
                  np.stack(keys + [keys[0]] * pad).astype(np.uint32))
        out_tok, out_lp, count, prompt_lp = self._run((b, p, t, bool(prompt_logprobs)), arrays)
        return [_result(prompts[i], out_tok[i], out_lp[i], int(count[i]), prompt_lp[i] if prompt_logprobs else None,
                        stop[i])
                for i in range(rows)]

    def _run(self, shape, arrays):
        if shape not in self._programs:
            self._programs[shape] = _decode_program(self.graphdef, self.vocab, shape[2], shape[3])
        fn = self._programs[shape]
        if self.mesh is None:
            outs = fn(self.params, *arrays)
        else:
            from mlm_jax.parallel import tracing

            with tracing(self.mesh, self.rules):
                outs = fn(self.params, *arrays)
        return [np.asarray(x) for x in outs]


def _row_key(seed, index: int) -> np.ndarray:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise UsageError(f"seed must be a non-negative integer, got {seed!r}")
    return np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(int(seed)), index)))


def _result(prompt, toks, lps, count, prompt_lp, stop) -> Generated:
    toks = [int(x) for x in toks[:count]]
    reason = "stop" if toks and toks[-1] == stop else "length"
    scored = None if prompt_lp is None else [float(x) for x in prompt_lp[: len(prompt) - 1]]
    return Generated(prompt, toks, [float(x) for x in lps[:count]], scored, reason)


# ------------------------------------------------------------------------------ train's sample


def greedy(graphdef: nnx.GraphDef, params: dict, prompt: list[int], new_tokens: int,
           window: int) -> list[int]:
    """`new_tokens` argmax tokens after `prompt` with the KV cache (train's end-of-run sample).

    Prompt and continuation fit in `window` positions: a longer prompt keeps its last
    `window - new_tokens` tokens (and the new tokens are capped at window - 1).
    """
    cfg = nnx.merge(graphdef, params).cfg
    new_tokens = max(0, min(new_tokens, window - 1))
    prompt = list(prompt)[-(window - new_tokens):] or [0]
    return Decoder(graphdef, params, cfg.vocab_size)([prompt], new_tokens)[0].tokens


def greedy_uncached(forward, prompt: list[int], new_tokens: int, window: int) -> list[int]:
    """Reference decoding without a cache (tests, benchmark): each new token is the argmax of
    the full-sequence logits of everything so far, `forward(tokens [1, window]) -> [1, window,
    vocab]` on a fixed window (one compile; causal, so the zero padding after is never seen)."""
    tokens = list(prompt)
    if len(tokens) + new_tokens > window:
        raise ValueError(f"{len(tokens)} + {new_tokens} tokens exceed the window {window}")
    buf = np.zeros((1, window), np.int32)
    buf[0, : len(tokens)] = tokens
    for _ in range(new_tokens):
        logits = np.asarray(forward(buf))
        tokens.append(int(np.argmax(logits[0, len(tokens) - 1])))
        buf[0, len(tokens) - 1] = tokens[-1]
    return tokens[len(prompt):]


def sample_text(prompt: str, continuation: str, number: int | None = None, title: str = "") -> str:
    """How a prompt and its continuation print, train's end-of-run sample and generate's outputs
    alike: a `> {title}prompt[ n]:` line, the prompt below it, a `> continuation[ n]:` line,
    the continuation below it."""
    n = "" if number is None else f" {number}"
    return f"> {title}prompt{n}:\n{prompt}\n> continuation{n}:\n{continuation}"


# ------------------------------------------------------------------------------ the CLI


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens-to-generate", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k filter")
    p.add_argument("--top-p", type=float, default=0.0, help="0: no nucleus filter")
    p.add_argument("--seed", type=int, default=0)


def _prompt_ids(text: str) -> list[int]:
    """The token ids of one --prompt-ids value; a UsageError naming the word that is not one."""
    words = text.split()
    bad = next((w for w in words if not w.lstrip("-").isdigit()), None)
    if bad is not None:
        raise UsageError(f"--prompt-ids {text!r}: {bad!r} is not a token id; give space-separated "
                         "integers, e.g. --prompt-ids '1 2 3'")
    return [int(w) for w in words]


def check_sampling(temperature: float, top_k: int, top_p: float, new_tokens: int, flags=True) -> None:
    """UsageError naming the flag (or field) for an invalid sampling setting."""
    name = (lambda f: "--" + f.replace("_", "-")) if flags else (lambda f: f)
    if new_tokens < 0:
        raise UsageError(f"{name('tokens_to_generate')} must be >= 0, got {new_tokens}")
    if not temperature >= 0:
        raise UsageError(f"{name('temperature')} must be >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise UsageError(f"{name('top_k')} must be >= 0 (0: off), got {top_k}")
    if not 0.0 <= top_p <= 1.0:
        raise UsageError(f"{name('top_p')} must be in [0, 1] (0: off), got {top_p}")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--load, --tensor-model-parallel-size and the tokenizer flags (for checkpoints without one)."""
    from mlm_jax.data.preprocess import add_tokenizer_args

    p.add_argument("--load", required=True, help="an mlm_jax checkpoint or save folder, a Hugging Face folder, "
                   "or a Megatron-LM checkpoint (torch_dist or legacy)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    add_tokenizer_args(p)


def load_model(args):
    """The LoadedModel for `add_model_args` flags; UsageError naming --load when there is none."""
    import mlm_jax
    from mlm_jax.config import ParallelConfig
    from mlm_jax.paths import not_there
    from mlm_jax.sharding.mesh import make_mesh

    why = not_there(args.load)
    if why:
        raise UsageError(f"--load {args.load}: {why}; give a checkpoint, save, Hugging Face or Megatron-LM folder")
    tp = args.tensor_model_parallel_size
    if tp < 1 or jax.device_count() % tp:
        n, platform = jax.device_count(), jax.devices()[0].platform
        more = (f"; on a CPU, MLM_JAX_CPU_DEVICES={tp} (or a multiple) gives that many devices"
                if platform == "cpu" else "")
        raise UsageError(f"--tensor-model-parallel-size {tp} must divide the {n} {platform} device(s){more}")
    try:
        m = mlm_jax.load(args.load, mesh=make_mesh(ParallelConfig(tensor_model_parallel_size=tp)))
    except FileNotFoundError as e:
        raise UsageError(f"--load {args.load}: {e}") from e
    if args.tokenizer_type is not None:
        from mlm_jax.data.preprocess import tokenizer_kwargs_from
        from mlm_jax.data.tokenizers import make_tokenizer

        m.tokenizer = make_tokenizer(**tokenizer_kwargs_from(args))
    return m


@cli
def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m mlm_jax.generate", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", default=[], help="a prompt as space-separated token ids")
    p.add_argument("--logprobs", action="store_true", help="print each new token's log-prob")
    add_sampling_args(p)
    args = p.parse_args(argv)
    use_cpu_devices()
    check_sampling(args.temperature, args.top_k, args.top_p, args.tokens_to_generate)
    if not args.prompt and not args.prompt_ids:
        raise UsageError("give --prompt TEXT or --prompt-ids 'ID ID ...'")
    for text in args.prompt:  # bytes that are not UTF-8 reach Python as lone surrogates
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raw = text[e.start].encode("utf-8", "surrogateescape")
            raise UsageError(f"--prompt: not UTF-8 text (byte 0x{raw.hex()} at character {e.start}); give the "
                             "prompt in UTF-8, or its token ids with --prompt-ids") from None
    ids = [_prompt_ids(s) for s in args.prompt_ids]
    m = load_model(args)
    if args.prompt and m.tokenizer is None:
        raise UsageError(f"--prompt: {args.load} carries no tokenizer; give --tokenizer-type "
                         f"(and its files) or --prompt-ids")
    for given, row in zip(args.prompt_ids, ids):
        problem = prompt_outside_vocab(row, m.config.vocab_size)
        if problem is not None:
            raise UsageError(f"--prompt-ids {given!r}: {problem}")
    outs = m.generate(list(args.prompt) + ids, max_new_tokens=args.tokens_to_generate,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed, logprobs=True)
    prompts = list(args.prompt) + [" ".join(map(str, row)) for row in ids]
    for i, out in enumerate(outs, 1):  # NaN logits sample token 0 forever: no result to print
        if not np.all(np.isfinite(out.logprobs)):
            raise RunFailure(f"--load {args.load}: the model's outputs are not finite (NaN or inf) for prompt {i}: "
                             "its weights hold non-finite values (a diverged run?); load an earlier checkpoint "
                             "(its iteration folder)")
    for i, (prompt, out) in enumerate(zip(prompts, outs), 1):
        print(sample_text(prompt, out.text if out.text is not None else " ".join(map(str, out.tokens)), i))
        if args.logprobs:
            print("logprobs: " + " ".join(f"{x:.4f}" for x in out.logprobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
