"""Megatron-LM's own example scripts, replayed: the flags each script passes to pretrain_gpt.py
(tests/megatron_examples/*.args, copied from the scripts) go to `python -m mlm_jax.train`'s parser
unchanged except for sizes (scaled down to a tiny model on the fake 8-device mesh) and paths (tiny
local files), and train 2 iterations. The only refusals allowed are what
Megatron's own argument validation refuses, with Megatron's reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from mlm_jax.arguments import parse_args
from mlm_jax.config import ConfigError
from mlm_jax.train import train

EXAMPLES = Path(__file__).parent / "megatron_examples"

# Sizes: a tiny model on 8 fake devices. Parallel sizes shrink so that tp x pp x cp divides 8.
SIZES = {
    "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "8",
    "--num-query-groups": "2", "--kv-channels": "8", "--seq-length": "32", "--max-position-embeddings": "64",
    "--vocab-size": "512", "--num-experts": "4", "--micro-batch-size": "1", "--global-batch-size": "16",
    "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
    "--expert-model-parallel-size": "2", "--train-iters": "2", "--train-samples": "32", "--eval-iters": "1",
}
# Variables of the scripts (sizes, then paths made by the `files` fixture).
VARIABLES = {"NUM_LAYERS": "2", "SEQ_LENGTH": "32", "MAX_POSITION_EMBEDDINGS": "32", "MICRO_BATCH_SIZE": "1",
             "GLOBAL_BATCH_SIZE": "16", "TP_SIZE": "2", "CP_SIZE": "2"}
PLACEHOLDERS = {"<PATH TO gpt-vocab.json>": "VOCAB_FILE", "<PATH TO gpt-merges.txt>": "MERGE_FILE",
                "<PATH TO CHECKPOINTS DIRECTORY>": "CHECKPOINT_PATH", "<TENSORBOARD DIRECTORY>": "TENSORBOARD_LOGS_PATH"}


def read_args(name: str, variables: dict[str, str]) -> list[tuple[str, list[str]]]:
    """The script's flags as (flag, values), variables filled in."""
    items = []
    for line in (EXAMPLES / f"{name}.args").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        for placeholder, var in PLACEHOLDERS.items():
            line = line.replace(placeholder, "$" + var)
        line = re.sub(r"\$\{?(\w+)\}?", lambda m: variables[m.group(1)], line)
        flag, *values = shlex.split(line)
        items.append((flag, values))
    return items


def scaled(items, overrides: dict[str, str | None] | None = None) -> list[str]:
    """argv with the size flags scaled down; `overrides` replaces a flag's value (None: drops it)."""
    overrides = overrides or {}
    argv = []
    for flag, values in items:
        if flag in overrides:
            if overrides[flag] is None:
                continue
            values = overrides[flag].split()
        elif flag in SIZES and values:
            values = [SIZES[flag]]
        argv += [flag, *values]
    return argv


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A GPT-2 byte-level vocab/merges, a tiny SentencePiece model (Llama-2's tokenizer type) and a
    tokenized corpus whose ids fit both (< 257)."""
    from tokenizers.pre_tokenizers import ByteLevel

    from mlm_jax.data.indexed_dataset import write_indexed_dataset
    from mlm_jax.data.tokenizers import train_sentencepiece

    d = tmp_path_factory.mktemp("megatron_examples")
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = 256
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    rng = np.random.default_rng(0)
    # Mixtral's --split 99990,8,2 needs 12,500 documents for one validation document.
    docs = [rng.integers(0, 256, size=int(n)) for n in rng.integers(20, 60, size=60_000)]
    prefix = write_indexed_dataset(str(d / "corpus_text_document"), docs)
    text = d / "sp.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i % 7}" for i in range(300)))
    spm = train_sentencepiece([str(text)], str(d / "llama2"), 300, num_threads=1)
    # a byte-level tokenizer.json (HuggingFaceTokenizer's), the same 257 ids as the GPT-2 files
    from tokenizers import Tokenizer, models

    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = ByteLevel(add_prefix_space=False)
    (d / "hf").mkdir()
    hf.save(str(d / "hf" / "tokenizer.json"))
    return {"VOCAB_FILE": str(d / "vocab.json"), "MERGE_FILE": str(d / "merges.txt"), "DATA_PATH": prefix,
            "DATASET": prefix, "TOKENIZER_MODEL": spm, "HF_TOKENIZER": str(d / "hf")}


def variables(files, tmp: Path) -> dict[str, str]:
    return {**VARIABLES, **files, "CHECKPOINT_PATH": str(tmp / "ckpt"),
            "TENSORBOARD_LOGS_PATH": str(tmp / "tb"), "DATA_CACHE_PATH": str(tmp / "cache")}


def run(argv: list[str], tmp: Path):
    """Train as the command would (the parsed flags untouched), minus the progress bar and the
    end-of-run sample; returns (summary, training records of the metrics file)."""
    cfg = parse_args(argv)
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, progress_bar=False, sample_tokens=0,
                                                run_dir=str(tmp / "run")))
    summary = train(cfg, log=lambda *_: None)
    records = [json.loads(x) for x in open(tmp / "run" / "metrics.jsonl")]
    return summary, [r for r in records if "lm_loss" in r]


# name -> the script's overrides beyond SIZES (why in the comment), and the expected iterations.
RUNS = {
    "pretrain_gpt": ({}, 2),
    "pretrain_gpt_distributed": ({}, 2),
    "pretrain_gpt_distributed_with_mp": ({}, 2),
    # ramp-up 8 -> 16 over 8 samples; 24 samples: iterations of 8, then 16
    "pretrain_gpt3_175B": ({"--rampup-batch-size": "8 8 8", "--train-samples": "24"}, 2),
    "gpt3_857m": ({}, 2),
    # CP_SIZE 2 here (the script's own is 1), and --attention-backend fused with context parallelism
    # is refused (its blocks run XLA attention); fused alone runs XLA off a GPU: test below
    "llama3_8b_bf16": ({"--attention-backend": "unfused"}, 2),
    "mixtral_8x7b": ({}, 2),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_example_script_trains(name, files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides, iterations = RUNS[name]
    summary, records = run(scaled(read_args(name, variables(files, tmp_path)), overrides), tmp_path)
    assert summary["last_iteration"] == iterations and summary["exit_reason"] is None
    assert [r["iteration"] for r in records][-1] == iterations
    assert all(math.isfinite(r["lm_loss"]) for r in records)
    assert summary["checkpoints"] and os.path.isdir(summary["checkpoints"][-1])


def test_gpt3_175b_as_written_is_refused_with_megatron_reason(files, tmp_path):
    """The current 175B script gives --step-batch-size-schedule AND --global-batch-size, which
    Megatron-LM's own validation refuses ("Cannot specify both ...")."""
    argv = scaled(read_args("gpt3_175b", variables(files, tmp_path)))
    with pytest.raises(ConfigError) as err:
        run(argv, tmp_path)
    message = str(err.value)
    assert "--step-batch-size-schedule" in message and "--global-batch-size" in message, message
    assert "\n" not in message


def test_gpt3_175b_with_its_batch_size_schedule(files, tmp_path, monkeypatch):
    """The 175B script as Megatron's error asks (without --global-batch-size): the batch follows
    the step schedule, thresholds in tokens (2.4B tokens -> 256 here: 8 samples of 32 tokens)."""
    monkeypatch.chdir(tmp_path)
    argv = scaled(read_args("gpt3_175b", variables(files, tmp_path)),
                  {"--global-batch-size": None, "--step-batch-size-schedule": "0:8 256:16"})
    summary, records = run(argv, tmp_path)
    assert summary["last_iteration"] == 2
    assert [r["consumed_samples"] for r in records][-1] == 8 + 16


def test_llama3_fp8_script_trains_as_written(files, tmp_path, monkeypatch):
    """Megatron's Llama-3 8B fp8 script: hybrid fp8, its default delayed scaling with a 1024-step
    amax history (max), and --fp8-param-gather under ZeRO (fp8 projections, bf16 elsewhere)."""
    monkeypatch.chdir(tmp_path)
    argv = scaled(read_args("llama3_8b_fp8", variables(files, tmp_path)), {"--attention-backend": "unfused"})
    cfg = parse_args(argv)
    m = cfg.model
    assert (m.fp8_format, m.fp8_recipe, m.fp8_amax_history_len, m.fp8_amax_compute_algo) == ("hybrid", "delayed", 1024, "max")
    assert m.fp8_param_gather and cfg.parallel.use_distributed_optimizer
    summary, records = run(argv, tmp_path)
    assert summary["last_iteration"] == 2 and all(np.isfinite(r["lm_loss"]) for r in records)


def test_llama3_fused_attention_off_a_gpu_is_a_note(files, tmp_path):
    """As written (--attention-backend fused) the script asks for cuDNN's fused attention: off an
    NVIDIA GPU the run says, in one line, that XLA attention runs instead (the GPU-compile tier
    checks it is cuDNN on an NVIDIA target)."""
    from mlm_jax.models.attention import backend_note
    from mlm_jax.validation import finalize

    import jax

    llama = {**variables(files, tmp_path), "CP_SIZE": "1"}  # the script's own CP_SIZE (fused + CP is refused)
    cfg = finalize(parse_args(scaled(read_args("llama3_8b_bf16", llama))), jax.device_count())
    assert cfg.model.attention_backend == "fused"
    assert "XLA attention runs instead" in backend_note(cfg.model, "cpu")


# Megatron's DeepSeek-V3 script (examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh) at a toy size:
# the sizes SIZES does not know, scaled to fit 2 layers of 4 experts; its tokenizer a local folder.
DEEPSEEK_SIZES = {
    "--moe-layer-freq": "[0]*1+[1]*1", "--moe-router-topk": "2", "--moe-router-num-groups": "2",
    "--moe-router-group-topk": "1", "--moe-ffn-hidden-size": "32", "--moe-shared-expert-intermediate-size": "32",
    "--q-lora-rank": "24", "--kv-lora-rank": "16", "--qk-head-dim": "8", "--qk-pos-emb-head-dim": "8",
    "--v-head-dim": "8", "--lr-decay-samples": "32", "--lr-warmup-samples": "8",
    "--tensor-model-parallel-size": "1",  # the script's TP, as its --expert-tensor-parallel-size 1 asks
}
DEEPSEEK_VARIABLES = {"TP": "1", "EP": "8", "MBS": "4", "GBS": "2048", "COMMENT": "", "SHARDING_STRATEGY": "optim_grads_params"}


def test_deepseek_v3_script_as_written_refuses_only_random_routing(files, tmp_path):
    """As written, one flag is refused, with the reason: --moe-router-force-load-balancing (random
    routing logits for benchmarks)."""
    v = {**variables(files, tmp_path), **DEEPSEEK_VARIABLES, "OUTPUT_PATH": str(tmp_path / "out")}
    with pytest.raises(ConfigError) as err:
        parse_args(scaled(read_args("deepseek_v3_mfsdp", v), {"--tokenizer-model": files["HF_TOKENIZER"]}))
    assert str(err.value).startswith("--moe-router-force-load-balancing: random routing logits for benchmarks")


def test_deepseek_v3_script_trains(files, tmp_path, monkeypatch):
    """The script's model (MLA with YaRN and latent norms, 256 -> 4 experts behind a dense first layer,
    sigmoid group-limited routing with the expert bias, a shared expert, one MTP depth) under its
    layout (Megatron-FSDP optim_grads_params over 8 data ranks, expert parallel 8 -> 2 here, SP with
    its tensor size 1), 2 iterations; --moe-router-force-load-balancing left out (refused above)."""
    monkeypatch.chdir(tmp_path)
    v = {**variables(files, tmp_path), **DEEPSEEK_VARIABLES, "OUTPUT_PATH": str(tmp_path / "out")}
    argv = scaled(read_args("deepseek_v3_mfsdp", v), {**DEEPSEEK_SIZES, "--tokenizer-model": files["HF_TOKENIZER"],
                                                       "--moe-router-force-load-balancing": None})
    cfg = parse_args(argv)
    m, p = cfg.model, cfg.parallel
    assert m.multi_latent_attention and m.qk_layernorm and m.mtp_num_layers == 1 and m.rotary_scaling_factor == 40
    assert m.moe_router_enable_expert_bias and m.moe_router_score_function == "sigmoid"
    assert p.use_megatron_fsdp and p.data_parallel_sharding_strategy == "optim_grads_params"
    assert p.grad_reduce_in_bf16 and m.moe_token_dispatcher_type == "alltoall"  # its FSDP grad dtype, flex
    assert m.bf16 and m.recompute_granularity == "selective"
    assert m.recompute_modules == ("mlp", "moe", "mla_up_proj", "layernorm")
    summary, records = run(argv, tmp_path)
    assert summary["last_iteration"] == 2 and summary["exit_reason"] is None
    assert all(math.isfinite(r["lm_loss"]) and math.isfinite(r["mtp_1_loss"]) for r in records)
