"""`python -m occult_hf.eval ...`: lm-eval's own command line with `occult-hf` and `occult23` available.

lm-eval 0.4.13 finds plugin models only when their module has been imported, so its `lm-eval`
console script cannot see `occult-hf`; this entry point imports `occult_hf.eval` first. When the
command line has no `--include_path`, the `occult23` task folder is added as one (lm-eval takes a
single include path on its command line; give your own folder with `--include_path` and the suite
is not added).

    python -m occult_hf.eval run --model occult-hf \
        --model_args pretrained=allenai/OLMoE-1B-7B-0924,placement=placement.json,num_devices=8 \
        --tasks occult23 --batch_size 8 --output_path results/
"""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

from . import TASKS_DIR  # registers occult-hf and the CoQA metrics shim


def main() -> None:
    arguments = sys.argv[1:]
    if arguments and not any(arg == "--include_path" or arg.startswith("--include_path=") for arg in arguments):
        sys.argv += ["--include_path", str(TASKS_DIR)]
    cli_evaluate()


if __name__ == "__main__":
    main()
