"""The KV cache's memory and its layout: the one owner of the block size.

Each layer's K and V caches are one flat allocation of `capacity_tokens` token slots, made once
when the runner starts and never freed while it runs. A block size is a way to cut it: blocks of
`block_size` slots, `capacity_tokens // block_size` of them, block b the contiguous run of memory
[b, b + 1) * block_size slots. Within a block the slots are token-major (block_size, num_kv_heads,
head_dim) or, on the GPU, head-major (num_kv_heads, block_size, head_dim: kernels/reference.py's
`kv_cache_empty`); either way the kernels see the contract's (num_blocks, block_size,
num_kv_heads, head_dim) view.

`KVCacheLayout` is what the runner reports when it builds or re-cuts the cache; the engine sizes
its block manager and swap space from it. Its dtype is the cache's: the model's, or FP8 (one byte
a value, so twice the tokens of bf16 in the same memory; kvpilot.kernels.kv_quant). `relayout` carries out a `RelayoutPlan`
(sched/relayout.py) on flat cache tensors of one layout — the device cache and the host swap
space alike — in batches whose temporary memory the plan bounds.
"""

from __future__ import annotations

import dataclasses
import mmap
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvpilot.kernels.kv_quant import FP8
from kvpilot.runtime.tunables import BLOCK_SIZE

# Temporary memory one relayout batch may use per cache tensor (one layer's K or V): the plan's
# max_batch is derived from it, so a switch needs this much headroom on the device, not a second cache.
RELAYOUT_TEMP_BYTES = 256 << 20


class Writes(Protocol):  # engine.relayout.Writes
    dst: np.ndarray  # (n,) blocks of the larger size
    src: np.ndarray  # (n, k) old blocks, -1 past a sequence's end


class Plan(Protocol):  # sched.relayout.RelayoutPlan, by shape (the executor does not import the engine)
    old_block_size: int
    new_block_size: int
    num_old_blocks: int
    num_new_blocks: int
    batches: tuple[Writes, ...]


@dataclass
class RelayoutCost:
    """What re-laying the cache cost on one rank (`ModelRunner.relayout`). On CUDA the copies may
    still run when it is returned (they are queued ahead of the next step): `finish` waits for them."""

    bytes_moved: int  # written in device memory
    swap_bytes_moved: int  # written in the host swap space
    wait_ms: float  # swap copies in flight, waited for before the re-cut
    copy_ms: float  # the device cache's copies: their device time on CUDA (set by `finish`), else wall time
    swap_ms: float  # the host swap space's re-cut (on CUDA it overlaps the device copies)
    copies: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # CUDA: events around the copies

    def finish(self) -> None:
        """Wait for the device copies and take their device time."""
        if self.copies is not None:
            begin, end = self.copies
            end.synchronize()
            self.copy_ms = begin.elapsed_time(end)
            self.copies = None


@dataclass(frozen=True)
class KVCacheLayout:
    """Where the KV cache lives and how it is cut into blocks right now."""

    block_size: int
    num_blocks: int
    capacity_tokens: int  # slots of the allocation, fixed for the runner's life
    num_layers: int
    num_kv_heads: int  # this rank's share under tensor parallelism
    head_dim: int
    dtype: torch.dtype
    device: str
    head_major: bool
    swap_capacity_tokens: int  # slots of the host swap space (same per-block layout)

    def __post_init__(self) -> None:
        BLOCK_SIZE.check(self.block_size)
        if self.num_blocks != self.capacity_tokens // self.block_size:
            raise ValueError(f"num_blocks {self.num_blocks} does not cut {self.capacity_tokens} slots into blocks of {self.block_size}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def swap_bytes(self) -> int:
        """Host memory of the swap space: whole tokens of every layer's K and V."""
        return self.bytes_per_token * self.swap_capacity_tokens

    @property
    def num_swap_blocks(self) -> int:
        return self.swap_capacity_tokens // self.block_size

    def with_block_size(self, block_size: int) -> KVCacheLayout:
        return dataclasses.replace(self, block_size=block_size, num_blocks=self.capacity_tokens // block_size)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What the cache holds for --kv-cache-dtype: "auto", the model's dtype; "fp8", FP8, which the
    Triton kernels can convert on GPUs of compute capability 8.9 (Ada, Hopper) or later."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"kv_cache_dtype: fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); "
                         f"this one is {major}.{minor}")
    return FP8


def allocate(layout: KVCacheLayout, num_tokens: int) -> torch.Tensor:
    """Flat K and V storage of `num_tokens` slots for every layer on the layout's device, zeroed:
    one allocation, (2 * num_layers, num_tokens * num_kv_heads * head_dim), row 2i layer i's K and
    row 2i + 1 its V. Every row the same distance from the next, so one strided view covers a block
    of all of them (`stacked_view`): the swap space moves a block of every layer with one gather or
    scatter instead of one per row."""
    n = num_tokens * layout.num_kv_heads * layout.head_dim
    if torch.device(layout.device).type != "cpu":
        if layout.dtype.itemsize == 1:  # FP8: zero bytes (+0.0), which any build can fill, viewed as such
            return torch.zeros(2 * layout.num_layers, n, dtype=torch.uint8, device=layout.device).view(layout.dtype)
        return torch.zeros(2 * layout.num_layers, n, dtype=layout.dtype, device=layout.device)
    # on the CPU, anonymous memory: the kernel hands out zeroed pages as they are first written, so
    # start-up does not touch the whole cache (a GiB by default) the way zeros' memset does
    nbytes = 2 * layout.num_layers * n * layout.dtype.itemsize
    memory = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)  # as the weights get (cli.py's THP_MEM_ALLOC_ENABLE)
    return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes).view(layout.dtype).view(2 * layout.num_layers, n)


def block_view(flat: torch.Tensor, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
               head_major: bool) -> torch.Tensor:
    """The (num_blocks, block_size, num_kv_heads, head_dim) view of the first num_blocks blocks."""
    used = flat[:num_blocks * block_size * num_kv_heads * head_dim]
    if head_major:
        return used.view(num_blocks, num_kv_heads, block_size, head_dim).transpose(1, 2)
    return used.view(num_blocks, block_size, num_kv_heads, head_dim)


def views(storage: torch.Tensor, layout: KVCacheLayout, num_blocks: int | None = None,
          head_major: bool | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) block views of `allocate`'s storage under `layout`'s block size."""
    n = layout.num_blocks if num_blocks is None else num_blocks
    hm = layout.head_major if head_major is None else head_major
    rows = [block_view(t, n, layout.block_size, layout.num_kv_heads, layout.head_dim, hm) for t in storage]
    return list(zip(rows[0::2], rows[1::2], strict=True))


def stacked_view(storage: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """`allocate`'s storage as (num_blocks, 2 * num_layers, block_numel) under `layout`'s block
    size: block b of every layer's K and V, each its raw elements in the cache's own per-block order
    (what swap.py's `block_view` gives per tensor), for copies of a block across all layers at once."""
    block_numel = layout.block_size * layout.num_kv_heads * layout.head_dim
    used = storage[:, :layout.num_blocks * block_numel]
    return used.view(storage.shape[0], layout.num_blocks, block_numel).transpose(0, 1)


def max_batch(layout: KVCacheLayout, old_block_size: int, new_block_size: int) -> int:
    """Writes per relayout batch within RELAYOUT_TEMP_BYTES per tensor (a write is one block of the
    larger size, gathered once into temporary memory)."""
    per_write = max(old_block_size, new_block_size) * layout.num_kv_heads * layout.head_dim * layout.dtype.itemsize
    return max(1, RELAYOUT_TEMP_BYTES // per_write)


def relayout(storage: torch.Tensor | list[torch.Tensor], plan: Plan, num_kv_heads: int, head_dim: int,
             head_major: bool) -> int:
    """Re-lay the blocks of the cache tensors — `allocate`'s storage, one row per layer's K or V,
    or a list of flat tensors — cut by `plan.old_block_size`, as `plan` says, in place; returns
    the bytes written.

    Token-major blocks split by re-viewing alone, and merged blocks already in order stay;
    everything else goes through one gather (into temporary memory) and one scatter per batch and
    tensor, the scatter reading the gathered blocks through a permuted view (head-major blocks
    change their order of heads and tokens), so each byte re-laid is read and written twice. The
    copies move words of up to 8 bytes, not elements (a row of head_dim elements is never cut), and
    the indices of every batch go to the device in one upload. One tensor at a time rather than one
    strided view over all of them: over a view of the whole cache (more than 2^31 elements) the
    copy kernels were slower, on the device and on the host (benchmarks/history/2026-12-04.md,
    "Every ordered pair"). No host synchronisation: the copies are queued on the current stream,
    ahead of the next step's kernels."""
    old, new = plan.old_block_size, plan.new_block_size
    if old == new or not plan.batches or (new < old and not head_major):
        return 0  # token-major: the sub-blocks of a block are already its consecutive runs
    split = new < old
    k = old // new if split else new // old
    steps = _steps(plan, k, head_major)
    if not steps:
        return 0
    flats = list(storage)
    words, d = _words(head_dim * flats[0].element_size())
    unit = old * num_kv_heads * d  # words of one old block
    ids = _index(np.concatenate([i for gather, scatter, _ in steps for i in (gather, scatter)]), flats[0].device)
    h, n_old, n_new = num_kv_heads, plan.num_old_blocks, plan.num_new_blocks
    moved, at = 0, 0
    for gather, scatter, copied in steps:
        src_index, dst_index = ids[at:at + len(gather)], ids[at + len(gather):at + len(gather) + len(scatter)]
        at += len(gather) + len(scatter)
        n = len(scatter)
        for flat in flats:
            units = flat.view(words)[:n_old * unit].view(n_old, unit)
            part = units.index_select(0, src_index)  # (blocks, unit)
            if split:  # old block (heads, k, new, dim) -> k new blocks (heads, new, dim) in its own memory
                target = units.view(n_old, k, h, new, d)
                target.index_copy_(0, dst_index, part.view(n, h, k, new, d).transpose(1, 2))
            elif head_major:  # k old blocks (heads, old, dim) -> one new block (heads, k * old, dim)
                regions = flat.view(words)[:n_new * k * unit].view(n_new, h, k, old, d)
                regions.index_copy_(0, dst_index, part.view(n, k, h, old, d).transpose(1, 2))
            else:  # k old blocks, one after another
                regions = flat.view(words)[:n_new * k * unit].view(n_new, k * unit)
                regions.index_copy_(0, dst_index, part.view(n, k * unit))
            del part  # one batch's temporary memory at a time
        moved += copied * unit * words.itemsize * len(flats)
    return moved


def _words(row_bytes: int) -> tuple[torch.dtype, int]:
    """The widest integer type that a row of `row_bytes` bytes is a whole number of, and how many:
    the copy kernels move one element per thread, so bf16 moved as int64 takes a quarter of the
    threads."""
    for words in (torch.int64, torch.int32, torch.int16):
        if row_bytes % words.itemsize == 0:
            return words, row_bytes // words.itemsize
    return torch.uint8, row_bytes


def _steps(plan: Plan, k: int, head_major: bool) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Each batch's copies as (old blocks to gather, blocks to scatter them to, old blocks copied):
    a split scatters every old block to itself (a permutation inside it, k new blocks); a merge
    gathers each write's k old blocks and scatters them to its block of the new size."""
    steps = []
    for batch in plan.batches:
        dst, src = batch.dst, batch.src
        if plan.new_block_size < plan.old_block_size:
            steps.append((dst, dst, len(dst)))
            continue
        slots = k * dst[:, None] + np.arange(k)  # the old blocks inside each target's memory
        if not head_major:  # token-major: a group already in place stays
            move = ~((src == slots) | (src < 0)).all(axis=1)
            dst, src, slots = dst[move], src[move], slots[move]
            if not len(dst):
                continue
        # an unused tail of a group reads the target's own memory: any valid block will do
        steps.append((np.where(src >= 0, src, slots).reshape(-1), dst, int((src >= 0).sum())))
    return steps


def _index(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(device, non_blocking=True)
