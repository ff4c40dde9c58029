"""make_batch against a loop port of Megatron's get_ltor_masks_and_position_ids."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mlm_jax.data.batch import make_batch

EOD = 9


def megatron_ltor(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """One sample, as Megatron computes it (attention mask: True = masked out)."""
    n = len(data)
    attention = np.tril(np.ones((n, n)))
    loss_mask = np.ones(n, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = np.arange(n)
    if reset_position_ids or reset_attention_mask:
        prev = 0
        for i in np.nonzero(data == eod)[0]:
            if reset_attention_mask:
                attention[i + 1 :, : i + 1] = 0
            if reset_position_ids:
                position_ids[i + 1 :] -= i + 1 - prev
                prev = i + 1
    return attention < 0.5, loss_mask, position_ids


def allowed_from_segments(segment_ids):
    n = len(segment_ids)
    causal = np.tril(np.ones((n, n), dtype=bool))
    return causal & (segment_ids[:, None] == segment_ids[None, :])


def test_hand_example():
    sample = np.array([[5, EOD, 6, 7, EOD, EOD, 8, 1]])
    b = make_batch(sample, EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    assert b["tokens"].tolist() == [[5, EOD, 6, 7, EOD, EOD, 8]]
    assert b["labels"].tolist() == [[EOD, 6, 7, EOD, EOD, 8, 1]]
    assert b["loss_mask"].tolist() == [[1, 0, 1, 1, 0, 0, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    assert b["segment_ids"].tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert {k: v.dtype.name for k, v in b.items()} == {
        "tokens": "int32", "labels": "int32", "loss_mask": "float32",
        "position_ids": "int32", "segment_ids": "int32"}


def test_defaults_are_plain_causal():
    sample = np.array([[5, EOD, 6, 7, EOD]])
    b = make_batch(sample, EOD)
    assert b["loss_mask"].tolist() == [[1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert b["segment_ids"].tolist() == [[0, 0, 0, 0]]


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
def test_matches_megatron(flags):
    reset_pos, reset_attn, mask_loss = flags
    rng = np.random.default_rng(sum(f << i for i, f in enumerate(flags)))
    samples = rng.integers(0, 12, size=(6, 33))  # ids 9 (EOD) appear often, also adjacent and first
    samples[0, 0] = EOD
    b = make_batch(samples, EOD, eod_mask_loss=mask_loss, reset_position_ids=reset_pos,
                   reset_attention_mask=reset_attn)
    for r in range(samples.shape[0]):
        mask, loss, pos = megatron_ltor(samples[r, :-1], EOD, reset_pos, reset_attn, mask_loss)
        np.testing.assert_array_equal(b["loss_mask"][r], loss)
        np.testing.assert_array_equal(b["position_ids"][r], pos)
        np.testing.assert_array_equal(allowed_from_segments(b["segment_ids"][r]), ~mask)
        np.testing.assert_array_equal(b["labels"][r], samples[r, 1:])


def test_rejects_bad_shape():
    with pytest.raises(ValueError, match="seq_length \\+ 1"):
        make_batch(np.zeros(5), EOD)
