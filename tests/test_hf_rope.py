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
FIXTURES = ["llama_default", "llama3_scaled", "mixtral_theta1e6", "deepseek_v3", "deepseek_v3_q_direct"]
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 against transformers' fp32
# DeepSeek-V3 (issue 54's bound for MLA, 1e-4): its logits run through the latents' norms, YaRN and a
# router whose weights are scaled 2.5x; fp32 reordering alone (one device against eight) moves them 1e-5.
DEEPSEEK_TOL = dict(rtol=1e-4, atol=1e-4)


def _tol(name):
    return DEEPSEEK_TOL if name.startswith("deepseek") else TOL


def _fixture(name):
    folder = os.path.join(HF5, name)
    return folder, np.load(os.path.join(folder, "ids.npy")), np.load(os.path.join(folder, "logits.npy"))


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_equal_transformers_5(name):
    folder, ids, want = _fixture(name)
    np.testing.assert_allclose(mlm_jax.load(folder).logits(ids), want, **_tol(name))


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
    np.testing.assert_allclose(mlm_jax.load(out).logits(ids), want, **_tol(name))


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


# --------------------------------------------------------------------------- folders written here (numpy)


def _rewrite_config(folder, edit):
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    edit(cfg)
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return cfg


def test_transformers_5_form_equals_transformers_4_form(tmp_path):
    """The bug itself, without transformers' fixtures: the same Mixtral (theta 1e6) written with
    top-level rope_theta (transformers 4) and with rope_parameters (transformers 5) must load as
    the same model. Before the fix the second form read as theta 10000."""
    from tests.test_hf import make_mixtral, mixtral_reference

    v4 = str(tmp_path / "v4")
    cfg, w = make_mixtral(v4)
    v5 = str(tmp_path / "v5")
    shutil.copytree(v4, v5)

    def to_v5(c):
        c.pop("rope_scaling")
        c["rope_parameters"] = {"rope_theta": c.pop("rope_theta"), "rope_type": "default"}

    _rewrite_config(v5, to_v5)
    ids = np.random.default_rng(7).integers(0, cfg["vocab_size"], size=(2, 12))
    m4, m5 = mlm_jax.load(v4), mlm_jax.load(v5)
    assert (m4.config.rotary_base, m5.config.rotary_base) == (1e6, 1e6)
    np.testing.assert_array_equal(m5.logits(ids), m4.logits(ids))
    np.testing.assert_allclose(m5.logits(ids), mixtral_reference(w, cfg, ids), rtol=2e-5, atol=2e-5)


def test_llama3_folder_written_here_equals_a_numpy_reference(tmp_path, monkeypatch):
    """A Llama folder with rope_type llama3 (transformers-4 form, rope_scaling) against the numpy
    Llama forward of tests/test_hf.py with its rope frequencies scaled by the rule, fp64. Head dim
    8, theta 500: inverse frequencies 1, 0.21, 0.045, 0.0095 (wavelengths 6.3, 30, 140, 660);
    original 64 with low/high 1/4 (bands at wavelengths 16 and 64) keeps the first, blends the
    second, slows the last two."""
    import tests.test_hf as th

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    folder = str(tmp_path / "hf")
    cfg, w = th.make_llama(folder)
    cfg = _rewrite_config(folder, lambda c: c.update(rope_scaling=scaling))
    hd = cfg["head_dim"]
    inv = numpy_llama3_inv_freq(hd, cfg["rope_theta"], 8.0, 1.0, 4.0, 64)
    plain = cfg["rope_theta"] ** (-np.arange(hd // 2) * 2.0 / hd)
    assert inv[0] == plain[0] and (inv[2:] == plain[2:] / 8).all() and plain[1] / 8 < inv[1] < plain[1]

    def scaled_rope(x, theta):  # [b, h, t, k], tests/test_hf.py's _rope with the scaled frequencies
        freqs = np.arange(x.shape[2])[:, None] * inv[None]
        emb = np.concatenate([freqs, freqs], -1)
        rot = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * np.cos(emb) + rot * np.sin(emb)

    monkeypatch.setattr(th, "_rope", scaled_rope)
    ids = np.random.default_rng(7).integers(0, cfg["vocab_size"], size=(2, 40))  # past 8 wavelengths of 6.3
    want = th.llama_reference(w, cfg, ids)
    m = mlm_jax.load(folder)
    assert m.config.use_rope_scaling and m.config.rope_scaling_original_max_position_embeddings == 64
    np.testing.assert_allclose(m.logits(ids), want, rtol=2e-5, atol=2e-5)
    monkeypatch.undo()
    assert np.abs(th.llama_reference(w, cfg, ids) - want).max() > 0.1  # the scaling matters here



def test_checkpoints_written_before_the_rope_scaling_fields_load_as_before(tmp_path):
    """A checkpoint whose saved config has no rope scaling fields (written before them) loads
    with the scaling off, computing what it computed."""
    folder, ids, want = _fixture("mixtral_theta1e6")
    saved = hfc.import_hf(folder, str(tmp_path / "ckpt"), log=lambda *_: None)
    meta = os.path.join(saved, "meta", "metadata")
    d = json.load(open(meta))
    old = {k: v for k, v in d["config"]["model"].items() if not k.startswith(("use_rope_scaling", "rope_scaling_"))}
    assert len(old) == len(d["config"]["model"]) - 5
    d["config"]["model"] = old
    with open(meta, "w") as f:
        json.dump(d, f)
    m = mlm_jax.load(saved)
    assert (m.config.rotary_base, m.config.use_rope_scaling) == (1e6, False)
    np.testing.assert_allclose(m.logits(ids), want, **TOL)
