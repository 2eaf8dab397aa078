"""Settings for the whole suite.

The tests never reach the Hugging Face hub (every model is a tiny local one), so the hub libraries are
offline from the start. They read these variables when they are imported, which for multi-rank tests
happens once, in the fork server of `distributed.run_world`, before any test's own setting."""

import os

for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(name, "1")


def pytest_collection_finish(session):
    """Start the interpreted Triton kernel tests (a child pytest of about a minute on one core) as soon as the suite
    is collected, when it is selected, so that they run beside the rest of the suite on the second core; the test
    that owns them waits for their result (`test_triton_kernels.test_interpreted_kernels_in_child_process`)."""
    for item in session.items:
        if item.name == "test_interpreted_kernels_in_child_process":
            item.module.start_interpreted_run()
