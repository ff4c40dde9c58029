"""Hugging Face folders as transformers 5 writes them (`rope_parameters`), against the logits
transformers itself computed (tests/fixtures/hf5/, written by tests/make_hf5_fixtures.py; these
tests import neither torch nor transformers)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mlm_jax
from mlm_jax.tools import checkpoint as hfc

HF5 = os.path.join(os.path.dirname(__file__), "fixtures", "hf5")
FIXTURES = ["llama_default", "llama3_scaled", "mixtral_theta1e6"]
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 against transformers' fp32


def _fixture(name):
    folder = os.path.join(HF5, name)
    return folder, np.load(os.path.join(folder, "ids.npy")), np.load(os.path.join(folder, "logits.npy"))


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_equal_transformers_5(name):
    folder, ids, want = _fixture(name)
    np.testing.assert_allclose(mlm_jax.load(folder).logits(ids), want, **TOL)


def test_rope_parameters_are_read_not_defaulted():
    """The bug: rope_parameters ignored, theta 10000 and no scaling used (fails on that code)."""
    c = mlm_jax.load(os.path.join(HF5, "mixtral_theta1e6")).config
    assert (c.rotary_base, c.use_rope_scaling) == (1e6, False)
    c = mlm_jax.load(os.path.join(HF5, "llama3_scaled")).config
    assert (c.rotary_base, c.use_rope_scaling, c.rope_scaling_factor, c.rope_scaling_low_freq_factor,
            c.rope_scaling_high_freq_factor, c.rope_scaling_original_max_position_embeddings) == (
        500000.0, True, 8.0, 1.0, 4.0, 8)


def test_the_fixtures_tell_the_rope_apart():
    """Each fixture's logits are wrong (by far more than the tolerance) with the rope read wrong:
    theta 10000 for all, and the llama3 fixture without its scaling."""
    import dataclasses

    for name, wrong in [("mixtral_theta1e6", dict(rotary_base=10000.0)),
                        ("llama3_scaled", dict(rotary_base=10000.0, use_rope_scaling=False)),
                        ("llama3_scaled", dict(use_rope_scaling=False))]:
        folder, ids, want = _fixture(name)
        m = mlm_jax.load(folder)
        m = dataclasses.replace(m, config=dataclasses.replace(m.config, **wrong))
        assert np.abs(m.logits(ids) - want).max() > 0.1, (name, wrong)


def _copy_with(tmp_path, name, edit):
    src, ids, want = _fixture(name)
    dst = tmp_path / name
    shutil.copytree(src, dst)
    cfg = json.load(open(dst / "config.json"))
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst), ids, want


def _to_transformers_4(cfg):
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope if rope["rope_type"] != "default" else None


@pytest.mark.parametrize("name", ["llama3_scaled", "mixtral_theta1e6"])
def test_transformers_4_form_gives_the_same_logits(tmp_path, name):
    folder, ids, want = _copy_with(tmp_path, name, _to_transformers_4)
    np.testing.assert_allclose(mlm_jax.load(folder).logits(ids), want, **TOL)
    # Both forms, agreeing: fine.
    folder, ids, want = _copy_with(tmp_path / "both", name, lambda c: c.update(rope_theta=c["rope_parameters"]["rope_theta"]))
    np.testing.assert_allclose(mlm_jax.load(folder).logits(ids), want, **TOL)


@pytest.mark.parametrize("name", FIXTURES)
def test_import_export_import_round_trips(tmp_path, name):
    src, ids, want = _fixture(name)
    saved = hfc.import_hf(src, str(tmp_path / "ckpt"), log=lambda *_: None)
    out = str(tmp_path / "export")
    hfc.export_hf(saved, out, log=lambda *_: None)
    exported = json.load(open(os.path.join(out, "config.json")))
    assert exported["rope_parameters"] == json.load(open(os.path.join(src, "config.json")))["rope_parameters"]
    assert "rope_theta" not in exported and "rope_scaling" not in exported
    np.testing.assert_allclose(mlm_jax.load(out).logits(ids), want, **TOL)


def _run_import(folder, tmp_path):
    return subprocess.run([sys.executable, "-m", "mlm_jax.tools.checkpoint", "import-hf", "--hf-dir", folder,
                           "--save", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)


def test_other_rope_types_and_disagreeing_forms_are_refused_by_name(tmp_path):
    folder, _, _ = _copy_with(tmp_path / "yarn", "llama_default",
                              lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0))
    r = _run_import(folder, tmp_path / "yarn")
    assert r.returncode == 2, r.stderr
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert last.startswith("error:") and "config.json" in last and "rope_type 'yarn' is not supported" in last
    for rope_type in ("linear", "dynamic", "longrope"):
        cfg = json.load(open(os.path.join(folder, "config.json")))
        cfg["rope_parameters"]["rope_type"] = rope_type
        with pytest.raises(hfc.HFError, match=rf"config.json: rope_type '{rope_type}' is not supported"):
            hfc.config_from_hf_file(cfg, os.path.join(folder, "config.json"))
    cfg = json.load(open(os.path.join(HF5, "mixtral_theta1e6", "config.json")))
    with pytest.raises(hfc.HFError, match=r"rope_parameters.rope_theta=1000000.0 and rope_theta=10000.0 disagree"):
        hfc.config_from_hf_file({**cfg, "rope_theta": 10000.0}, "config.json")
    with pytest.raises(hfc.HFError, match=r"rope default key attention_factor=2.0 is not supported"):
        hfc.config_from_hf_file({**cfg, "rope_parameters": {**cfg["rope_parameters"], "attention_factor": 2.0}},
                                "config.json")
    llama3 = json.load(open(os.path.join(HF5, "llama3_scaled", "config.json")))
    legacy = {"rope_type": "llama3", "factor": 4.0}
    with pytest.raises(hfc.HFError, match=r"rope_parameters.factor=8.0 and rope_scaling.factor=4.0 disagree"):
        hfc.config_from_hf_file({**llama3, "rope_scaling": legacy}, "config.json")


# --------------------------------------------------------------------------- --use-rope-scaling


def numpy_llama3_inv_freq(k, base, factor, low, high, original):
    """Llama 3.1's scaled inverse frequencies written from the definition (fp64): wavelength
    2 pi / f below original/high kept, above original/low divided by the factor, between them
    f ((1 - s) / factor + s) with s = (original / wavelength - low) / (high - low)."""
    out = []
    for f in base ** (-np.arange(k // 2) * 2.0 / k):
        wavelen = 2 * np.pi / f
        if wavelen < original / high:
            out.append(f)
        elif wavelen > original / low:
            out.append(f / factor)
        else:
            s = (original / wavelen - low) / (high - low)
            out.append(f * ((1 - s) / factor + s))
    return np.array(out)


def test_llama3_rope_scaling_matches_the_definition():
    import jax.numpy as jnp

    from mlm_jax.models.layers import rotary

    k, scaling = 16, (8.0, 1.0, 4.0, 64)
    inv = numpy_llama3_inv_freq(k, 10000.0, *scaling)
    plain = 10000.0 ** (-np.arange(k // 2) * 2.0 / k)
    assert (inv == plain).any() and (inv == plain / 8).any() and ((inv != plain) & (inv != plain / 8)).any()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 70, 3, k)).astype(np.float32)
    pos = np.broadcast_to(np.arange(70), (2, 70))
    ang = pos[:, :, None, None] * inv  # [b, s, 1, k/2]
    a, b = x[..., : k // 2].astype(np.float64), x[..., k // 2:].astype(np.float64)
    want = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], axis=-1)
    got = np.asarray(rotary(jnp.asarray(x), jnp.asarray(pos), 10000.0, 1.0, scaling))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_megatron_rope_scaling_flags():
    from mlm_jax.arguments import parse_args
    from mlm_jax.errors import ConfigError
    from mlm_jax.validation import finalize

    m = parse_args(["--position-embedding-type", "rope", "--use-rope-scaling"]).model
    assert (m.use_rope_scaling, m.rope_scaling_factor, m.rope_scaling_low_freq_factor,
            m.rope_scaling_high_freq_factor, m.rope_scaling_original_max_position_embeddings) == (
        True, 8.0, 1.0, 4.0, 8192)  # Megatron-LM's defaults
    assert parse_args(["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor",
                       "32"]).model.rope_scaling_factor == 32.0
    assert not parse_args([]).model.use_rope_scaling
    for argv, message in [
        (["--use-rope-scaling"], "--use-rope-scaling needs --position-embedding-type rope (got learned_absolute)"),
        (["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "0.5"],
         "--rope-scaling-factor must be >= 1, got 0.5"),
    ]:
        with pytest.raises(ConfigError) as e:
            finalize(parse_args(argv), 1)
        assert str(e.value) == message
