import sys

from mlm_jax.serve.command import main

sys.exit(main())
