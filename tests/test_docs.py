"""Every fenced ```python and ```bash block of README.md and docs/*.md runs, as a user would run it.

Each document runs in its own temporary workspace, its blocks in order (a later block may use an
earlier block's files), each block in a fresh process: python blocks with this interpreter, bash
blocks with `bash -e` where `python` is this interpreter, `occult` is `python -m occult_hf.cli`, and
`torchrun` / `accelerate` are those of this interpreter (multi-process blocks run on CPU with gloo).
The workspace holds tiny random models under the hub ids the docs use (`allenai/OLMoE-1B-7B-0924`
is a directory there, so `from_pretrained` loads it locally), a word-level tokenizer, and small text
files (`corpus.txt`, `train.txt`, `train.jsonl`, `heldout.txt`); the hub is offline.

A block that cannot run here (it needs a GPU, the hub, many processes, or data the project does not
ship) carries, on the line right before its opening fence:

    <!-- doc-test: skip (the reason) -->

A block that reads `../shared/` (the session's recorded routing data, not part of the project) runs
when that folder exists beside the repository and is skipped with that reason otherwise. Set
`OCCULT_DOC_TEST=README.md:43` (path:line of the fence) to run one block, with its document's earlier
blocks before it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from distributed import free_port

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP_MARK = re.compile(r"^\s*<!--\s*doc-test:\s*skip\s*\((?P<reason>.+)\)\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
BLOCK_TIMEOUT_S = 420

#: hub ids in the docs -> the tiny family that stands in for them
HUB_STAND_INS = {
    "allenai/OLMoE-1B-7B-0924": "olmoe",
    "allenai/OLMoE-1B-7B-0125": "olmoe",
    "Qwen/Qwen1.5-MoE-A2.7B": "qwen2_moe",
    "Qwen/Qwen1.5-MoE-A2.7B-Chat": "qwen2_moe",
    "Qwen/Qwen3-30B-A3B": "qwen3_moe",
    "deepseek-ai/DeepSeek-V2-Lite": "deepseek_v2",
    "deepseek-ai/DeepSeek-V3": "deepseek_v3",
    "deepseek-ai/deepseek-moe-16b-base": "deepseek",
}


@dataclass(frozen=True)
class Block:
    document: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        return f"{self.document.relative_to(REPO)}:{self.line}"


def parse_blocks(document: Path) -> list[Block]:
    """The ```python / ```bash blocks of a markdown file, with their skip marks."""
    lines = document.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match or not match.group("lang"):
            i += 1
            continue
        start, lang = i, match.group("lang")
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        if lang not in ("python", "bash"):
            continue
        mark = SKIP_MARK.match(lines[start - 1]) if start > 0 else None
        blocks.append(Block(document, start + 1, lang, "\n".join(body) + "\n", mark.group("reason") if mark else None))
    return blocks


def test_skip_marks_are_well_formed():
    """A mark that is not right before a runnable block's fence (or that has no reason) is an error."""
    problems = []
    for document in DOCUMENTS:
        lines = document.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if "doc-test" not in line:
                continue
            following = lines[number] if number < len(lines) else ""
            fence = FENCE.match(following)
            if not SKIP_MARK.match(line):
                problems.append(f"{document.name}:{number}: malformed mark {line.strip()!r}")
            elif not fence or fence.group("lang") not in ("python", "bash"):
                problems.append(f"{document.name}:{number}: the mark is not right before a ```python/```bash fence")
    assert problems == []


# ----- the workspace ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Path:
    """One directory holding the tiny models (under their hub ids) and the text files, built once."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import save_tiny_tokenizer, tiny_checkpoint, tiny_sentences

    root = tmp_path_factory.mktemp("doc_stand_ins")
    runnable = "".join(b.code for d in DOCUMENTS for b in parse_blocks(d) if b.skip_reason is None)
    built = {}
    for hub_id, family in HUB_STAND_INS.items():
        if hub_id not in runnable:  # building a family's checkpoint costs seconds: only those the docs run
            continue
        target = root / hub_id
        target.parent.mkdir(parents=True, exist_ok=True)
        if family in built:
            target.symlink_to(built[family], target_is_directory=True)
            continue
        tiny_checkpoint(family, target, seed=1, num_experts=16, top_k=4, output_router_logits=False)
        save_tiny_tokenizer(target)
        built[family] = target
    for name, (count, seed) in {"corpus.txt": (200, 0), "train.txt": (200, 1), "heldout.txt": (64, 2)}.items():
        (root / name).write_text("\n".join(tiny_sentences(count, seed)) + "\n")
    with open(root / "train.jsonl", "w") as f:
        for sentence in tiny_sentences(200, 3):
            f.write(json.dumps({"text": sentence}) + "\n")
    return root


def _workspace(stand_ins: Path, tmp_path: Path) -> Path:
    """`tmp_path/work` with the stand-ins linked in, and `tmp_path/shared` -> the repository's ../shared
    when that exists (docs refer to `../shared/...` from the repository root)."""
    work = tmp_path / "work"
    work.mkdir()
    for entry in stand_ins.iterdir():
        (work / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    if SHARED.is_dir():
        (tmp_path / "shared").symlink_to(SHARED, target_is_directory=True)
    return work


def _environment(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg", HF_DATASETS_CACHE=str(tmp_path / "datasets_cache"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")])),
        OCCULT_DOC_PYTHON=sys.executable,
        PET_MASTER_PORT=str(free_port()),  # torchrun's --master-port, not the 29500 every launch shares
    )  # fmt: skip
    return env


BASH_PRELUDE = """set -eo pipefail
python() { "$OCCULT_DOC_PYTHON" "$@"; }
occult() { "$OCCULT_DOC_PYTHON" -m occult_hf.cli "$@"; }
torchrun() { "$OCCULT_DOC_PYTHON" -m torch.distributed.run "$@"; }
accelerate() { "$OCCULT_DOC_PYTHON" -m accelerate.commands.accelerate_cli "$@"; }
export -f python occult torchrun accelerate
"""


def run_block(block: Block, work: Path, env: dict) -> subprocess.CompletedProcess:
    if block.lang == "python":
        command = [sys.executable, "-c", block.code]
    else:
        command = ["bash", "-c", BASH_PRELUDE + block.code]
    return subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)


def _selected(document: Path) -> list[Block]:
    """The document's blocks up to and including `OCCULT_DOC_TEST`'s, or all of them."""
    blocks = parse_blocks(document)
    wanted = os.environ.get("OCCULT_DOC_TEST")
    if not wanted:
        return blocks
    names = [b.name for b in blocks]
    if wanted not in names:
        return []
    return blocks[: names.index(wanted) + 1]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_document_blocks_run(document, stand_ins, tmp_path):
    blocks = _selected(document)
    if not blocks:
        pytest.skip(f"{document.name} has no python/bash block (or not the one OCCULT_DOC_TEST names)")
    work, env = _workspace(stand_ins, tmp_path), _environment(tmp_path)
    ran, skipped = [], []
    for block in blocks:
        if block.skip_reason is not None:
            skipped.append(f"{block.name}: {block.skip_reason}")
            continue
        if "../shared" in block.code and not SHARED.is_dir():
            skipped.append(f"{block.name}: reads ../shared, data the project does not ship")
            continue
        result = run_block(block, work, env)
        if result.returncode != 0:
            pytest.fail(
                f"{block.name} ({block.lang}) failed with exit code {result.returncode}:\n{block.code}\n"
                f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-6000:]}",
                pytrace=False,
            )
        ran.append(block.name)
    if not ran:
        pytest.skip("; ".join(skipped))
