"""By hand, in the torch venv (not run by the tests): open every file export-megatron wrote
with torch.load and compare its tensors with mlm_jax's own reader of the same files.

    PYTHONPATH=. /work/venv/bin/python -m mlm_jax.tools.checkpoint import-megatron \
        --load tests/fixtures/megatron_synthetic/llama/dist_tp1 --save /tmp/mw/ck
    PYTHONPATH=. /work/venv/bin/python -m mlm_jax.tools.checkpoint export-megatron \
        --load /tmp/mw/ck --save /tmp/mw/out --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    PYTHONPATH=. /work/venv/bin/python tests/check_megatron_write.py dump /tmp/mw/out /tmp/mw/ours.npz
    /work/venv-torch/bin/python tests/check_megatron_write.py check /tmp/mw/out /tmp/mw/ours.npz

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


if __name__ == "__main__":
    what, root, ref = sys.argv[1:4]
    sys.exit(dump(root, ref) if what == "dump" else check(root, ref))
