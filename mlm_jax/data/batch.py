"""Samples of seq_length + 1 tokens -> the model's inputs, as Megatron's
`get_ltor_masks_and_position_ids` defines them.

* `tokens = sample[:-1]`, `labels = sample[1:]`.
* `--eod-mask-loss`: loss_mask is 0 where the *input* token is EOD (Megatron masks on `data`,
  the tokens, not on the labels), so the model is not trained to predict across documents.
* `--reset-position-ids`: positions restart at 0 after each EOD.
* `--reset-attention-mask`: a token attends only within its own document. Megatron builds a
  block-diagonal [S, S] mask whose blocks end *at* each EOD (inclusive); here the same blocks
  are `segment_ids` (the number of EODs strictly before the token), and the model attends only
  between equal segment ids, causally. Without the flag every segment id is 0.
"""

from __future__ import annotations

import numpy as np


def make_batch(
    samples: np.ndarray,
    eod: int,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
) -> dict[str, np.ndarray]:
    """[B, S+1] int samples -> dict of [B, S] `tokens`, `labels` (int32), `loss_mask` (float32),
    `position_ids`, `segment_ids` (int32)."""
    samples = np.asarray(samples)
    if samples.ndim != 2 or samples.shape[1] < 2:
        raise ValueError(f"samples must be [batch, seq_length + 1], got shape {samples.shape}")
    tokens = samples[:, :-1].astype(np.int32)  # [batch, seq]
    labels = samples[:, 1:].astype(np.int32)  # [batch, seq]
    batch, seq = tokens.shape
    is_eod = tokens == eod  # [batch, seq]

    loss_mask = np.ones((batch, seq), dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    position = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    # after_eod[b, j]: token j is the first of a new document (the token before it is EOD).
    after_eod = np.zeros((batch, seq), dtype=bool)
    after_eod[:, 1:] = is_eod[:, :-1]
    if reset_position_ids:
        doc_start = np.maximum.accumulate(np.where(after_eod, position, 0), axis=1)  # [batch, seq]
        position_ids = (position - doc_start).astype(np.int32)
    else:
        position_ids = np.array(position, dtype=np.int32)
    if reset_attention_mask:
        segment_ids = np.cumsum(after_eod, axis=1, dtype=np.int32)  # [batch, seq]
    else:
        segment_ids = np.zeros((batch, seq), dtype=np.int32)
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
    }


BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")  # + segment_ids with reset mask


def batch_keys(data) -> tuple[str, ...]:
    """The arrays of a training batch for a `DataConfig` (segment_ids only with
    --reset-attention-mask: without it every segment id is 0 and the step does not read them)."""
    return BATCH_KEYS + (("segment_ids",) if data.reset_attention_mask else ())


def batch_fn(data, eod: int):
    """[n, seq+1] samples -> the training batch (`batch_keys`) under `data`'s document flags."""

    def make(samples):
        full = make_batch(samples, eod=eod, eod_mask_loss=data.eod_mask_loss,
                          reset_position_ids=data.reset_position_ids,
                          reset_attention_mask=data.reset_attention_mask)
        return {k: full[k] for k in batch_keys(data)}

    return make
