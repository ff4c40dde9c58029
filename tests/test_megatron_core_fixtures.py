"""Checkpoints written by Megatron-Core itself (0.16.1 on the CPU, `tests/make_megatron_fixtures.py`,
run by hand; tests/fixtures/megatron/manifest.json holds Megatron-Core's own logits): mlm_jax reads
both formats without PyTorch and computes the same logits."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import mlm_jax

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "megatron")
MANIFEST = json.load(open(os.path.join(HERE, "manifest.json")))
CASES = [(kind, folder) for kind, rec in MANIFEST["models"].items() for folder in rec["folders"]]


@pytest.mark.parametrize("kind,folder", CASES, ids=[f for _, f in CASES])
def test_logits_equal_megatron_cores(kind, folder):
    loaded = mlm_jax.load(os.path.join(HERE, folder))
    assert loaded.iteration == MANIFEST["iteration"]
    want = np.asarray(MANIFEST["models"][kind]["logits"], np.float32)
    got = loaded.logits(np.asarray(MANIFEST["ids"], np.int32))[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
