"""Zero-shot evaluation with Megatron's definitions (its tasks/zeroshot_gpt): LAMBADA, WIKITEXT103
and VALID (loss on an indexed dataset).

    python -m mlm_jax.evaluate --task WIKITEXT103 --valid-data wiki.test.tokens --load CKPT \\
        --seq-length 1024 --micro-batch-size 8 [--overlapping-eval 32] [tokenizer flags]
    python -m mlm_jax.evaluate --task LAMBADA --valid-data lambada_test.jsonl --load CKPT \\
        --seq-length 1024 --micro-batch-size 8 [--strict-lambada]

Definitions (as Megatron computes them):
  - WIKITEXT103: the file is read whole; its word count is the number of " "-separated pieces of
    the stripped text; the text goes through the wikitext detokenizer, then the tokenizer. Windows
    of seq_length + 1 tokens start every `overlapping-eval` tokens (0 or the seq length: no
    overlap); the first window scores all its targets, each later one only its last
    `overlapping-eval`; short windows are padded with the EOD token and the padding not scored.
    avg loss = summed loss / (tokens - 1); ppl = exp(min(20, loss)); token ratio =
    (tokens - 1) / (words - 1); adjusted ppl = exp(min(20, loss * ratio)).
  - LAMBADA: one JSON object per line, its "text". Non-strict: the text tokenized, the last
    token is the target. Strict: the last whitespace-separated word is the target, tokenized on
    its own with a leading space, after the stripped text before it. A sample is correct when
    the argmax at every target position is the target token.
  - VALID: an indexed dataset's documents concatenated and scored in non-overlapping windows
    (avg loss and ppl).

Results print as Megatron's line and go to --output-json (default: beside nothing, stdout only).
"""

from __future__ import annotations

import io
import json
import math
import re
import sys
from typing import Sequence

import numpy as np

from mlm_jax.arguments import ArgumentParser
from mlm_jax.cli import cli
from mlm_jax.errors import RunFailure, UsageError
from mlm_jax.paths import not_there

TASKS = ("LAMBADA", "WIKITEXT103", "VALID")

# ------------------------------------------------------------------------------ detokenizer

# Megatron's wikitext detokenizer as data: (literal or regex, replacement) applied in order.
_WIKITEXT_RULES: tuple[tuple[str, str, str], ...] = (
    ("str", "s '", "s'"),
    ("re", r"/' [0-9]/", r"/'[0-9]/"),
    ("str", " @-@ ", "-"),
    ("str", " @,@ ", ","),
    ("str", " @.@ ", "."),
    ("str", " : ", ": "),
    ("str", " ; ", "; "),
    ("str", " . ", ". "),
    ("str", " ! ", "! "),
    ("str", " ? ", "? "),
    ("str", " , ", ", "),
    ("re", r"\(\s*([^\)]*?)\s*\)", r"(\1)"),
    ("re", r"\[\s*([^\]]*?)\s*\]", r"[\1]"),
    ("re", r"{\s*([^}]*?)\s*}", r"{\1}"),
    ("re", r"\"\s*([^\"]*?)\s*\"", r'"\1"'),
    ("re", r"'\s*([^']*?)\s*'", r"'\1'"),
    ("str", "= = = =", "===="),
    ("str", "= = =", "==="),
    ("str", "= =", "=="),
    ("str", " \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    ("str", " \n", "\n"),
    ("str", "\n ", "\n"),
    ("str", " N ", " 1 "),
    ("str", " 's", "'s"),
)


def wikitext_detokenize(text: str) -> str:
    """WikiText's tokenized text back to plain text (spaces around punctuation, @-@ etc.)."""
    for kind, old, new in _WIKITEXT_RULES:
        text = re.sub(old, new, text) if kind == "re" else text.replace(old, new)
    return text


# ------------------------------------------------------------------------------ datasets


def lm_windows(tokens: Sequence[int], seq_length: int, overlap: int, pad: int):
    """(tokens [n, seq+1], loss mask [n, seq]) of the overlapping-window LM evaluation."""
    stride = max(1, overlap or seq_length)
    targets = len(tokens) - 1
    n = max(math.ceil(max(targets - stride, 0) / stride) + 1, 1)
    rows = np.full((n, seq_length + 1), pad, np.int64)
    mask = np.zeros((n, seq_length), np.float32)
    for i in range(n):
        piece = tokens[i * stride: i * stride + seq_length + 1]
        rows[i, : len(piece)] = piece
        mask[i, : len(piece) - 1] = 1
        if stride != seq_length and i > 0:
            mask[i, :-stride] = 0  # earlier windows scored these targets already
    return rows, mask


def lambada_sample(text: str, tokenizer, strict: bool) -> tuple[list[int], list[int]]:
    """(context tokens, target tokens) of one LAMBADA passage."""
    if not strict:
        ids = list(tokenizer.tokenize(text))
        return ids[:-1], ids[-1:]
    word = text.split()[-1]
    start = text.rfind(word)
    return list(tokenizer.tokenize(text[:start].strip())), list(tokenizer.tokenize(" " + word))


def lambada_windows(samples, seq_length: int, pad: int):
    """(tokens [n, seq+1], mask [n, seq]): context + target, the target positions scored."""
    rows = np.full((len(samples), seq_length + 1), pad, np.int64)
    mask = np.zeros((len(samples), seq_length), np.float32)
    for i, (context, target) in enumerate(samples):
        ids = context + target
        if not context or not target:
            raise UsageError(f"--valid-data: LAMBADA sample {i} has no context or no target tokens")
        if len(ids) > seq_length + 1:
            raise UsageError(f"--valid-data: LAMBADA sample {i} has {len(ids)} tokens, more than "
                             f"--seq-length {seq_length} + 1")
        rows[i, : len(ids)] = ids
        mask[i, len(context) - 1: len(ids) - 1] = 1
    return rows, mask


_FORMATS = {"LAMBADA": "a LAMBADA .jsonl file (one JSON object with a \"text\" per line)",
            "WIKITEXT103": "a WikiText-103 test text file (wiki.test.tokens)"}


def read_text(path: str, task: str) -> str:
    """The file's text; a UsageError naming --valid-data and the format `task` reads when it is
    not UTF-8 text (e.g. a .bin given to a text task)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--valid-data {path}: not UTF-8 text (byte {e.start}: {e.reason}); --task {task} "
                         f"reads {_FORMATS[task]}") from None


def read_lambada(path: str, tokenizer, strict: bool):
    samples = []
    # StringIO splits lines as a file opened in text mode does (not str.splitlines' extra breaks)
    for n, line in enumerate(io.StringIO(read_text(path, "LAMBADA"), newline=None), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--valid-data {path} line {n}: not a JSON object with a \"text\" ({e})") from e
        samples.append(lambada_sample(text, tokenizer, strict))
    if not samples:
        raise UsageError(f"--valid-data {path}: no samples")
    return samples


def read_wikitext(path: str, tokenizer) -> tuple[list[int], int]:
    """(tokens of the detokenized text, the word count Megatron's token ratio divides by)."""
    text = read_text(path, "WIKITEXT103")
    words = len(text.strip().split(" "))
    return list(tokenizer.tokenize(wikitext_detokenize(text))), words


def read_indexed(prefix: str, vocab_size: int, load: str) -> list[int]:
    """The dataset's tokens, its ids checked against the model's vocab first (training's check,
    `vocab_check.check_token_ids`: one scan per .bin, cached)."""
    from mlm_jax.data.gpt_dataset import index_cache_dir
    from mlm_jax.data.indexed_dataset import IndexedDataset, exists
    from mlm_jax.data.vocab_check import check_token_ids

    if not exists(prefix):
        raise UsageError(f"--valid-data {prefix}: no {prefix}.bin/.idx indexed dataset")
    ds = IndexedDataset(prefix)
    check_token_ids(ds, vocab_size, index_cache_dir(prefix, None), f"the vocab of --load {load}")
    return np.concatenate([np.asarray(ds[i], np.int64) for i in range(len(ds))] or [np.zeros(0, np.int64)]).tolist()


# ------------------------------------------------------------------------------ scoring


class Scorer:
    """Per-token losses and argmax hits of a LoadedModel on [batch, seq+1] windows, one compiled
    program for the micro-batch shape (rows split over data, the model over tensor)."""

    def __init__(self, model):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from mlm_jax.config import Config
        from mlm_jax.models.gpt import cross_entropy
        from mlm_jax.models.build import abstract_model

        self.model = model
        graphdef, _, _ = abstract_model(Config(model=model.config))
        vocab = model.config.vocab_size

        def score(params, rows):
            logits = nnx.merge(graphdef, params)(rows[:, :-1])[..., :vocab]  # [b, s, v]
            labels = rows[:, 1:]
            return cross_entropy(logits, labels), (jnp.argmax(logits, -1) == labels)

        self._fn = jax.jit(score)

    def __call__(self, rows: np.ndarray, micro_batch: int):
        """(losses [n, seq], hits [n, seq] bool) for all rows, micro_batch rows at a time: each
        micro batch is dispatched before the previous one's results are read back, so the host's
        work overlaps the device's; a progress bar on stderr when there are many."""
        import jax
        from jax.sharding import NamedSharding
        from tqdm import tqdm

        from mlm_jax.parallel import tracing
        from mlm_jax.sharding.rules import activation_rules
        from mlm_jax.sharding.specs import tokens_spec

        m = self.model
        sharding = NamedSharding(m.mesh, tokens_spec(micro_batch, dict(m.mesh.shape)))
        losses, hits, in_flight = [], [], []

        def read_back():
            (loss, hit), n = in_flight.pop(0)
            losses.append(np.asarray(loss, np.float64)[:n])
            hits.append(np.asarray(hit)[:n])

        with tqdm(total=len(rows), unit=" windows", desc="evaluate", file=sys.stderr, mininterval=2.0,
                  disable=len(rows) < 64 * micro_batch, dynamic_ncols=True) as bar:
            for start in range(0, len(rows), micro_batch):
                chunk = np.zeros((micro_batch, rows.shape[1]), np.int32)
                part = rows[start: start + micro_batch]
                chunk[: len(part)] = part
                with tracing(m.mesh, activation_rules(False)):
                    in_flight.append((self._fn(m.params, jax.device_put(chunk, sharding)), len(part)))
                if len(in_flight) > 2:
                    read_back()
                bar.update(len(part))
            while in_flight:
                read_back()
        return np.concatenate(losses), np.concatenate(hits)


def evaluate(model, task: str, path: str, seq_length: int, micro_batch: int, overlap: int = 32,
             strict: bool = False, tokenizer=None) -> dict:
    """The task's results (see the module docstring) as a dict."""
    tok = tokenizer or model.tokenizer
    if task != "VALID" and tok is None:
        raise UsageError(f"--task {task}: {model.path} carries no tokenizer; give --tokenizer-type and its files")
    pad = getattr(tok, "eod", 0) if tok is not None else 0
    scorer = Scorer(model)
    if task == "LAMBADA":
        rows, mask = lambada_windows(read_lambada(path, tok, strict), seq_length, pad)
        _, hits = scorer(rows, micro_batch)
        correct = int(np.sum(np.all(hits | (mask == 0), axis=1)))
        return {"task": task, "strict": strict, "number_correct": correct, "total_examples": len(rows),
                "avg_accuracy": correct / len(rows)}
    if task == "WIKITEXT103":
        tokens, words = read_wikitext(path, tok)
    else:
        tokens, words = read_indexed(path, model.config.vocab_size, model.path), None
        overlap = seq_length
    if len(tokens) < 2:
        raise UsageError(f"--valid-data {path}: fewer than 2 tokens")
    rows, mask = lm_windows(tokens, seq_length, overlap, pad)
    losses, _ = scorer(rows, micro_batch)
    loss = float(np.sum(losses * mask)) / (len(tokens) - 1)
    if not math.isfinite(loss):  # never a NaN result with exit 0
        raise RunFailure(f"--load {model.path}: the model's loss on {path} is {loss} (its weights or activations "
                         "are not finite); no result is written")
    out = {"task": task, "avg_loss": loss, "ppl": math.exp(min(20.0, loss)), "tokens": len(tokens),
           "windows": len(rows), "overlapping_eval": overlap}
    if words is not None:
        ratio = (len(tokens) - 1) / max(words - 1, 1)
        out.update(words=words, token_ratio=ratio, adjusted_ppl=math.exp(min(20.0, loss * ratio)))
    return out


def result_line(r: dict) -> str:
    """Megatron's result line for the task."""
    if r["task"] == "LAMBADA":
        return (f" validation results on LAMBADA | number correct: {r['number_correct']:.4E} | "
                f"total examples: {r['total_examples']:.4E} | avg accuracy: {r['avg_accuracy']:.4E}")
    line = f" validation results on {r['task']} | avg loss: {r['avg_loss']:.4E} | ppl: {r['ppl']:.4E} | "
    if "adjusted_ppl" in r:
        line += f"adjusted ppl: {r['adjusted_ppl']:.4E} | token ratio: {r['token_ratio']} |"
    return line


@cli
def main(argv: Sequence[str] | None = None) -> int:
    from mlm_jax.generate import add_model_args, load_model
    from mlm_jax.paths import writable_file
    from mlm_jax.xla_flags import use_cpu_devices

    p = ArgumentParser(prog="python -m mlm_jax.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--valid-data", required=True, help="LAMBADA .jsonl, WikiText file, or an indexed dataset prefix")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--overlapping-eval", type=int, default=32)
    p.add_argument("--strict-lambada", action="store_true")
    p.add_argument("--output-json", default=None, help="write the results here")
    add_model_args(p)
    args = p.parse_args(argv)
    use_cpu_devices()
    if args.seq_length < 1:
        raise UsageError(f"--seq-length must be >= 1, got {args.seq_length}")
    if args.micro_batch_size < 1:
        raise UsageError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    if args.task == "WIKITEXT103" and not 0 <= args.overlapping_eval <= args.seq_length:
        raise UsageError(f"--overlapping-eval must be in [0, --seq-length {args.seq_length}], "
                         f"got {args.overlapping_eval}")
    why = not_there(args.valid_data, "file") if args.task != "VALID" else None
    if why:
        raise UsageError(f"--valid-data {args.valid_data}: {why}")
    if args.output_json:  # before the model loads, not after the whole evaluation
        writable_file(args.output_json, "--output-json")
    model = load_model(args)
    m = model.config
    if m.position_embedding_type == "learned_absolute" and args.seq_length > m.max_position_embeddings:
        raise UsageError(f"--seq-length {args.seq_length} exceeds the model's {m.max_position_embeddings} positions")
    r = evaluate(model, args.task, args.valid_data, args.seq_length, args.micro_batch_size,
                 args.overlapping_eval, args.strict_lambada)
    print(result_line(r))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    from mlm_jax.xla_flags import keep_host_memory

    keep_host_memory()  # this process's own allocator: keep a batch's freed memory for the next
    sys.exit(main())
