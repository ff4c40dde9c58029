"""Train a lossless SentencePiece tokenizer from text files.

    python -m mlm_jax.data.train_tokenizer --input a.txt b.txt --model-prefix out/tok --vocab-size 8192

writes `out/tok.model` and `out/tok.vocab`; use it with
`--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model out/tok.model`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from mlm_jax.cli import cli
from mlm_jax.arguments import ArgumentParser
from mlm_jax.data.tokenizers import GPTSentencePieceTokenizer, TokenizerError, train_sentencepiece
from mlm_jax.paths import writable_file


@cli
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m mlm_jax.data.train_tokenizer", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="text files, one sentence per line")
    p.add_argument("--model-prefix", required=True, help="writes <prefix>.model and <prefix>.vocab")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing <prefix>.model / .vocab (a dataset made with the old one no longer matches)")
    args = p.parse_args(argv)
    if args.vocab_size < 1:
        p.error(f"--vocab-size must be at least 1, got {args.vocab_size}")
    if args.num_threads is not None and args.num_threads < 1:
        p.error(f"--num-threads must be at least 1, got {args.num_threads}")
    outputs = [args.model_prefix + ext for ext in (".model", ".vocab")]
    existing = [path for path in outputs if os.path.lexists(path)]
    if existing and not args.overwrite:
        p.error(f"--model-prefix {args.model_prefix}: {existing[0]} exists (the data tokenized with it would no "
                "longer match a new model); give --overwrite to replace it, or another prefix")
    t0 = time.perf_counter()
    print(f"training a {args.model_type} SentencePiece model, vocab {args.vocab_size}, on {len(args.input)} file(s)...",
          file=sys.stderr)
    writable_file(outputs[0], "--model-prefix")
    # Trained under a temporary prefix, then moved in place: a failed run leaves the old model whole.
    tmp_prefix = f"{args.model_prefix}.tmp-{os.getpid()}"
    try:
        train_sentencepiece(args.input, tmp_prefix, args.vocab_size, model_type=args.model_type,
                            num_threads=args.num_threads)
        for ext, final in zip((".model", ".vocab"), outputs):
            os.replace(tmp_prefix + ext, final)
    except TokenizerError as e:  # named by the prefix asked for, not the temporary one
        raise type(e)(str(e).replace(tmp_prefix, args.model_prefix)) from None
    finally:
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + ext):
                os.unlink(tmp_prefix + ext)
    model = outputs[0]
    tok = GPTSentencePieceTokenizer(model)
    print(f"wrote {model} (vocab {tok.vocab_size}, eod {tok.eod}) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
