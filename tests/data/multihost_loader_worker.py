"""One of two processes for test_loader.test_each_host_reads_only_its_rows (not a test itself).

argv: process_id port dataset_prefix output_json
"""

import json
import sys

import jax

pid, port, prefix, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=60)

import functools  # noqa: E402

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from mlm_jax.data.batch import make_batch  # noqa: E402
from mlm_jax.data.gpt_dataset import GPTDataset  # noqa: E402
from mlm_jax.data.indexed_dataset import IndexedDataset  # noqa: E402
from mlm_jax.data.loader import BatchLoader  # noqa: E402

SEQ, GBS, EOD, MICRO_DP = 16, 16, 999, 8
low = IndexedDataset(prefix)
dataset = GPTDataset(low, np.arange(len(low), dtype=np.int32), 6 * GBS, SEQ, seed=3)
mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
sharding = NamedSharding(mesh, P(None, "data", None))
shape = (GBS // MICRO_DP, MICRO_DP, SEQ)

# Rows this process should read, from the mesh alone: data coordinate r holds rows
# [r * 4, (r + 1) * 4) of every microbatch; it is ours if any device at that coordinate is.
mine = [r for r in range(2) if any(d.process_index == jax.process_index() for d in mesh.devices[r])]

reads = []
make = functools.partial(make_batch, eod=EOD)
result = {"reads": [], "expected_rows": [], "tokens": []}
with BatchLoader(dataset, GBS, sharding, shape, make, on_read=lambda k, ids: reads.append(ids.tolist())) as loader:
    for k in range(2):
        batch, _ = next(loader)
        full = multihost_utils.process_allgather(batch["tokens"], tiled=True)
        result["tokens"].append(np.asarray(full).tolist())
        result["expected_rows"].append(sorted(
            k * GBS + m * MICRO_DP + r * 4 + j for m in range(shape[0]) for r in mine for j in range(4)
        ))
result["reads"] = reads[:2]
with open(out_path, "w") as f:
    json.dump(result, f)
jax.distributed.shutdown()
