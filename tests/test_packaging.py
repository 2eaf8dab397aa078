"""The wheel maps kernels/, patches/ and eval/ into the occult_hf namespace (docs/design.md §5)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: one pytest worker runs this module, so the wheel is built once
pytestmark = pytest.mark.xdist_group("packaging")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # build from a clean copy: setuptools reuses a checkout's build/ folder, which can hide a package
    # missing from setup.cfg behind files copied there by an earlier build
    source = tmp_path_factory.mktemp("source") / "occult_hf"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".git", ".venv", "docs", ".whl", ".gl", ".devdata"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
    )
    (whl,) = out.glob("occult_hf-*.whl")
    return whl


def _source_packages() -> list[str]:
    """Installed module paths of every package in the source tree, by the package_dir mapping."""
    roots = {"src/occult_hf": "occult_hf", "kernels": "occult_hf/kernels", "patches": "occult_hf/patches", "eval": "occult_hf/eval"}
    found = []
    for root, installed in roots.items():
        for init in (REPO / root).rglob("__init__.py"):
            found.append(f"{installed}/{init.parent.relative_to(REPO / root).as_posix()}/__init__.py".replace("/./", "/"))
    return found


def test_wheel_holds_every_subpackage(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [p for p in _source_packages() if p not in names]
    assert not missing, f"packages absent from {wheel.name} (add them to setup.cfg): {missing}"
    for module in ("config.py", "kernels/layout.py", "kernels/expert_mlp_reference.py", "patches/base.py", "eval/__init__.py",
                   "data/tiny_olmoe_routing.npz", "data/tiny_olmoe/model.safetensors",  # the studies' default data
                   "data/demo_sources.json.xz",  # occult demo's text
                   "scale/h200_measurements.json"):  # occult plan-cluster's calibration
        assert f"occult_hf/{module}" in names, f"occult_hf/{module} missing from {wheel.name}"
    assert not any(n.startswith(("kernels/", "patches/", "eval/", "tests/")) for n in names), "top-level leak"


def test_wheel_declares_console_script_and_extras(wheel):
    with zipfile.ZipFile(wheel) as zf:
        dist_info = next(n.split("/")[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    assert "occult = occult_hf.cli:main" in entry_points
    assert "Requires-Dist: transformers<6,>=5.17" in metadata
    assert 'Provides-Extra: eval' in metadata
    assert "Requires-Dist: tabulate>=0.9" in metadata  # every table occult_hf prints (occult demo's too)
    # triton only for the interpreter tests (issue 32: a hard dependency cost a CPU user 999 MB); a CUDA torch brings its own
    triton = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: triton")]
    assert triton and all('extra == "test"' in line for line in triton), triton


def test_the_kernels_folder_never_hides_hugging_faces_kernels():
    """Run in the clone (its root first on `sys.path`, as `python -m pytest` and `python -m occult_hf.cli` put it),
    `import kernels` is the installed `kernels` distribution, which transformers 5.25 on imports with every model, or an
    empty module where none is installed (transformers before 5.25 imports it to probe); the folder's code runs only
    as `occult_hf.kernels`, and transformers' models import."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        hub = Path(distribution("kernels").locate_file("kernels/__init__.py")).resolve()
    except PackageNotFoundError:
        hub = None
    code = (
        "import occult_hf.kernels\n"
        "print(occult_hf.kernels.__file__)\n"
        "import kernels, transformers.activations\n"
        "print(kernels.__file__)\n"
        "print(hasattr(kernels, 'ExpertSegments'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    ours, imported, exports_ours = run.stdout.splitlines()
    assert Path(ours).resolve() == REPO / "kernels" / "__init__.py"
    assert Path(imported).resolve() == (hub or REPO / "kernels" / "__init__.py")
    assert exports_ours == "False"
