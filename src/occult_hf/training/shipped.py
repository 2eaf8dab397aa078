"""What ships inside the package for the runs that need no download: the tiny trained checkpoint (`occult demo`,
`occult eval` without a model) and the demo's text, occult_hf's own sources frozen at one commit (`occult demo`
profiles on it; the offline lm-eval tasks are built from its held-out half)."""

from __future__ import annotations

import json
import lzma
import os
from importlib import resources
from pathlib import Path

from ..utils.strict_json import parse_json

#: the checkpoint that ships in the package (made by `occult train --recipe tiny`), for `occult demo`
TINY_CHECKPOINT = "tiny_olmoe"


def tiny_checkpoint_path():
    """The path of the shipped tiny checkpoint (a directory inside the installed package)."""
    return resources.files("occult_hf") / "data" / TINY_CHECKPOINT


#: the demo's text: occult_hf's own `.py` sources frozen at one commit (`snapshot_sources`), lzma-compressed JSON
DEMO_SOURCES = "demo_sources.json.xz"


def demo_sources() -> list[str]:
    """The demo's documents: this package's own `.py` files, in sorted path order, as frozen in
    `data/demo_sources.json.xz` (its `meta` names the commit).

    Frozen because the installed sources are not a fixed text: they change with every commit, and an
    editable install holds `src/occult_hf` only where a wheel also holds `kernels/`, `patches/` and
    `eval/`. Read live, they would move the demo's figures, which README.md and docs/cli.md quote, with every
    change to the code."""
    with resources.as_file(resources.files("occult_hf") / "data" / DEMO_SOURCES) as path:
        snapshot = parse_json(lzma.decompress(Path(path).read_bytes()), f"the demo's sources {DEMO_SOURCES!r}")
    return [text for _, text in snapshot["files"]]


def snapshot_sources(root: str | os.PathLike, out: str | os.PathLike, commit: str) -> None:
    """Freeze the `.py` files under `root` (a checkout's `src/occult_hf` at `commit`) into `out`, in sorted
    path order, as `demo_sources` reads them. Made once by

        git archive COMMIT src/occult_hf | tar -x -C /tmp/snap
        python -c "from occult_hf.training.shipped import snapshot_sources as s; s('/tmp/snap/src/occult_hf', 'src/occult_hf/data/demo_sources.json.xz', 'COMMIT')"
    """
    from ..utils.atomic import atomic_write_bytes

    root = Path(root)
    files = [[path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")]
             for path in sorted(root.rglob("*.py")) if "__pycache__" not in path.parts]  # fmt: skip
    meta = {"what": "occult_hf's own .py sources (src/occult_hf), the text of `occult demo`", "commit": commit}
    atomic_write_bytes(out, lzma.compress(json.dumps({"meta": meta, "files": files}).encode("utf-8")))


__all__ = ["DEMO_SOURCES", "TINY_CHECKPOINT", "demo_sources", "snapshot_sources", "tiny_checkpoint_path"]
