"""A stand-in process for tests/test_multihost.py (not a test itself).

`python tests/multihost_worker.py fail OUT_DIR`: joins the run through mlm_jax.distributed (the
MLM_JAX_* variables launch/local.sh sets), records its pid in OUT_DIR/pid<process id>; process 1
then fails through `distributed.fail` (exit 3) while the others hang as if stuck in a collective,
so only the launcher can stop them.

`python tests/multihost_worker.py join TIMEOUT`: process 0 of 2 alone: the coordinator is up, but
nobody else joins within TIMEOUT seconds.
"""

import os
import sys
import time

from mlm_jax.config import DistributedConfig
from mlm_jax.distributed import fail, initialize

mode = sys.argv[1]
if mode == "fail":
    plan = initialize()
    with open(os.path.join(sys.argv[2], f"pid{plan.process_id}"), "w") as f:
        f.write(str(os.getpid()))
    if plan.process_id == 1:
        time.sleep(1.0)  # let the others record their pids first
        sys.exit(fail("deliberate failure for the launcher test", 3))
    time.sleep(600)
elif mode == "join":
    port = int(sys.argv[3])
    initialize(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=0,
                                 coordinator_timeout=float(sys.argv[2])))
    print("joined (unexpected)")
else:
    sys.exit(f"unknown mode {mode}")
