"""Settings for the whole suite.

The tests never reach the Hugging Face hub (every model is a tiny local one), so the hub libraries are
offline from the start. They read these variables when they are imported, which for multi-rank tests
happens once, in the fork server of `distributed.run_world`, before any test's own setting.

Every process of the suite computes with one thread: setup.cfg runs two pytest workers on the 2-core
machine, and the tests' tensors are tiny, so a second intra-op thread per worker only contends with the other
worker (with two threads each, `test_tiny_models`' gradient checks took 22-58 s each instead of 0.4-0.6 s).
Subprocesses inherit the setting.
"""

import os

for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(name, "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
