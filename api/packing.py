"""Packing a directory for upload (uploads are single files): a dataset saved with `Dataset.save_to_disk` becomes one
zip that the API reads with pyarrow (`core.formats.read_hf`); a pipe (`/dev/stdin`, bash's `<(…)`) becomes a file.
Used by the CLI and by `api.client.Client`; no httpx and no click here, so either may import it cheaply."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import zipfile
from pathlib import Path

from core.errors import InvalidInput


@contextlib.contextmanager
def pack_saved_dataset(folder: Path):
    """A directory written by `Dataset.save_to_disk`, packed into one zip for upload (removed afterwards).

    Only the files a saved dataset has at its top level are packed (state.json, dataset_info.json, *.arrow)."""
    if (folder / "dataset_dict.json").is_file():
        raise InvalidInput(
            f"{folder} is a DatasetDict (it holds splits): save one split, e.g. "
            "`ds['train'].save_to_disk(path)`, and pass that directory"
        )
    if not (folder / "state.json").is_file():
        raise InvalidInput(
            f"{folder} is a directory but not a dataset saved with save_to_disk (no state.json): "
            "pass a JSONL, CSV or Parquet file, or a save_to_disk directory"
        )
    with tempfile.TemporaryDirectory(prefix="gpujobs-") as tmp:
        packed = Path(tmp) / f"{folder.name or 'dataset'}.hf.zip"
        with zipfile.ZipFile(packed, "w", zipfile.ZIP_STORED) as archive:  # Arrow files barely compress
            for path in sorted(folder.iterdir()):
                if path.is_file() and (path.suffix in (".arrow", ".json")):
                    archive.write(path, path.name)
        yield packed


@contextlib.contextmanager
def spooled(stream: Path):
    """What a pipe (or another file that is not a regular one: `--input /dev/stdin`, `--input <(jq …)`) holds, read
    to its end into a temporary file of the same name (removed afterwards): an upload states its size before its
    body, and a pipe has none until it is read (httpx sent a Content-Length of 0, then failed on the bytes after)."""
    with tempfile.TemporaryDirectory(prefix="gpujobs-") as tmp:
        copy = Path(tmp) / (stream.name or "input")
        with open(stream, "rb") as source, open(copy, "wb") as target:
            shutil.copyfileobj(source, target)
        yield copy
