"""Tensor parallelism: one replica across several devices, Megatron style.

Every rank holds a slice of each layer: attention heads and KV cache split by KV head, the MLP
split along its intermediate size, embedding and LM head split by vocabulary. Column-parallel
projections (q/k/v, gate/up) need no communication; row-parallel ones (o, down) end in one
all-reduce; the vocabulary-parallel embedding ends in an all-reduce and the LM head in an
all-gather. Rank 0 runs the scheduler and broadcasts each step's inputs; ranks 1..N-1 run in
processes of their own (worker.py). NCCL on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total`."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size: {self.size} does not divide {what} ({total})")
        length = total // self.size
        return self.rank * length, length

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int, device: torch.device) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj`; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_group(rank: int, size: int, port: int, device_type: str) -> TPInfo:
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    else:
        # share the host's cores between the ranks instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(minutes=10))
    return TPInfo(rank, size)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
