"""The end of a training run, read as a result: the sample (labelled for what it is), the
figures rounded, where the run folder and the checkpoint are, and the commands to try next on
that checkpoint, each fitted to the model it was given (its positions, its data).

`train.train` calls `end_of_run_sample` after the loop and `done_lines` last.
"""

from __future__ import annotations

import math
import os
import shlex

from mlm_jax.config import Config

PPL_CAP = 20.0  # exp(min(loss, 20)), as the logged perplexity (Megatron's)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, PPL_CAP))


def duration(seconds: float) -> str:
    """58 s, 2 min 3 s, 1 h 4 min."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def shown_path(path: str) -> str:
    """`path` relative to the working directory when it lies below it (the commands to try next
    run from there), else absolute."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def end_of_run_sample(cfg: Config, pz, params, data, n_params: int, iteration: int, log) -> dict | None:
    """A greedy continuation of the start of a held-out sample (real context, not a made-up
    string), from the model in its plain layer order (a pipeline stores its layers permuted).
    Returns {"prompt_ids", "ids"} plus the texts when the tokenizer has any."""
    import jax

    from mlm_jax.generate import greedy, sample_text

    t = cfg.train
    if t.sample_tokens <= 0 or data.valid is None:
        return None
    log(f"> compiling the decoder for a {t.sample_tokens}-token sample ...")
    prompt = [int(i) for i in data.valid[0][: max(8, t.seq_length // 4)]]
    ids = greedy(pz.graphdef, jax.jit(pz.plain)(params), prompt, t.sample_tokens, t.seq_length)
    sample = {"prompt_ids": prompt, "ids": ids}
    what = (f"> sample: the start of a held-out document, continued greedily by this {n_params / 1e6:.2f} M-parameter "
            f"model after {iteration} iterations (a small model soon repeats itself; that is not a failure)")
    try:
        sample.update(prompt=data.tokenizer.detokenize(prompt), continuation=data.tokenizer.detokenize(ids))
    except Exception:  # no tokenizer, or one without text (NullTokenizer): the ids only
        log(f"{what}, as token ids:\n{sample_text(str(prompt), str(ids))}")
        return sample
    log(f"{what}:\n{sample_text(sample['prompt'], sample['continuation'])}")
    return sample


def _valid_loss_text(first: float | None, last: float | None, used_up_at: int | None = None) -> str:
    losses = [v for v in (first, last) if v is not None]
    if not losses:
        return ("no validation" if used_up_at is None else
                f"no validation (the validation data was used up at iteration {used_up_at})")
    loss = " -> ".join(f"{v:.2f}" for v in losses)
    ppl = " -> ".join(f"{perplexity(v):,.0f}" if perplexity(v) >= 100 else f"{perplexity(v):.1f}" for v in losses)
    return f"validation loss {loss} (perplexity {ppl})"


def next_commands(cfg: Config, load_dir: str, data, sample: dict | None) -> list[str]:
    """generate, evaluate and serve on the checkpoint folder `load_dir`, fitted to the run: the
    prompt is the start of the held-out sample, the lengths fit the model's positions, evaluate
    reads the run's own validation data (a single indexed dataset; none for mock or blended data).
    Empty when the checkpoint holds no text tokenizer (the commands could not read a prompt)."""
    tok = data.tokenizer
    if tok is None or not hasattr(tok, "tokenize") or cfg.data.mock_data:
        return []
    load = shlex.quote(shown_path(load_dir))
    positions = cfg.model.max_position_embeddings
    new = max(1, min(32, positions // 2))
    # a whole line of the held-out prompt (its first one may start mid-word)
    lines = [x.strip() for x in ((sample or {}).get("prompt") or "").splitlines() if x.strip()]
    prompt = (lines[1] if len(lines) > 1 else lines[0])[:40] if lines else "The"
    out = [f"python -m mlm_jax.generate --load {load} --prompt {shlex.quote(prompt)} --tokens-to-generate {new}"]
    prefix = getattr(getattr(data.valid, "dataset", None), "path_prefix", None)
    if prefix:
        out.append(f"python -m mlm_jax.evaluate --load {load} --task VALID --valid-data {shlex.quote(shown_path(prefix))}"
                   f" --seq-length {cfg.train.seq_length}   # loss over every document of that dataset")
    out.append(f"python -m mlm_jax.serve --load {load} --port 5000   # then open http://127.0.0.1:5000/")
    return out


def done_lines(cfg: Config, summary: dict, data, elapsed_s: float) -> list[str]:
    """The run's last lines: the result in rounded figures, the run folder, the checkpoint and
    what to try next on it."""
    run_dir = summary["run_dir"]
    valid = _valid_loss_text(summary["first_valid_loss"], summary["final_valid_loss"],
                             summary.get("validation_used_up_at"))
    lines = [f"> done: {valid}; "
             f"iteration {summary['last_iteration']} in {duration(elapsed_s)}; run folder {shown_path(run_dir)}"]
    if summary["checkpoints"]:
        last = summary["checkpoints"][-1]
        metrics = cfg.train.metrics_file or os.path.join(run_dir, "metrics.jsonl")
        lines.append(f"> checkpoint {shown_path(last)}; metrics in {shown_path(metrics)}")
        commands = next_commands(cfg, os.path.dirname(last), data, summary.get("sample"))
        if commands:
            lines.append("> try next, on this checkpoint:")
            lines += [f"    {c}" for c in commands]
    return lines
