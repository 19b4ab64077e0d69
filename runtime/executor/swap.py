"""The swap space: host memory that preempted sequences' KV blocks are copied out to and back from.

Terms. A *block's bytes* are everything one KV block holds across the model: for each layer its K
and its V slice, each `block_size * num_kv_heads * head_dim` elements in the device cache's own
per-block layout (head-major on the GPU, see `kv_cache_empty`). The swap space keeps them whole:

  host     (num_swap_blocks, num_layers, 2, block_numel)   pinned on CUDA, allocated once (when first needed)
  staging  (num_staging_blocks, num_layers, 2, block_numel) on the device, allocated once

so one host block is one contiguous run and a sequence's host blocks, allocated as a run by the
scheduler, are one contiguous range. `host_kv_caches()` views `host` in the device caches' logical
shape (num_swap_blocks, block_size, num_kv_heads, head_dim), with the same per-block strides.

A transfer moves whole blocks across all layers: swap-out gathers the device blocks into
`staging` (one `index_select` over the runner's `stacked` view of every layer's K and V, which
kv_cache.allocate lays out at equal distances in one allocation; one per layer and K/V for
caches without one), then copies each contiguous run of host blocks with one `copy_`; swap-in is the mirror image. Both run on a
side CUDA stream, ordered by events rather than host syncs:

* swap-out: the side stream first waits for the compute stream (the blocks' last writes), and the
  compute stream waits for the gather only (the step may hand those device blocks to others and
  write them), not for the device-to-host copy, which overlaps the step's forward pass;
* swap-in: nothing waits when it is issued. The scheduler does not run a sequence in the step
  that swaps it in, so the copy overlaps that step; `before_forward()` makes the compute stream
  wait for the swap-ins of earlier steps before the next forward pass reads them.

Copies on the side stream run in issue order, so a host block freed by a swap-in and reused by a
later swap-out, or staging reused by the next transfer, needs no further ordering. On the CPU the
same code runs without streams or events (every copy is done when it returns).

FP8 caches are moved as their bytes (`_movable`): the copies only move them, and torch's CPU
ops lack float8 variants of some (index_copy_).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

# Device memory for staging when the swap space is larger: one 8k-token Llama-3-8B sequence (1 GiB
# of KV in bf16), or several shorter ones. A step that swaps out more still works, in chunks; the
# step then waits for all but the last chunk's copy, as each gather must wait for staging to empty.
MAX_STAGING_BYTES = 1 << 30


@dataclass
class SwapStats:
    """Transfers issued since the last `take_stats()`; seconds are measured on the side stream
    (events) on CUDA, so they count copy time, not the host's."""

    num_blocks_out: int = 0
    num_blocks_in: int = 0
    seconds_out: float = 0.0
    seconds_in: float = 0.0


def block_view(cache: torch.Tensor) -> torch.Tensor:
    """`cache` (num_blocks, ...) as (num_blocks, block_numel): each block's raw elements, whatever
    the order of the dimensions inside a block, as long as a block is one dense run of memory."""
    block_numel = cache[0].numel()
    expected, dense = 1, cache.stride(0) == block_numel
    for stride, size in sorted(zip(cache.stride()[1:], cache.shape[1:], strict=True)):
        dense = dense and (size == 1 or stride == expected)
        expected *= size
    if not dense:
        raise ValueError(f"a KV block must be one dense run of memory (shape {tuple(cache.shape)}, strides {cache.stride()})")
    return cache.as_strided((cache.shape[0], block_numel), (block_numel, 1))


def _movable(t: torch.Tensor) -> torch.Tensor:
    """`t`, or for a one-byte float (FP8) the same memory as uint8."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def _runs(ids: list[int]) -> Iterator[tuple[int, int, int]]:
    """(position in `ids`, first id, length) of each run of consecutive ids, in order."""
    start = 0
    for _, group in itertools.groupby(enumerate(ids), key=lambda p: p[1] - p[0]):
        items = list(group)
        yield start, items[0][1], len(items)
        start += len(items)


class SwapSpace:
    def __init__(self, kv_caches: KVCaches, swap_bytes: int, staging_bytes: int = MAX_STAGING_BYTES,
                 stacked: torch.Tensor | None = None) -> None:
        first = _movable(kv_caches[0][0])
        self.device = first.device
        self.dtype = first.dtype
        self.is_cuda = self.device.type == "cuda"
        # allocated once, for the life of the engine (a block-size change re-views the same memory),
        # and not before it is needed: pinning gigabytes of host memory takes seconds that a start
        # does not spend (`allocate_host`, called after Ready while idle, or by the first transfer)
        self._swap_bytes = swap_bytes
        self._host_bytes: torch.Tensor | None = None
        self._host: torch.Tensor | None = None  # `host`, cut for the current block size
        self._staging_bytes = torch.empty(min(swap_bytes, staging_bytes), dtype=torch.uint8, device=self.device)
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        # the last swap-in issued by the current step's `swap()`, and the last of earlier steps
        self._issued_in: torch.cuda.Event | None = None
        self._pending_in: torch.cuda.Event | None = None
        self._timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._stats = SwapStats()
        self.bind(kv_caches, stacked)

    def bind(self, kv_caches: KVCaches, stacked: torch.Tensor | None = None) -> None:
        """Use these device caches (a new block size): the host memory is re-cut into blocks of the
        new size, and what it held is no longer valid. Waits for transfers in flight. `stacked`:
        the same caches as one (num_blocks, 2 * num_layers, block_numel) view, K0, V0, K1, ...
        (kv_cache.stacked_view), so that a transfer moves a block of every layer in one copy."""
        self.synchronize()
        kv_caches = [(_movable(k), _movable(v)) for k, v in kv_caches]
        stacked = None if stacked is None else _movable(stacked)
        first = kv_caches[0][0]
        self.num_layers = len(kv_caches)
        self.block_numel = block_view(first).shape[1]
        if stacked is not None and (stacked.shape != (first.shape[0], 2 * self.num_layers, self.block_numel)
                                    or stacked.data_ptr() != first.data_ptr()):
            raise ValueError(f"the stacked view {tuple(stacked.shape)} is not the {2 * self.num_layers} caches' blocks")
        self._stacked = stacked
        # layer-major: K0, V0, K1, ...; one at a time where no stacked view covers them
        self._caches = [block_view(c) for kv in kv_caches for c in kv] if stacked is None else []
        self._logical_shape, self._logical_strides = tuple(first.shape[1:]), first.stride()[1:]
        self.bytes_per_block = 2 * self.num_layers * self.block_numel * self.dtype.itemsize
        self.num_blocks = self._swap_bytes // self.bytes_per_block
        self.num_staging_blocks = self._staging_bytes.numel() // self.bytes_per_block
        if self.num_blocks and not self.num_staging_blocks:
            raise ValueError(f"the staging buffer ({self._staging_bytes.numel()} bytes) holds no block of {self.bytes_per_block} bytes")
        self._host = None
        self.staging = self._cut(self._staging_bytes, self.num_staging_blocks)

    @property
    def host_allocated(self) -> bool:
        return self._host_bytes is not None

    def allocate_host(self) -> None:
        """The host memory, allocated (pinned on CUDA) if it was not yet."""
        if self._host_bytes is None:
            self._host_bytes = torch.empty(self._swap_bytes, dtype=torch.uint8, pin_memory=self.is_cuda)

    @property
    def host(self) -> torch.Tensor:
        """The host blocks (num_swap_blocks, num_layers, 2, block_numel); allocated on first use."""
        if self._host is None:
            self.allocate_host()
            assert self._host_bytes is not None
            self._host = self._cut(self._host_bytes, self.num_blocks)
        return self._host

    def recut(self, kv_caches: KVCaches, moves: list[tuple[list[int], list[int], int]],
              stacked: torch.Tensor | None = None) -> int:
        """`bind` to the device caches of a new block size, keeping the KV of swapped sequences:
        each move is (host blocks in the old cut, host blocks in the new cut, tokens held). Their
        tokens are read out of the old cut first (host memory for them meanwhile), so any new
        blocks will do; one gather and one scatter per sequence, every layer at once. Returns the
        bytes written into the new cut."""
        self.synchronize()
        old_view = self._token_view() if moves else None  # no move: no host memory needed yet
        saved = []
        for old, _, num_tokens in moves:
            assert old_view is not None
            blocks = old_view[torch.tensor(old, dtype=torch.long)]  # (blocks, layers, 2, block_size, heads, dim)
            tokens = blocks.movedim(0, 2).flatten(2, 3)[:, :, :num_tokens]  # (layers, 2, tokens, heads, dim)
            saved.append(tokens)
        self.bind(kv_caches, stacked)
        if not moves:
            return 0
        new_view = self._token_view()
        block_size = new_view.shape[3]
        written = 0
        for (_, new, num_tokens), tokens in zip(moves, saved, strict=True):
            if len(new) * block_size < num_tokens:
                raise ValueError(f"{len(new)} blocks of {block_size} cannot hold {num_tokens} tokens")
            padded = tokens.new_zeros((*tokens.shape[:2], len(new) * block_size, *tokens.shape[3:]))
            padded[:, :, :num_tokens] = tokens
            blocks = padded.unflatten(2, (len(new), block_size)).movedim(2, 0)
            new_view[torch.tensor(new, dtype=torch.long)] = blocks
            written += tokens.numel() * tokens.element_size()
        return written

    def _token_view(self) -> torch.Tensor:
        """The host blocks as (num_swap_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), in
        the device caches' per-block strides."""
        flat = self.host.view(-1)
        return flat.as_strided((self.num_blocks, self.num_layers, 2, *self._logical_shape),
                               (self.num_layers * 2 * self.block_numel, 2 * self.block_numel, self.block_numel,
                                *self._logical_strides), flat.storage_offset())

    def _cut(self, raw: torch.Tensor, num_blocks: int) -> torch.Tensor:
        shape = (num_blocks, self.num_layers, 2, self.block_numel)
        return raw[:num_blocks * self.bytes_per_block].view(self.dtype).view(shape)

    def host_kv_caches(self) -> KVCaches:
        """The host blocks as per-layer (K, V) views of the device caches' logical shape
        (num_swap_blocks, block_size, num_kv_heads, head_dim) and per-block strides."""
        stride0 = self.num_layers * 2 * self.block_numel
        flat = self.host.view(-1)
        views = [flat.as_strided((self.num_blocks, *self._logical_shape), (stride0, *self._logical_strides),
                                 flat.storage_offset() + (layer * 2 + kv) * self.block_numel)
                 for layer in range(self.num_layers) for kv in range(2)]
        return list(zip(views[0::2], views[1::2], strict=True))

    # ---- transfers --------------------------------------------------------------------------

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Issue the copies of (device, host) pairs out, then (host, device) pairs in. Call once per
        step, before its forward pass, even with nothing to copy: the call marks the step, and the
        swap-ins of earlier steps become ones the next forward pass waits for."""
        if self._issued_in is not None:
            self._pending_in, self._issued_in = self._issued_in, None  # later events cover earlier ones
        if not swap_out and not swap_in:
            return
        compute = torch.cuda.current_stream(self.device) if self._stream is not None else None
        with torch.inference_mode(), self._on_side_stream(compute):
            if swap_out:
                self._timed("out", lambda: self._swap_out(sorted(swap_out, key=lambda p: p[1]), compute))
                self._stats.num_blocks_out += len(swap_out)
            if swap_in:
                self._timed("in", lambda: self._swap_in(sorted(swap_in)))
                self._stats.num_blocks_in += len(swap_in)
                if self._stream is not None:
                    self._issued_in = self._stream.record_event()

    @property
    def has_unmarked_swap_in(self) -> bool:
        """A swap-in was issued and no later `swap()` call has marked its step as past."""
        return self._issued_in is not None

    def _swap_out(self, pairs: list[tuple[int, int]], compute: torch.cuda.Stream | None) -> None:
        for chunk in self._chunks(pairs):
            self._gather(chunk)
            if compute is not None and self._stream is not None:  # the step may now reuse these blocks
                compute.wait_event(self._stream.record_event())
            self._store(chunk)

    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        for chunk in self._chunks(pairs):
            self._load(chunk)

    def _gather(self, chunk: list[tuple[int, int]]) -> None:
        """Device blocks of (device, host) pairs into staging rows 0.., every layer's K and V."""
        ids = self._index([d for d, _ in chunk])
        if self._stacked is not None:  # one gather for every layer
            torch.index_select(self._stacked, 0, ids, out=self.staging[:len(chunk)].flatten(1, 2))
            return
        for i, cache in enumerate(self._caches):  # (num_blocks, block_numel) each
            torch.index_select(cache, 0, ids, out=self.staging[:len(chunk), i // 2, i % 2])

    def _store(self, chunk: list[tuple[int, int]]) -> None:
        """Staging rows to their host blocks: one copy per run of consecutive host ids."""
        for pos, first, length in _runs([h for _, h in chunk]):
            self.host[first:first + length].copy_(self.staging[pos:pos + length], non_blocking=True)

    def _load(self, chunk: list[tuple[int, int]]) -> None:
        """Host blocks of (host, device) pairs through staging into their device blocks."""
        for pos, first, length in _runs([h for h, _ in chunk]):
            self.staging[pos:pos + length].copy_(self.host[first:first + length], non_blocking=True)
        ids = self._index([d for _, d in chunk])
        if self._stacked is not None:  # one scatter for every layer
            self._stacked.index_copy_(0, ids, self.staging[:len(chunk)].flatten(1, 2))
            return
        for i, cache in enumerate(self._caches):
            cache.index_copy_(0, ids, self.staging[:len(chunk), i // 2, i % 2])

    def _chunks(self, pairs: list[tuple[int, int]]) -> Iterator[list[tuple[int, int]]]:
        for start in range(0, len(pairs), self.num_staging_blocks):
            yield pairs[start:start + self.num_staging_blocks]

    def _index(self, ids: list[int]) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.long)
        if not self.is_cuda:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)  # no host sync

    @contextlib.contextmanager
    def _on_side_stream(self, compute: torch.cuda.Stream | None) -> Iterator[None]:
        if self._stream is None or compute is None:
            yield
            return
        self._stream.wait_stream(compute)  # the blocks' last writes, the step's frees
        with torch.cuda.stream(self._stream):
            yield

    def _timed(self, direction: str, transfer: Callable[[], None]) -> None:
        if self._stream is None:
            start = time.perf_counter()
            transfer()
            self._add_seconds(direction, time.perf_counter() - start)
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(self._stream)
        transfer()
        end.record(self._stream)
        self._timings.append((direction, begin, end))

    def _add_seconds(self, direction: str, seconds: float) -> None:
        if direction == "out":
            self._stats.seconds_out += seconds
        else:
            self._stats.seconds_in += seconds

    # ---- ordering with the compute stream ---------------------------------------------------

    def before_forward(self) -> None:
        """Call on the compute stream before each forward pass: it waits for the swap-ins of
        earlier steps (not this step's, whose sequences do not run in it)."""
        if self._pending_in is not None:
            torch.cuda.current_stream(self.device).wait_event(self._pending_in)
            self._pending_in = None

    def synchronize(self) -> None:
        """Wait on the host for every transfer issued (before the device caches are freed)."""
        if self._stream is not None:
            self._stream.synchronize()

    def take_stats(self) -> SwapStats:
        """Transfers and their seconds since the last call. On CUDA the seconds of transfers still
        in flight are counted at a later call, once their events have completed (no host sync)."""
        in_flight = []
        for direction, begin, end in self._timings:
            if end.query():
                self._add_seconds(direction, begin.elapsed_time(end) / 1000)
            else:
                in_flight.append((direction, begin, end))
        self._timings = in_flight
        stats, self._stats = self._stats, SwapStats()
        return stats
