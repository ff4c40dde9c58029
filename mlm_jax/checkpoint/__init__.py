"""Checkpoints: Orbax, asynchronous, complete-or-absent, restorable onto any layout.

A save folder (`--save DIR`) holds one sub-folder per saved iteration:

    DIR/<iteration>/
        params/              model parameters, fp32, in the *plain* layout: stacked layers
                             [layers, ...] in layer order, vocab rows padded (zeros) to the saving
                             run's padded vocab. Layout-free: no mesh, no pipeline order.
        opt_state/           the optimizer state, same layout (absent: --no-save-optim, imports)
        meta/metadata        JSON: iteration, consumed samples, optimizer step, RNG, the full
                             config, the tokenizer record, and the layout it was saved from
        tokenizer/           the tokenizer's files (vocab.json + merges.txt, tokenizer.model, ...)
        _CHECKPOINT_METADATA Orbax's commit record
    DIR/<iteration>.orbax-checkpoint-tmp/   a save in flight, or one a crash interrupted

Orbax writes every save into the `.orbax-checkpoint-tmp` folder and renames it into place only
after every host has written every item, so a folder named by a bare number is complete; an
interrupted save is never loaded (`find_checkpoints` skips it and says so) and the next save
manager removes it.

Restoring builds an abstract target (shape, dtype, sharding on *this* run's mesh) for every leaf
and lets Orbax read each device's slice: any tensor / data / pipeline size, ZeRO on or off, any
host count, with no conversion step. The vocab padding may differ between layouts (it grows
with the tensor-parallel size); padding rows are zeros, so they are padded or cut on restore.
Pipelined runs store their layers permuted/padded (mlm_jax/pipeline/layout.py); they are
converted to the plain layout on save and back on restore.

The package, by job: `format` (item names, metadata's config record, tokenizer record, Orbax
handlers, FORMAT_VERSION and `upgrade`), `find` (what `--load` names), `restore` (onto this
run's layout), `saver` (saving during training and the exit policy).
"""


from mlm_jax.checkpoint.format import (  # noqa: F401
    ARCH_FIELDS, FORMAT, FORMAT_VERSION, META, OPT_STATE, ORBAX_COMMIT, PARAMS, SHAPE_FIELDS, TMP_MARK,
    TOKENIZER, VERSION, CheckpointError, quiet_orbax, silence_orbax, check_model_matches, config_from_dict, config_to_dict,
    as_saved, load_tokenizer, saved_version, tokenizer_flags, tokenizer_record, upgrade)
from mlm_jax.checkpoint.find import (  # noqa: F401
    Found, find_checkpoint, is_checkpoint, is_hf_folder, read_meta, resolve_load, scan)
from mlm_jax.checkpoint.restore import damaged_error, read_items  # noqa: F401
from mlm_jax.checkpoint.restore import (  # noqa: F401
    Start, describe_layout, layout_record, plain_layout, restore_host_params, restore_params,
    restore_train_state)
from mlm_jax.checkpoint.saver import (  # noqa: F401
    ExitPolicy, SaveFailed, Saver, exit_process, orbax_wedged, write_params_checkpoint)

# Older private names, used by benchmarks/checkpoint.py.
_describe, _layout_record = describe_layout, layout_record
