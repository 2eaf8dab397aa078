"""`python -m occult_hf.cli ...` (what `torchrun -m` launches) runs the `occult` command line."""

import sys

from . import main

sys.exit(main())
