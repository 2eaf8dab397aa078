"""A Hugging Face Hub kept in memory, for the tests of pushes: what transformers' and occult_hf's pushes call on
`transformers.utils.hub.hf_api()`, answered without a network.

Every call's keywords are bound to huggingface_hub's own `HfApi` signatures, so a keyword the real client would refuse
fails here too, and recorded in `calls`. `upload_folder` picks the files as huggingface_hub does
(`filter_repo_objects` with its default ignore patterns); `run_as_future` runs the job at once, as the client's one
worker would run it before the next job, and keeps its error in the future as that worker does.
"""

from __future__ import annotations

import inspect
from concurrent.futures import Future
from pathlib import Path


class MemoryHub:
    """Repositories in memory: `repos[repo_id][branch][path] = bytes`; `commit_error` makes every commit fail."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, dict[str, bytes]]] = {}
        self.calls: list[tuple[str, dict]] = []
        self.commit_error: Exception | None = None

    def _record(self, name: str, *args, **kwargs) -> dict:
        from huggingface_hub import HfApi

        bound = inspect.signature(getattr(HfApi, name)).bind(None, *args, **kwargs).arguments
        bound.pop("self")
        self.calls.append((name, bound))
        return bound

    def create_repo(self, *args, **kwargs):
        repo_id = self._record("create_repo", *args, **kwargs)["repo_id"]
        self.repos.setdefault(repo_id, {"main": {}})
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def create_branch(self, *args, **kwargs):
        call = self._record("create_branch", *args, **kwargs)
        branches = self.repos[call["repo_id"]]
        branches.setdefault(call["branch"], dict(branches["main"]))

    def create_commit(self, *args, **kwargs):
        from huggingface_hub import CommitOperationDelete

        call = self._record("create_commit", *args, **kwargs)
        if self.commit_error is not None:
            raise self.commit_error
        tree = self.repos[call["repo_id"]].setdefault(call.get("revision") or "main", {})
        for operation in call["operations"]:
            if isinstance(operation, CommitOperationDelete):
                del tree[operation.path_in_repo]
            else:
                tree[operation.path_in_repo] = Path(operation.path_or_fileobj).read_bytes()
        return type("CommitInfo", (), {"pr_revision": None})()

    def list_repo_files(self, *args, **kwargs):
        call = self._record("list_repo_files", *args, **kwargs)
        return sorted(self.repos[call["repo_id"]].get(call.get("revision") or "main", {}))

    def run_as_future(self, fn, *args, **kwargs):
        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:  # the client's worker keeps a job's error in its future, as here
            future.set_exception(error)
        return future

    def upload_folder(self, *args, **kwargs):
        from huggingface_hub import CommitOperationAdd
        from huggingface_hub.utils import filter_repo_objects
        from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

        call = self._record("upload_folder", *args, **kwargs)
        if call.pop("run_as_future", False):
            return self.run_as_future(self.upload_folder, **call)
        root = Path(call["folder_path"]).resolve()
        files = [path.relative_to(root).as_posix() for path in sorted(root.glob("**/*")) if path.is_file()]
        ignored = [*(call.get("ignore_patterns") or []), *DEFAULT_IGNORE_PATTERNS]
        chosen = filter_repo_objects(files, allow_patterns=call.get("allow_patterns"), ignore_patterns=ignored)
        prefix = f"{call['path_in_repo'].strip('/')}/" if call.get("path_in_repo") else ""
        operations = [CommitOperationAdd(path_or_fileobj=str(root / n), path_in_repo=prefix + n) for n in chosen]
        return self.create_commit(repo_id=call["repo_id"], operations=operations, token=call.get("token"),
                                  commit_message=call.get("commit_message") or "Upload folder",
                                  revision=call.get("revision"))  # fmt: skip

    def card(self, repo_id: str):
        """The repository's model card, as `ModelCard.load` finds it (`EntryNotFoundError` where it has none)."""
        from huggingface_hub import ModelCard
        from huggingface_hub.errors import EntryNotFoundError

        text = self.repos.get(repo_id, {}).get("main", {}).get("README.md")
        if text is None:
            raise EntryNotFoundError(f"{repo_id} has no README.md")
        return ModelCard(text.decode())

    def download(self, repo_id: str, directory: Path) -> Path:
        """The repository's main branch written to `directory`, for `from_pretrained`."""
        for name, data in self.repos[repo_id]["main"].items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(data)
        return directory
