"""Text data as Hugging Face users pass it: a local file, a `save_to_disk` directory or a hub dataset.

    data = load_text_dataset("train.jsonl", text_column="text")          # .txt .json .jsonl .csv .parquet
    data = load_text_dataset("saved_dir", split="validation")             # Dataset(Dict).save_to_disk
    data = load_text_dataset("wikitext", config="wikitext-2-raw-v1")      # hub (or a local dataset repo)

Everything goes through `datasets` (`load_dataset` with the builder that the file's extension names,
or `load_from_disk`), so JSON Lines are parsed rather than read as raw lines, and the text column is
checked by name. `occult profile` and the fine-tune entry point (`python -m occult_hf.hf.finetune`) use it.
"""

from __future__ import annotations

import os

from ..utils.checks import names_a_local_path
from ..utils.dataset_errors import parsed

#: file extension -> the `datasets` packaged builder that reads it
DATA_FILE_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
_SAVE_TO_DISK_MARKERS = ("dataset_dict.json", "state.json")


def data_file_builder(path: str | os.PathLike) -> str | None:
    """The `datasets` builder for a local data file (by extension, `.gz` etc. looked through), or None."""
    name = os.fspath(path).lower()
    for compression in (".gz", ".bz2", ".xz", ".zst"):
        name = name.removesuffix(compression)
    return DATA_FILE_BUILDERS.get(os.path.splitext(name)[1])


def is_save_to_disk_directory(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in _SAVE_TO_DISK_MARKERS)


def load_text_dataset(source: str | os.PathLike, config: str | None = None, split: str = "train", text_column: str = "text"):
    """A `datasets.Dataset` (one split) with a column `text_column`, from a file, a directory or the hub.

    Args:
        source: a local data file (`DATA_FILE_BUILDERS`), a directory written by `save_to_disk`, a local
            dataset directory (data files, optionally with configurations) or a hub dataset name.
        config: the dataset configuration (`load_dataset(path, name=config)`); an error for a single file
            or a `save_to_disk` directory, which have none.
        split: the split to take.
        text_column: the column holding the text (or token-id lists); an error lists the columns if absent.
    """
    import datasets

    path = os.fspath(source)
    if os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path)):
        raise ValueError(f"data {path!r} is not a regular file or a directory (a pipe or a device?); give a data file")
    if os.path.isfile(path):
        builder = data_file_builder(path)
        if builder is None:
            raise ValueError(
                f"data file {path!r} has an extension datasets cannot read; use one of {sorted(DATA_FILE_BUILDERS)}"
            )
        _no_config(config, path, "a single data file")
        if os.path.getsize(path) == 0:
            raise ValueError(f"data file {path!r} is empty")
        # one local file: a ValueError of the read is about it (a file of blank lines: "... corresponds to no data")
        data = parsed(lambda: datasets.load_dataset(builder, data_files={split: path}, split=split), f"data file {path!r}", also=(ValueError,))
        if builder == "text":
            data = _without_byte_order_mark(data)
    elif is_save_to_disk_directory(path):
        _no_config(config, path, "a save_to_disk directory")
        data = datasets.load_from_disk(path)
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"split {split!r} is not in {path!r}; its splits are {list(data)}")
            data = data[split]
    else:
        if not os.path.isdir(path) and os.path.splitext(path)[1].lower() in DATA_FILE_BUILDERS:
            raise FileNotFoundError(f"data file {path!r} does not exist")
        if not os.path.isdir(path) and names_a_local_path(path):  # at once, not after the Hub's retries
            raise FileNotFoundError(f"data {path!r} does not exist (and it is not a Hub dataset name)")
        data = parsed(lambda: datasets.load_dataset(path, config, split=split), f"dataset {path!r}")
    if text_column not in data.column_names:
        raise ValueError(
            f"text column {text_column!r} is not in {path!r}; its columns are {data.column_names} (set --text-column)"
        )
    _check_column_type(data, text_column, path)
    if os.path.exists(path) and not is_save_to_disk_directory(path):  # parsed from local files just now
        _check_column(data, text_column, path)
    return data


def _without_byte_order_mark(data):
    """A text file's lines without the byte-order mark a file saved on Windows starts with: the text builder keeps it
    as the first line's first character (its `encoding="utf-8-sig"` is not applied to a `.gz` file), and the json
    and csv builders drop it. Only such a file pays for the rewrite."""
    if not len(data) or not data[0]["text"].startswith("\ufeff"):
        return data
    return data.map(lambda row, index: {"text": row["text"].removeprefix("\ufeff") if index == 0 else row["text"]},
                    with_indices=True, desc="dropping the byte-order mark")  # fmt: skip


def _check_column_type(data, text_column: str, path: str) -> None:
    """Raise unless the column holds what profiling and fine-tuning read, text (or lists of integer token ids), in
    every row: numbers, records or a missing value would fail only when read, after the model loaded. The Arrow
    type and null count are metadata, cheap for a dataset of any size."""
    import pyarrow
    import pyarrow.compute

    column = data.data.column(text_column)
    kind = column.type
    is_text = pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)
    is_ids = _is_list(kind) and pyarrow.types.is_integer(kind.value_type)
    if not (is_text or is_ids):
        raise ValueError(
            f"text column {text_column!r} of {path!r} holds {data.features[text_column]}, not text or token-id lists; "
            f"its columns are {data.column_names} (set --text-column)"
        )
    if column.null_count:
        row = pyarrow.compute.index(pyarrow.compute.is_null(column), True).as_py()
        raise ValueError(
            f"text column {text_column!r} of {path!r} is null (no value) in {column.null_count} row(s), the first "
            f"of them row {row}: drop or fill those rows"
        )


def _is_list(kind) -> bool:
    import pyarrow

    return pyarrow.types.is_list(kind) or pyarrow.types.is_large_list(kind) or pyarrow.types.is_fixed_size_list(kind)


def _check_column(data, text_column: str, path: str) -> None:
    """pyarrow's JSON reader keeps strings that are not UTF-8 (a Latin-1 `.jsonl`), which fail only when read, after
    the model loaded: one validating pass over the column (in Arrow, no Python strings) finds them now. Only for
    local files just parsed (a pass no longer than the parse): a hub or `save_to_disk` dataset was written by Arrow,
    and reading all of a large one would cost what `--max-tokens` saves."""
    import pyarrow

    try:
        data.data.column(text_column).validate(full=True)
    except pyarrow.ArrowInvalid as error:
        raise ValueError(f"text column {text_column!r} of {path!r} cannot be read ({' '.join(str(error).split())[:300]})") from None


def _no_config(config: str | None, path: str, what: str) -> None:
    if config is not None:
        raise ValueError(
            f"dataset config {config!r} was given for {path!r}, {what}, which has no configurations; "
            f"drop --dataset-config (it selects a configuration of a hub dataset or a local dataset directory)"
        )


__all__ = ["DATA_FILE_BUILDERS", "data_file_builder", "is_save_to_disk_directory", "load_text_dataset"]
