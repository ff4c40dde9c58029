"""The checkpoint format: names of the items in a step folder, the metadata's config record,
the tokenizer record, the Orbax handlers, and the one place where older formats are upgraded."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys

from mlm_jax.config import Config, ConfigError
from mlm_jax.models.params import PARAM_FORMAT_VERSION, downgrade_params, upgrade_params

FORMAT = "mlm_jax"
# The format version written into every checkpoint's metadata. A change to parameter paths or
# layouts bumps it, and `upgrade` maps an older checkpoint's trees to this version on restore.
FORMAT_VERSION = PARAM_FORMAT_VERSION  # 2: layer params grouped by module (attention/, mlp/)
VERSION = FORMAT_VERSION  # the older name
PARAMS, OPT_STATE, META, TOKENIZER = "params", "opt_state", "meta", "tokenizer"
TMP_MARK = ".orbax-checkpoint-tmp"
ORBAX_COMMIT = "_CHECKPOINT_METADATA"

# Model fields that decide parameter shapes: a checkpoint and the flags must agree on them.
# (field or property, flag that sets it)
SHAPE_FIELDS = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("ffn_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("query_groups", "--num-query-groups"),
    ("head_dim", "--kv-channels"),
    ("vocab_size", "--vocab-size (or the tokenizer's vocab)"),
    ("position_embedding_type", "--position-embedding-type"),
    ("max_position_embeddings", "--max-position-embeddings"),
    ("normalization", "--normalization"),
    ("apply_layernorm_1p", "--apply-layernorm-1p"),  # the norm weights mean gamma - 1, not gamma
    ("swiglu", "--swiglu"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("add_bias_linear", "--disable-bias-linear (add_bias_linear)"),
    ("num_experts", "--num-experts"),
    ("moe_ffn_size", "--moe-ffn-hidden-size"),
    ("moe_layer_freq", "--moe-layer-freq"),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
)
# What --use-checkpoint-args takes from the checkpoint: the model's architecture.
ARCH_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings",
    "position_embedding_type", "rotary_base", "normalization", "norm_epsilon", "swiglu",
    "openai_gelu", "untie_embeddings_and_output_weights", "add_bias_linear",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
    "apply_layernorm_1p", "rotary_percent", "use_rope_scaling", "rope_scaling_factor",
    "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings",
)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded or saved as asked; the message names path and values."""


# --------------------------------------------------------------------------- config <-> JSON


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> Config:
    """The inverse of `config_to_dict`; fields this version does not know are ignored."""
    sections = {}
    for f in dataclasses.fields(Config):
        cls = f.default_factory
        known = {x.name for x in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v
                  for k, v in (d.get(f.name) or {}).items() if k in known}
        sections[f.name] = cls(**values)
    return Config(**sections)


_MOE_FIELDS = ("moe_ffn_size", "moe_layer_freq", "moe_shared_expert_intermediate_size")


def _shape_value(model, name):
    value = getattr(model, name)
    if name == "max_position_embeddings" and model.position_embedding_type != "learned_absolute":
        return None  # no table: the value does not shape anything
    if name in _MOE_FIELDS and not model.num_experts:
        return None  # a dense model: no expert shapes (moe_ffn_size only follows the FFN size)
    return value


def check_model_matches(saved, model, where: str) -> None:
    """Raise naming every shape-deciding field where the checkpoint's model differs."""
    diffs = [(flag, _shape_value(saved, name), _shape_value(model, name))
             for name, flag in SHAPE_FIELDS if _shape_value(saved, name) != _shape_value(model, name)]
    if diffs:
        lines = "; ".join(f"{flag}: checkpoint {a!r}, this run {b!r}" for flag, a, b in diffs)
        raise CheckpointError(
            f"{where}: the checkpoint's model differs from this run's: {lines} "
            "(pass matching flags, or --use-checkpoint-args to take the model from the checkpoint)")



def saved_version(meta: dict) -> int:
    """The format version a checkpoint's metadata records (1 before versions were checked)."""
    return int(meta.get("version", 1))


def silence_orbax() -> None:
    """For a command-line process: keep Orbax's and TensorStore's repeated reports of a failure
    (see `quiet_orbax`) out of the output for the rest of the process, including the ones its
    threads and garbage collection print after the error line. Not under MLM_JAX_DEBUG=1."""
    from mlm_jax.errors import debug

    if debug():
        return
    for name in ("absl", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda *_: None


@contextlib.contextmanager
def quiet_orbax():
    """Orbax and TensorStore report one failure many times (absl ERROR logs from every thread,
    asyncio's "exception was never retrieved", coroutines that were never awaited): hundreds of
    lines around the one error mlm_jax reports. Silence them while Orbax works, except under
    MLM_JAX_DEBUG=1."""
    from mlm_jax.errors import debug

    if debug():
        yield
        return
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    levels = [lg.level for lg in loggers]
    hook = sys.unraisablehook
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda *_: None
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        sys.unraisablehook = hook


def upgrade(tree, saved_version: int):
    """A restored params (or optimizer-state) tree saved at format `saved_version`, mapped to
    FORMAT_VERSION. Every restore goes through here: the one place to convert older layouts
    (version 1 kept every layer parameter directly under `layers`; see mlm_jax.models.params)."""
    _check_readable(saved_version)
    return upgrade_params(tree, saved_version)


def as_saved(tree, saved_version: int):
    """A restore target in this version's layout, laid out as a `saved_version` checkpoint
    holds it: Orbax reads by the saved paths, then `upgrade` renames them."""
    _check_readable(saved_version)
    return downgrade_params(tree, saved_version)


def _check_readable(saved_version: int) -> None:
    if saved_version > FORMAT_VERSION:
        raise CheckpointError(
            f"the checkpoint has format version {saved_version}, newer than this mlm_jax's "
            f"{FORMAT_VERSION}; update mlm_jax to load it")


# --------------------------------------------------------------------------- tokenizer files


def tokenizer_record(tokenizer, in_place: bool = False) -> tuple[dict | None, dict[str, bytes]]:
    """(JSON record naming the files by flag, {file name: bytes}) to rebuild `tokenizer`; with
    `in_place` the record names the files where they are (absolute paths) and none is read."""
    if tokenizer is None:
        return None, {}
    kind = tokenizer.tokenizer_type
    record = {"tokenizer_type": kind, "vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod)}
    files = {}
    for path in () if in_place else tokenizer.files():
        with open(path, "rb") as f:
            files[os.path.basename(path)] = f.read()
    name = os.path.abspath if in_place else os.path.basename
    if kind == "GPT2BPETokenizer":
        record["vocab_file"] = name(tokenizer.vocab_file)
        record["merge_file"] = name(tokenizer.merge_file)
    elif kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "Llama3Tokenizer",
                  "TikTokenizer"):
        record["tokenizer_model"] = name(tokenizer.model_file)
        record.update(tokenizer.options() if hasattr(tokenizer, "options") else {})  # tiktoken's flags
    elif kind == "HuggingFaceTokenizer":
        record["tokenizer_model"] = name(tokenizer.tokenizer_file)
    return record, files


def tokenizer_flags(found_path: str, record: dict | None) -> dict:
    """DataConfig fields that rebuild the checkpoint's tokenizer from its tokenizer/ folder (or
    where the record names them by absolute path: a Megatron-LM checkpoint's own files)."""
    if not record or record["tokenizer_type"] == "NullTokenizer":
        return {}
    folder = os.path.join(found_path, TOKENIZER)
    out = {"tokenizer_type": record["tokenizer_type"]}
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        if record.get(key):
            out[key] = os.path.join(folder, record[key])
    for key in ("tiktoken_pattern", "tiktoken_num_special_tokens", "tokenizer_special_tokens"):
        if record.get(key) is not None:  # TikTokenizer's options
            out[key] = tuple(record[key]) if isinstance(record[key], list) else record[key]
    return out


def load_tokenizer(found_path: str, record: dict | None):
    """The checkpoint's tokenizer, or None (mock data without one)."""
    from mlm_jax.data.tokenizers import make_tokenizer

    if not record:
        return None
    if record["tokenizer_type"] == "NullTokenizer":
        return make_tokenizer("NullTokenizer", vocab_size=record["vocab_size"] - 1)
    flags = tokenizer_flags(found_path, record)
    return make_tokenizer(flags.pop("tokenizer_type"), **flags)


def _configure_orbax() -> None:
    """Write arrays whose per-replica slice is under 1 MiB from one replica instead of splitting
    them across replicas. Orbax's replica-parallel default slices every replicated array per
    device with an eager op: one compile per (shape, slice), seconds for a model's hundred small
    tensors on the first save (16 s for 30 shapes on a 2-core CPU). Large arrays keep it."""
    global _CONFIGURED
    if _CONFIGURED:
        return
    import jax
    from orbax.checkpoint import type_handlers

    try:
        handler = type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=1 << 20)
    except TypeError:  # an Orbax without the option: keep its default
        handler = None
    if handler is not None:
        import logging

        absl = logging.getLogger("absl")  # Orbax warns that it is overriding its own default
        level = absl.level
        absl.setLevel(logging.ERROR)
        try:
            type_handlers.register_type_handler(jax.Array, handler, override=True)
        finally:
            absl.setLevel(level)
    _CONFIGURED = True


_CONFIGURED = False


def files_handler():
    """An Orbax item that writes a few small files (the tokenizer's) into the step folder, so
    they are committed atomically with the rest. Built lazily: orbax is imported on first use."""
    global _FILES
    _configure_orbax()
    if _FILES is not None:
        return _FILES
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.futures import future

    class FilesHandler(ocp.handlers.AsyncCheckpointHandler):
        async def _write(self, files, directory):
            import jax

            if jax.process_index() == 0:
                for name, data in files.items():
                    (directory / name).write_bytes(data)

        async def async_save(self, directory, args=None):
            return [future.CommitFutureAwaitingContractedSignals(
                self._write(args.files, directory), name="mlm_jax_files_save")]

        def save(self, directory, args=None):
            for name, data in args.files.items():
                (directory / name).write_bytes(data)

        def restore(self, directory, args=None):
            return {p.name: p.read_bytes() for p in directory.iterdir() if p.name != "commit_success.txt"}

    @ocp.args.register_with_handler(FilesHandler, for_save=True)
    @dataclasses.dataclass
    class FilesSave(ocp.args.CheckpointArgs):
        files: dict

    @ocp.args.register_with_handler(FilesHandler, for_restore=True)
    @dataclasses.dataclass
    class FilesRestore(ocp.args.CheckpointArgs):
        pass

    _FILES = FilesSave
    return _FILES


_FILES = None

