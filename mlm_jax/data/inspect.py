"""Print training samples in training order: what did the model see at iteration k?

    python -m mlm_jax.data.inspect --data-path out_text_document --split 969,30,1 \\
        --seq-length 1024 --seed 1234 --train-samples 32000 --show 0:4 \\
        [--json] [--tokenizer-type ... --tokenizer-model/--vocab-file/--merge-file ...]

prints training samples I..J-1 (each seq_length + 1 tokens) and, with a tokenizer, their text.
Iteration k of a run with global batch size B consumed samples [k*B, (k+1)*B). With `--json`
the output is one JSON list of token lists, for comparing with Megatron-LM's order.
`--train-samples` must be the run's (train_iters * global_batch_size), since the number of
epochs, and so the order, depends on it. `--context-parallel-size C` (> 1) adds what each
context rank holds of every sample's input tokens: its two load-balanced chunks (rank i: chunks i
and 2C-1-i of 2C), in the order the rank stores them (with `--json`: per sample, a list of C
token lists).
"""

from __future__ import annotations

import argparse
import json
import sys

from mlm_jax import errors
from mlm_jax.cli import cli
from mlm_jax.arguments import ArgumentParser
from mlm_jax.config import DataConfig
from mlm_jax.data.builder import build_split
from mlm_jax.data.gpt_dataset import DatasetError
from mlm_jax.data.preprocess import add_tokenizer_args


def _range(text: str) -> tuple[int, int]:
    try:
        i, j = text.split(":")
        i, j = int(i), int(j)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--show takes I:J (samples I..J-1), got {text!r}") from None
    if not 0 <= i < j:
        raise argparse.ArgumentTypeError(f"--show {text}: need 0 <= I < J")
    return i, j


def _context_chunks(sample: list[int], cp: int) -> list[list[int]]:
    """The input tokens (sample[:-1]) each context rank holds, in its stored order."""
    from mlm_jax.parallel.chunks import seq_order

    inputs = sample[:-1]
    order = seq_order(len(inputs), cp).reshape(cp, -1)  # [rank, its tokens' original indices]
    return [[inputs[k] for k in row] for row in order]


@cli
def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    train_samples = _train_samples(p, args)
    dataset, tokenizer = build_split(_data_config(args), "train", args.seq_length, args.seed, train_samples,
                                     vocab_size=args.vocab_size, tokenizer_optional=True)
    if dataset is None:
        raise DatasetError(f"--split {args.split}: the train split is empty")
    i, j = args.show
    if j > len(dataset):
        raise DatasetError(f"--show {i}:{j} but the train split has {len(dataset)} samples")
    samples = [dataset[k].tolist() for k in range(i, j)]
    cp = args.context_parallel_size
    if cp < 1 or (cp > 1 and args.seq_length % (2 * cp)):
        raise errors.UsageError(f"--seq-length {args.seq_length} is not divisible by 2 x "
                                f"--context-parallel-size {cp} = {2 * cp}")
    if args.json:
        print(json.dumps([_context_chunks(t, cp) for t in samples] if cp > 1 else samples))
        return 0
    _print_samples(args, range(i, j), samples, tokenizer)
    return 0


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m mlm_jax.data.inspect", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", nargs="+", default=[])
    p.add_argument("--train-data-path", nargs="+", default=[])
    p.add_argument("--mock-data", action="store_true")
    p.add_argument("--split", default="969,30,1")
    p.add_argument("--data-cache-path", default=None)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--train-samples", type=int, default=None)
    p.add_argument("--train-iters", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--show", type=_range, required=True, metavar="I:J")
    p.add_argument("--json", action="store_true")
    p.add_argument("--context-parallel-size", type=int, default=1)
    add_tokenizer_args(p)
    return p


def _train_samples(p: ArgumentParser, args) -> int:
    """--train-samples, or --train-iters x --global-batch-size; usage errors for sizes too small."""
    train_samples = args.train_samples
    if train_samples is None:
        if args.train_iters is None or args.global_batch_size is None:
            p.error("give --train-samples, or --train-iters and --global-batch-size")
        train_samples = args.train_iters * args.global_batch_size
    for flag, value, low in [("--seq-length", args.seq_length, 2), ("--train-samples", train_samples, 1),
                             ("--global-batch-size", args.global_batch_size, 1)]:
        if value is not None and value < low:
            p.error(f"{flag} must be at least {low}, got {value}")
    return train_samples


def _data_config(args) -> DataConfig:
    return DataConfig(
        data_path=tuple(args.data_path),
        train_data_path=tuple(args.train_data_path),
        split=args.split,
        data_cache_path=args.data_cache_path,
        mock_data=args.mock_data,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        tokenizer_special_tokens=None if args.tokenizer_special_tokens is None else tuple(args.tokenizer_special_tokens),
    )


def _print_samples(args, indices, samples: list[list[int]], tokenizer) -> None:
    """Each sample's tokens, its per-context-rank chunks, and its text when a tokenizer is known."""
    cp = args.context_parallel_size
    for k, tokens in zip(indices, samples):
        where = f", iteration {k // args.global_batch_size}" if args.global_batch_size else ""
        print(f"=== sample {k}{where}: {len(tokens)} tokens ===")
        print(" ".join(map(str, tokens)))
        for rank, chunk in enumerate(_context_chunks(tokens, cp) if cp > 1 else []):
            print(f"--- context rank {rank} of {cp} ---")
            print(" ".join(map(str, chunk)))
        if tokenizer is not None:
            print("--- text ---")
            print(tokenizer.detokenize(tokens))


if __name__ == "__main__":
    sys.exit(main())
