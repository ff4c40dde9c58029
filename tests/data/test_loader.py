"""BatchLoader: same batches on every data-parallel layout, resume, per-host reads (2 processes)."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mlm_jax.data.batch import make_batch
from mlm_jax.data.gpt_dataset import GPTDataset
from mlm_jax.data.indexed_dataset import IndexedDataset, write_indexed_dataset
from mlm_jax.data.loader import BatchLoader

from .conftest import random_documents

SEQ = 16
GBS = 16
EOD = 999

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs the fake 8-device mesh of tests/conftest.py")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    docs = [np.append(d, EOD) for d in random_documents(80, seed=11, vocab=EOD)]
    prefix = write_indexed_dataset(str(tmp_path_factory.mktemp("loader") / "d"), docs, np.uint16)
    low = IndexedDataset(prefix)
    return GPTDataset(low, np.arange(len(low), dtype=np.int32), 6 * GBS, SEQ, seed=3)


MAKE = functools.partial(make_batch, eod=EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)


def expected_batch(dataset, k):
    return MAKE(np.stack([dataset[i] for i in range(k * GBS, (k + 1) * GBS)]))


def mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def layouts():
    """(sharding, batch shape) for several data-parallel sizes, microbatch counts and seq sharding."""
    return [
        ("dp8", NamedSharding(mesh((8,), ("data",)), P(None, "data", None)), (1, 16, SEQ)),
        ("dp4tp2_micro2", NamedSharding(mesh((4, 2), ("data", "tensor")), P(None, "data", None)), (2, 8, SEQ)),
        ("dp2_seq_over_tensor4", NamedSharding(mesh((2, 4), ("data", "tensor")), P(None, "data", "tensor")),
         (4, 4, SEQ)),
        ("one_device", NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P()), (16, 1, SEQ)),
    ]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_batches_equal_on_every_layout(dataset, prefetch):
    for name, sharding, shape in layouts():
        reads = []
        with BatchLoader(dataset, GBS, sharding, shape, MAKE, prefetch=prefetch,
                         on_read=lambda k, ids: reads.append((k, ids.tolist()))) as loader:
            for k in range(3):
                batch, wait = next(loader)
                assert wait >= 0.0
                want = expected_batch(dataset, k)
                assert set(batch) == set(want)
                for key, arr in batch.items():
                    assert arr.shape == shape and arr.sharding == sharding, (name, key)
                    np.testing.assert_array_equal(np.asarray(arr).reshape(GBS, SEQ), want[key], err_msg=name)
        # One process holds every device here, so it reads each sample of the batch exactly once.
        for k, ids in reads[:3]:
            assert ids == list(range(k * GBS, (k + 1) * GBS)), name


def test_resume_gives_the_same_batches(dataset):
    sharding = NamedSharding(mesh((4, 2), ("data", "tensor")), P(None, "data", None))
    with BatchLoader(dataset, GBS, sharding, (2, 8, SEQ), MAKE) as full:
        first = [np.asarray(next(full)[0]["tokens"]) for _ in range(5)]
    with BatchLoader(dataset, GBS, sharding, (2, 8, SEQ), MAKE, start_iteration=3) as resumed:
        again = [np.asarray(next(resumed)[0]["tokens"]) for _ in range(2)]
        assert resumed.iteration == 5
    np.testing.assert_array_equal(again[0], first[3])
    np.testing.assert_array_equal(again[1], first[4])


def test_stops_when_the_dataset_runs_out(dataset):
    sharding = NamedSharding(mesh((8,), ("data",)), P(None, "data", None))
    n = len(dataset) // GBS
    with BatchLoader(dataset, GBS, sharding, (1, 16, SEQ), MAKE, start_iteration=n - 1) as loader:
        next(loader)
        with pytest.raises(StopIteration):
            next(loader)


def test_shape_errors(dataset):
    sharding = NamedSharding(mesh((8,), ("data",)), P(None, "data", None))
    with pytest.raises(ValueError, match="global batch size is 32"):
        BatchLoader(dataset, 32, sharding, (1, 16, SEQ), MAKE)
    with BatchLoader(dataset, GBS, sharding, (1, 16, SEQ + 8), MAKE, prefetch=1) as loader:
        with pytest.raises(ValueError, match="seq_length \\+ 1 = 25"):
            next(loader)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_host_reads_only_its_rows(dataset, tmp_path):
    """Two processes x 4 devices, batch sharded over `data` = 2: each process reads exactly the
    rows its own devices hold (computed independently from the mesh), the two halves are
    disjoint and cover the batch, and the assembled global batch is the single-process one."""
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    worker = os.path.join(os.path.dirname(__file__), "multihost_loader_worker.py")
    prefix = dataset.dataset.path_prefix
    procs = [
        subprocess.Popen([sys.executable, worker, str(i), str(port), prefix, str(tmp_path / f"out{i}.json")],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
        assert p.returncode == 0, out
    results = [json.load(open(tmp_path / f"out{i}.json")) for i in range(2)]
    for k in range(2):
        sets = [set(r["reads"][k]) for r in results]
        for r, s in zip(results, sets):
            assert sorted(s) == r["expected_rows"][k]
            assert len(s) == GBS // 2
        assert sets[0].isdisjoint(sets[1]) and sets[0] | sets[1] == set(range(k * GBS, (k + 1) * GBS))
        want = expected_batch(dataset, k)
        for r in results:
            np.testing.assert_array_equal(np.array(r["tokens"][k]).reshape(GBS, SEQ), want["tokens"])
