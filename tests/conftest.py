"""Settings for the whole suite.

The tests never reach the Hugging Face hub (every model is a tiny local one), so the hub libraries are
offline from the start. They read these variables when they are imported, which for multi-rank tests
happens once, in the fork server of `distributed.run_world`, before any test's own setting."""

import os

for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(name, "1")
