"""A model folder's safetensors files, and asking the kernel to read them ahead (torch-free).

The engine core of `kvpilot serve` calls `read_ahead` first thing, before it imports torch: from a
cold disk the checkpoint's reads then overlap the seconds of imports and model building instead of
following them, and the weight reader (weight_reader.py) finds most pages already read. From the
page cache it costs next to nothing. A file is asked for once per process.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

_asked: set[Path] = set()  # files whose read-ahead this process has started
_lock = threading.Lock()


def checkpoint_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: those its index names, else every *.safetensors, sorted."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards named in the index are missing: {', '.join(missing)}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    return files


def read_ahead(files: list[Path]) -> None:
    """Start a thread that asks the kernel to read `files` into the page cache, in order (the order
    the reader reads them); files asked for before in this process are skipped."""
    with _lock:
        todo = [f for f in files if f not in _asked]
        _asked.update(todo)
    if todo:
        threading.Thread(target=_advise, args=(todo,), name="kvpilot-read-ahead", daemon=True).start()


def read_ahead_folder(folder: str) -> None:
    """`read_ahead` of a model folder's checkpoint; nothing where the folder holds none (a preset
    name, a folder the loader will refuse with its own message)."""
    try:
        files = checkpoint_files(Path(folder))
    except (OSError, ValueError, KeyError):
        return
    read_ahead(files)


def _advise(files: list[Path]) -> None:
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
