"""Checkpoint bytes from disk to the device: the readers of a folder of safetensors files.

This is one half of loading a model; the other, what the model does with each tensor (fusing,
slicing for tensor parallelism, quantising), is the model's `load_weights` (models/llama.py). A
reader yields `(name, WeightSource)` pairs; a source's `read(dim, start, length)` returns the tensor,
or the slice of it this rank needs, wherever the reader put it (the CPU or the device), and the
model copies it into its parameter.

Two readers:

* `safetensors` — the safetensors library's own lazy slices (memory-mapped files): a slice read
  reads only its bytes, into CPU memory; the copy to the device is the parameter's. A thread asks
  the kernel to read the files ahead meanwhile (checkpoint_files.py; `kvpilot serve`'s engine
  core asks first thing, before its imports).
* `fastsafetensors` — the fastsafetensors package (optional: `pip install fastsafetensors`), which
  copies each file to the device with parallel reads through pinned bounce buffers (or GPUDirect
  Storage where the node has it); sources are views of that device buffer, so each parameter's
  copy stays on the device. One file is held at a time: the extra device memory is one shard's.

`KVPILOT_WEIGHT_READER` (`auto`, `safetensors`, `fastsafetensors`) picks one, read once when a
model loads; `auto` is safetensors, the faster of the two where `kvpilot bench startup` timed both
on a GPU with the checkpoint in the page cache (benchmarks/RESULTS.md, Start-up): a parameter's
copy from a memory-mapped page costs less than staging every file through bounce buffers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime.executor.checkpoint_files import checkpoint_files, read_ahead

READER_SWITCH = "KVPILOT_WEIGHT_READER"
READERS = ("auto", "safetensors", "fastsafetensors")


def choose_reader() -> str:
    """The reader `KVPILOT_WEIGHT_READER` names (`auto`: safetensors)."""
    choice = os.environ.get(READER_SWITCH, "auto") or "auto"
    if choice not in READERS:
        raise ValueError(f"{READER_SWITCH}={choice!r}: must be one of {', '.join(READERS)}")
    installed = find_spec("fastsafetensors") is not None
    if choice == "fastsafetensors" and not installed:
        raise ValueError(f"{READER_SWITCH}=fastsafetensors but the fastsafetensors package is not installed "
                         "(pip install fastsafetensors)")
    return "safetensors" if choice == "auto" else choice


class TensorSource:
    """A checkpoint tensor already in memory (the CPU or the device): a read is a view of it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.shape = tuple(tensor.shape)
        self.bytes_read = 0

    def read(self, dim: int | None = None, start: int = 0, length: int = 0) -> torch.Tensor:
        t = self._tensor if dim is None else self._tensor.narrow(dim, start, length)
        self.bytes_read += t.numel() * t.element_size()
        return t


class SafetensorsSlice:
    """One checkpoint tensor, read whole or in part (only the asked-for bytes leave the file)."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.bytes_read = 0

    def read(self, dim: int | None = None, start: int = 0, length: int = 0) -> torch.Tensor:
        if dim is None:
            t = self._slice[...]  # any number of dims, none included (a per-tensor scale)
        elif dim == 0:
            t = self._slice[start:start + length]
        else:
            t = self._slice[:, start:start + length]
        self.bytes_read += t.numel() * t.element_size()
        return t


def safetensors_weights(files: list[Path]) -> Iterator[tuple[str, SafetensorsSlice]]:
    from safetensors import safe_open

    read_ahead(files)  # from a cold disk, the slices' page faults then find most pages already read
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, SafetensorsSlice(f, name)


def fastsafetensors_weights(files: list[Path], device: torch.device) -> Iterator[tuple[str, TensorSource]]:
    """Each file copied whole to `device` by fastsafetensors' parallel reader, then its tensors
    handed out as views; the buffer is freed before the next file is read."""
    from fastsafetensors import SafeTensorsFileLoader

    # nogds: GPUDirect Storage needs the cuFile driver on the node; where it is, fastsafetensors
    # falls back by itself only with warnings, so the bounce-buffer path is asked for outright
    loader = SafeTensorsFileLoader(None, device=str(device), nogds=True)
    try:
        for file in files:
            loader.add_filenames({0: [str(file)]})
            buffers = loader.copy_files_to_device()
            try:
                for name in loader.get_keys():
                    yield name, TensorSource(buffers.get_tensor(name))
            finally:
                buffers.close()
                loader.reset()
    finally:
        loader.close()


def checkpoint_weights(folder: Path, device: torch.device, reader: str) -> Iterator[tuple[str, Any]]:
    """(name, source) for every tensor of the folder's checkpoint, read by `reader`."""
    files = checkpoint_files(folder)
    if reader == "fastsafetensors":
        return fastsafetensors_weights(files, device)
    return safetensors_weights(files)
