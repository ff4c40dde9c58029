"""What an unknown flag most likely meant: Megatron's short forms and the names other trainers
use (`--tp`, `--mbs`, `--max-steps`), then a flag it begins (`--hidden` -> `--hidden-size`),
then the closest spelling. `ArgumentParser` (mlm_jax/arguments.py) words the error around it.
"""

from __future__ import annotations

import difflib
from typing import Sequence


def _aliases(target: str, *names: str) -> dict[str, str]:
    return {name: target for name in names}


# Other names of our flags (each suggested only where the command has the target flag).
ALIASES: dict[str, str] = {
    **_aliases("--tensor-model-parallel-size", "--tp", "--tp-size", "--tensor-parallel-size", "--tensor-parallel"),
    **_aliases("--pipeline-model-parallel-size", "--pp", "--pp-size", "--pipeline-parallel-size",
               "--pipeline-parallel"),
    **_aliases("--context-parallel-size", "--cp", "--cp-size", "--context-parallel"),
    **_aliases("--expert-model-parallel-size", "--ep", "--ep-size", "--expert-parallel-size", "--expert-parallel"),
    **_aliases("--expert-tensor-parallel-size", "--etp"),
    **_aliases("--num-virtual-stages-per-pipeline-rank", "--vpp", "--vp", "--virtual-pipeline-model-parallel-size"),
    **_aliases("--sequence-parallel", "--sp"),
    **_aliases("--micro-batch-size", "--mbs", "--micro-batch", "--batch-size", "--micro-bs"),
    **_aliases("--global-batch-size", "--gbs", "--global-batch", "--global-bs"),
    **_aliases("--seq-length", "--seq-len", "--seqlen", "--sequence-length", "--max-seq-len", "--max-seq-length",
               "--context-length", "--block-size"),
    **_aliases("--num-layers", "--layers", "--n-layers", "--n-layer", "--num-hidden-layers"),
    **_aliases("--hidden-size", "--hidden", "--d-model", "--n-embd", "--model-dim", "--dim"),
    **_aliases("--num-attention-heads", "--heads", "--n-heads", "--n-head", "--num-heads"),
    **_aliases("--num-query-groups", "--kv-heads", "--num-kv-heads", "--n-kv-heads", "--num-key-value-heads"),
    **_aliases("--ffn-hidden-size", "--ffn-size", "--intermediate-size", "--ffn-dim"),
    **_aliases("--vocab-size", "--vocab", "--n-vocab"),
    **_aliases("--train-iters", "--steps", "--max-steps", "--iters", "--num-steps", "--train-steps",
               "--max-iters", "--iterations", "--num-iters"),
    **_aliases("--lr-warmup-iters", "--lr-warmup", "--warmup", "--warmup-iters", "--warmup-steps"),
    **_aliases("--lr-warmup-fraction", "--warmup-ratio", "--warmup-fraction"),
    **_aliases("--lr", "--learning-rate"),
    **_aliases("--weight-decay", "--wd"),
    **_aliases("--clip-grad", "--grad-clip", "--max-grad-norm", "--gradient-clipping"),
    **_aliases("--use-distributed-optimizer", "--distributed-optimizer", "--zero1"),
    **_aliases("--save", "--save-dir", "--checkpoint-dir", "--ckpt-dir", "--output-dir"),
    **_aliases("--load", "--resume", "--resume-from"),
    **_aliases("--tokenizer-type", "--tokenizer"),
    **_aliases("--data-path", "--data", "--dataset", "--data-prefix"),
    **_aliases("--mock-data", "--mock", "--synthetic-data"),
}

# Names with no flag behind them: what to do instead (shown where the command has `needs`).
# (why, needs)
EXPLAINED: dict[str, tuple[str, str]] = {
    **{name: ("the data-parallel size is no flag: it is derived, device count / (tensor x pipeline x context "
              "parallel sizes)", "--tensor-model-parallel-size")
       for name in ("--dp", "--dp-size", "--data-parallel-size", "--data-parallel")},
    **{name: ("epochs are not supported: give --train-iters or --train-samples", "--train-iters")
       for name in ("--epochs", "--num-epochs", "--epoch", "--train-epochs")},
    **{name: ("fp32 is the default: leave out --fp16 and --bf16", "--fp16") for name in ("--fp32", "--no-bf16")},
}


def unknown_flag(name: str, known: Sequence[str]) -> str:
    """The error for the unknown flag `name` among the command's `known` long flags."""
    if name in EXPLAINED and EXPLAINED[name][1] in known:
        return f"unknown flag {name}: {EXPLAINED[name][0]}"
    close = _closest(name, known)
    if not close:
        return f"unknown flag {name} (see --help for the flags)"
    if len(close) == 1:
        return f"unknown flag {name}; did you mean {close[0]}?"
    return f"unknown flag {name}; did you mean one of {', '.join(close)}?"


def _closest(name: str, known: Sequence[str]) -> list[str]:
    """The alias's flag; else the flags `name` begins (at a word boundary, up to three, shortest
    first); else the closest spelling (never --help for a flag that is no misspelt --help)."""
    if ALIASES.get(name) in known:
        return [ALIASES[name]]
    begun = sorted((k for k in known if k.startswith(name + "-")), key=len)
    if begun:
        return begun[:3]
    candidates = [k for k in known if k != "--help"] if not "--help".startswith(name[:3]) else list(known)
    return difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
