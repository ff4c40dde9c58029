"""By hand, in the torch venv (not run by the tests): open every file export-megatron wrote
with torch.load and compare its tensors with mlm_jax's own reader of the same files.

    PYTHONPATH=. /work/venv/bin/python -m mlm_jax.tools.checkpoint import-megatron \
        --load tests/fixtures/megatron_synthetic/llama/dist_tp1 --save /tmp/mw/ck
    PYTHONPATH=. /work/venv/bin/python -m mlm_jax.tools.checkpoint export-megatron \
        --load /tmp/mw/ck --save /tmp/mw/out --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    PYTHONPATH=. /work/venv/bin/python tests/check_megatron_write.py dump /tmp/mw/out /tmp/mw/ours.npz
    /work/venv-torch/bin/python tests/check_megatron_write.py check /tmp/mw/out /tmp/mw/ours.npz

and, against the files torch.save itself wrote for the same weights (the fixture generator's
legacy_tp2, local names like ours; its vocab padding rows are random, ours zero, so those rows
are compared up to the true vocab, 100):

    PYTHONPATH=. /work/venv/bin/python -m mlm_jax.tools.checkpoint export-megatron \
        --load /tmp/mw/ck --save /tmp/mw/out_tp2 --tensor-model-parallel-size 2
    /work/venv-torch/bin/python tests/check_megatron_write.py compare /tmp/mw/out_tp2 \
        tests/fixtures/megatron_synthetic/llama/legacy_tp2

(`dump`, in mlm_jax's venv, without torch: every tensor of every file as mlm_jax's own reader,
torch_pickle.py, reads it; `check`, in the torch venv, which has no jax: torch.load of each file
must hold the same keys, args and bitwise the same tensors.)

torch.load(weights_only=True) refuses the files only for `args` (argparse.Namespace is not on
torch's default allow-list; Megatron-LM itself loads with weights_only=False, or adds it with
torch.serialization.add_safe_globals): this script shows the refusal, then loads with
weights_only=True under safe_globals([argparse.Namespace]) and with weights_only=False.
"""

import argparse
import glob
import os
import sys

import json

import numpy as np


def _files(root):
    files = sorted(glob.glob(os.path.join(root, "iter_*", "mp_rank_*", "model_optim_rng.pt")))
    assert files, f"no model_optim_rng.pt under {root}"
    return files


def dump(root: str, out: str) -> int:
    from mlm_jax.checkpoint.megatron import torch_pickle

    arrays, meta = {}, {}
    for path in _files(root):
        rel = os.path.relpath(path, root)
        with open(path, "rb") as f:
            st = torch_pickle.load(f.read(), path)
        meta[rel] = {"keys": sorted(st), "iteration": st["iteration"], "version": st["checkpoint_version"],
                     "args": vars(st["args"]), "model": list(st["model"])}
        for k, v in st["model"].items():
            arrays[f"{rel}//{k}"] = np.asarray(v)
    np.savez(out, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    print(f"dumped {len(arrays)} tensors of {len(meta)} files to {out}")
    return 0


def check(root: str, ref: str) -> int:
    import torch

    ours = np.load(ref)
    meta = json.loads(ours["__meta__"].tobytes())
    files = _files(root)
    assert sorted(os.path.relpath(p, root) for p in files) == sorted(meta)
    n = 0
    for path in files:
        rel = os.path.relpath(path, root)
        try:
            torch.load(path, weights_only=True)
            print(f"{path}: weights_only=True loads as is")
        except Exception as e:  # noqa: BLE001
            line = [s for s in str(e).splitlines() if "Unsupported global" in s or "GLOBAL" in s]
            print(f"{path}: weights_only=True refused: {(line or [str(e).splitlines()[0]])[0].strip()[:200]}")
        with torch.serialization.safe_globals([argparse.Namespace]):
            sd = torch.load(path, weights_only=True)
        sd2 = torch.load(path, weights_only=False)
        m = meta[rel]
        assert sorted(sd) == m["keys"] == sorted(sd2), (sorted(sd), m["keys"])
        assert sd["checkpoint_version"] == 3.0 == m["version"] and sd["iteration"] == m["iteration"]
        args = json.loads(json.dumps(vars(sd["args"])))  # tuples -> lists, as in the dump
        assert args == m["args"], "args differ"
        assert list(sd["model"]) == m["model"]
        for k, t in sd["model"].items():
            assert t.dtype == torch.float32 and t.is_contiguous(), k
            np.testing.assert_array_equal(t.numpy(), ours[f"{rel}//{k}"], err_msg=k)
            np.testing.assert_array_equal(sd2["model"][k].numpy(), t.numpy(), err_msg=k)
            n += 1
    print(f"OK: {len(files)} files, {n} tensors equal (torch.load vs mlm_jax's reader)")
    return 0


def compare(root: str, other: str, vocab: int = 100) -> int:
    import torch

    # the fixture's args hold a megatron enum member: its generator's stand-in module
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "megatron_synthetic"))
    import make  # noqa: F401  (registers megatron.core.transformer.enums)

    ours, theirs = _files(root), _files(other)
    rank = lambda p: os.path.basename(os.path.dirname(p))  # noqa: E731  (iterations may differ)
    assert [rank(p) for p in ours] == [rank(p) for p in theirs]
    n = 0
    for a, b in zip(ours, theirs):
        with torch.serialization.safe_globals([argparse.Namespace]):
            sa = torch.load(a, weights_only=True)
        sb = torch.load(b, weights_only=False)
        ma = sa["model"]
        mb = {k: v for k, v in sb["model"].items() if not k.endswith("_extra_state")}
        assert sorted(ma) == sorted(mb), sorted(set(ma) ^ set(mb))
        for k in ma:
            x, y = ma[k], mb[k]
            assert x.shape == y.shape, (k, x.shape, y.shape)
            if k in ("embedding.word_embeddings.weight", "output_layer.weight"):  # rows < vocab, globally
                t = sa["args"].tensor_model_parallel_size and int(rank(a)[len("mp_rank_"):][:2])
                valid = max(0, min(x.shape[0], vocab - t * x.shape[0]))
                kept = max(0, min(x.shape[0], 128 - t * x.shape[0]))  # the mlm_jax checkpoint's 128 rows
                assert not x[kept:].any(), k  # the rows added for T are zero
                x, y = x[:valid], y[:valid]
            assert torch.equal(x, y), k
            n += 1
        for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "group_query_attention", "kv_channels", "padded_vocab_size", "vocab_size", "swiglu",
                    "normalization", "position_embedding_type", "untie_embeddings_and_output_weights",
                    "add_bias_linear", "tensor_model_parallel_size", "pipeline_model_parallel_size"):
            assert getattr(sa["args"], key) == getattr(sb["args"], key), (key, getattr(sa["args"], key),
                                                                          getattr(sb["args"], key))
    print(f"OK: {len(ours)} files, {n} tensors equal to torch.save's own files in {other}")
    return 0


if __name__ == "__main__":
    what, root, ref = sys.argv[1:4]
    sys.exit({"dump": dump, "check": check, "compare": compare}[what](root, ref))
