"""The only part of the engine that touches tensors: owns the model and the KV cache, turns a
step's inputs (plain lists the engine builds: inputs.py) into tensors (batch.py), runs the forward
pass and samples. It knows nothing of the scheduler's sequences; the random generators of seeded
sequences live in its `SeededSampler` (sampler.py), keyed by sequence id.

Under tensor parallelism every rank has a runner over its slice of the model and KV cache; rank
0's `launch` broadcasts the step's inputs and the other ranks' `follow` loop runs them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator

import torch

from kvpilot.kernels import ops as kernel_ops
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.executor import kv_cache, probes
from kvpilot.runtime.executor.batch import fill_pending, to_device, to_tensors
from kvpilot.runtime.executor.cpu_linear import pack_linears
from kvpilot.runtime.executor.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    DecodeGraphs,
    GraphsBySize,
    model_forward,
)
from kvpilot.runtime.executor.inputs import StepInputs
from kvpilot.runtime.executor.kv_cache import KVCacheLayout
from kvpilot.runtime.executor.loader import copy_threads, load_model, resolve_dtype
from kvpilot.runtime.executor.models.llama import cos_sin_cache
from kvpilot.runtime.executor.parallel import TPInfo
from kvpilot.runtime.executor.sampler import (
    DevicePromptLogprobs,
    DeviceSample,
    SeededSampler,
    score_prompt,
)
from kvpilot.runtime.executor.swap import MAX_STAGING_BYTES, SwapSpace, SwapStats
from kvpilot.runtime.startup import StartupLog
from kvpilot.runtime.tunables import BLOCK_SIZES

logger = logging.getLogger(__name__)

GiB = 1 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPInfo | None = None, startup: StartupLog | None = None) -> None:
        self.config = config
        self.tp = tp or TPInfo()
        self.startup = startup or StartupLog("core")
        device = config.device.device
        self.device = torch.device(f"cuda:{self.tp.rank}" if device == "cuda" else device)
        self.dtype = resolve_dtype(config.model.dtype, device)
        self.model, self.model_config = load_model(config.model, str(self.device), self.tp, self.startup)
        if self.device.type == "cpu":
            with self.startup.phase("cpu_pack"), copy_threads(self.device):
                # weights packed once for oneDNN (decode steps are bound by reading them; cpu_linear.py)
                pack_linears(self.model, config.scheduler.max_num_seqs)
        self.num_kv_heads = self.model.layers[0].num_kv_heads  # this rank's share
        with self.startup.phase("kernel_select"):  # the CPU's C kernels are built here on a fresh cache
            self.ops = kernel_ops.select(self.device)
        self.rope = cos_sin_cache(self.model_config, config.model.max_model_len, self.device)
        # the layout owns the block size and the swap space's size; its block count is known once
        # the cache is sized
        self.layout = KVCacheLayout(
            block_size=config.cache.block_size, num_blocks=0, capacity_tokens=0,
            num_layers=self.model_config.num_layers, num_kv_heads=self.num_kv_heads,
            head_dim=self.model_config.head_dim, device=str(self.device),
            dtype=kv_cache.cache_dtype(config.cache.kv_cache_dtype, self.dtype, self.device),
            head_major=self.device.type == "cuda",  # the decode kernel streams each (block, KV head) as one run
            swap_capacity_tokens=0)
        self.layout = dataclasses.replace(  # --swap-space GiB, per rank under tensor parallelism
            self.layout, swap_capacity_tokens=int(config.cache.swap_space_gib * GiB) // self.layout.bytes_per_token)
        self.graphs: DecodeGraphs | None = None  # captured once the KV cache exists
        self.swap_space: SwapSpace | None = None  # made once the KV cache exists
        self.kv_scales_source: str | None = None  # where an FP8 cache's scales came from
        if self.layout.dtype != self.dtype:  # FP8: the scales before any step writes the cache
            with self.startup.phase("kv_scales") as settled:
                self.kv_scales_source = settled["source"] = probes.settle_kv_scales(
                    self.model, config, dataclasses.replace(self.layout, dtype=self.dtype),
                    self.model_config.vocab_size, self._probe_live)
        with self.startup.phase("kv_profile") as profiled:  # a worst-case forward pass on CUDA (its first)
            cached = probes.triton_cache_entries()
            # profiled_step_tokens: the largest step the device memory was sized for (CUDA: a larger
            # one could run out of it); None where nothing was profiled
            num_blocks, self.profiled_step_tokens = probes.num_kv_blocks(config, self.layout, self.device,
                                                                         self._probe_live)
            num_blocks = self.tp.min_int(num_blocks, self.device)  # ranks must agree
            profiled.update(num_blocks=num_blocks, kernels_compiled=probes.triton_cache_entries() - cached)
        self.layout = dataclasses.replace(self.layout, num_blocks=num_blocks, capacity_tokens=num_blocks * self.block_size)
        with self.startup.phase("kv_alloc", bytes=num_blocks * self.bytes_per_block):
            # one allocation for the runner's life: a block-size change re-cuts it in place (kv_cache.py)
            self._kv_storage = kv_cache.allocate(self.layout, self.layout.capacity_tokens)
            self._views_by_size: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            self.kv_caches = self._caches_for(self.block_size)
        staging = min(self.layout.swap_bytes, MAX_STAGING_BYTES)
        with self.startup.phase("swap_alloc", bytes=staging):
            # the swap space: the device cache's per-block layout, whole blocks across layers (swap.py);
            # its device staging now, its host memory after Ready (`allocate_swap_host`)
            self.swap_space = SwapSpace(self.kv_caches, self.layout.swap_bytes,
                                        stacked=kv_cache.stacked_view(self._kv_storage, self.layout))
        self._graph_sets = GraphsBySize()
        # the largest decode batch the graphs are captured for: the start's max_num_seqs, raised
        # with it (`fit_decode_graphs`); the runner reads no live tunable from `config`
        self._decode_batch = config.scheduler.max_num_seqs
        self._compiled: set[int] = set()  # block sizes whose kernel variants are compiled
        self.sampler = SeededSampler(self.device)  # holds seeded sequences' own random streams
        self._sampled: torch.Tensor | None = None  # the latest step's sampled tokens, on the device
        self._prepare_start()

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def _uses_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: on CUDA, unless --enforce-eager; under tensor
        parallelism the steps stay eager (graphs over NCCL collectives have not been run here: no
        machine with several GPUs was lent)."""
        return self.device.type == "cuda" and not self.config.device.enforce_eager and self.tp.size == 1

    def _prepare_start(self) -> None:
        """What serving needs before the engine is ready (cuda_graphs.py): the kernels and decode
        graphs of the block size it starts with. The other allowed sizes' come after it is ready
        (`prepare_later`), except under tensor parallelism, where every rank must run the same
        probes together: there all sizes' kernels are compiled now."""
        if self.device.type != "cuda":
            return
        sizes = self.allowed_block_sizes if self.tp.size > 1 else [self.block_size]
        with self.startup.phase("kernels", block_sizes=sizes) as compiled:
            cached = probes.triton_cache_entries()
            for size in sizes:
                self._compile_kernels(size)
            compiled["kernels_compiled"] = probes.triton_cache_entries() - cached
        if self._uses_graphs:
            with self.startup.phase("graphs") as captured:
                self.graphs = self._graphs_for(self.block_size)
                assert self.graphs is not None
                captured.update(batch_sizes=len(self.graphs.sizes), block_sizes=[self.block_size])

    def allocate_swap_host(self) -> None:
        """The swap space's host memory, which no step needs until the first swap-out (one that
        comes first allocates it itself)."""
        assert self.swap_space is not None
        self.swap_space.allocate_host()

    def prepare_later(self) -> Iterator[str]:
        """The start-up work that serving does not need yet, one unit per item: for each other
        allowed block size (nearest first), its kernels, then its decode graphs one batch size at
        a time. The engine runs the units between steps (engine/warm_up.py); each yields what it
        did. A size that a live change prepared meanwhile (`_graphs_for`) is skipped."""
        if self.device.type != "cuda" or self.tp.size > 1:
            return
        here = self.block_size
        for size in sorted(self.allowed_block_sizes, key=lambda s: (abs(s.bit_length() - here.bit_length()), s)):
            if size not in self._compiled:
                self._compile_kernels(size)
                yield f"kernels for block size {size}"
            if not self._uses_graphs or self._graph_sets.get(size) is not None:
                continue
            graphs = self._new_graphs(size)
            while not graphs.complete:
                # captured meanwhile by a live change, or for a smaller batch than max_num_seqs now asks
                # (`fit_decode_graphs`): left to `_graphs_for`
                if self._graph_sets.get(size) is not None or graphs.max_batch < min(self._decode_batch,
                                                                                     MAX_CAPTURE_SIZE):
                    break
                with torch.inference_mode():
                    graphs.capture_next(self._graph_sets.pool)
                yield f"a decode graph for block size {size}"
            else:
                self._graph_sets.add(size, graphs)
                logger.info("captured CUDA graphs for %d decode batch sizes at block size %d in %.2f s (after ready)",
                            len(graphs.sizes), size, graphs.capture_seconds)

    @property
    def allowed_block_sizes(self) -> list[int]:
        """The block sizes this cache can be cut into (at least one block)."""
        return [size for size in BLOCK_SIZES if self.layout.with_block_size(size).num_blocks > 0]

    @property
    def captured_block_sizes(self) -> list[int]:
        """The block sizes whose decode graphs are captured."""
        return self._graph_sets.block_sizes

    def _compile_kernels(self, block_size: int) -> None:
        """Run `probes.kernel_probes` on a cut of `block_size`, so that every Triton kernel variant
        a step of this size can launch is compiled now rather than in some step mid-run (seconds of
        stalled decoding: the kernels leave the integer arguments that vary from step to step
        unspecialised, so shapes no longer pick variants). No step writes the cache: this also runs
        while sequences hold blocks."""
        self._compiled.add(block_size)
        for step in probes.kernel_probes(self.layout.with_block_size(block_size), self.config.model.max_model_len,
                                         self.num_kv_heads, self.device):
            self._probe(step, self._caches_for(block_size), block_size)

    def _probe(self, inputs: StepInputs, caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
               ops: kernel_ops.Ops | None = None) -> None:
        """One eager forward pass and its logits over `caches` (with `ops`, else the runner's), for
        what it leaves behind (peak memory, compiled kernels, the caches' contents), not for its
        results."""
        ops = ops or self.ops
        input_ids, positions, meta = to_tensors(inputs, self.device)
        with torch.inference_mode():
            hidden = self.model(input_ids, caches, ops.plan(meta, positions, self.rope, block_size), ops)
            self.model.compute_logits(hidden[inputs.logits_rows])

    def _probe_live(self, inputs: StepInputs, caches: list[tuple[torch.Tensor, torch.Tensor]],
                    ops: kernel_ops.Ops | None) -> None:
        """`_probe` at the live block size (a `probes.Probe`)."""
        self._probe(inputs, caches, self.block_size, ops)

    def _graphs_for(self, block_size: int) -> DecodeGraphs | None:
        """The decode graphs of `block_size`, captured now (and its kernels compiled) if they were
        not yet."""
        if not self._uses_graphs:
            return None
        found = self._graph_sets.get(block_size)
        if found is not None:
            return found
        if block_size not in self._compiled:
            self._compile_kernels(block_size)
        graphs = self._new_graphs(block_size)
        with torch.inference_mode():
            self._graph_sets.capture(block_size, graphs)
        return graphs

    def _new_graphs(self, block_size: int) -> DecodeGraphs:
        forward = model_forward(self.model, self._caches_for(block_size), self.rope, self.ops.for_graphs())
        return DecodeGraphs(forward, self._decode_batch, -(-self.config.model.max_model_len // block_size),
                            self.device)

    def fit_decode_graphs(self, max_num_seqs: int) -> None:
        """Decode graphs for batches of up to `max_num_seqs` (a live raise of the limit): every
        captured block size's graphs are captured again for the larger batch, so its decode steps
        replay a graph instead of running eagerly. A lower limit keeps the graphs (a smaller batch
        pads into them)."""
        if max_num_seqs <= self._decode_batch:
            return
        self._decode_batch = max_num_seqs  # graphs captured from now on hold it
        if self.graphs is None or min(max_num_seqs, MAX_CAPTURE_SIZE) <= self.graphs.max_batch:
            return
        sizes = self._graph_sets.block_sizes
        self.graphs, self._graph_sets = None, GraphsBySize()  # the old graphs and their pool go
        torch.cuda.empty_cache()
        for size in sorted(sizes, key=lambda s: s != self.block_size):  # the live size first
            self._graphs_for(size)
        self.graphs = self._graphs_for(self.block_size)

    @property
    def num_swap_blocks(self) -> int:
        """Host blocks of the swap space (--swap-space GiB; per rank under tensor parallelism)."""
        return self.layout.num_swap_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block

    def relayout(self, block_size: int, plan: kv_cache.Plan,
                 swap_moves: list[tuple[list[int], list[int], int]]) -> kv_cache.RelayoutCost:
        """Re-cut the KV cache into blocks of `block_size` in place, re-laying the blocks `plan`
        keeps (sched/relayout.py), and the swap space with it, keeping each swapped sequence's KV
        (`swap_moves`: old host blocks, new host blocks, tokens; swap.py's `recut`). Returns the
        bytes written and where the time went (this rank's). The allocation, its views of every
        size and every size's decode graphs stay. On CUDA the device copies are only queued, ahead
        of the next step's kernels: the caller's bookkeeping overlaps them (`RelayoutCost.finish`)."""
        if self.tp.size > 1 and self.tp.rank == 0:
            self.tp.broadcast(("relayout", (block_size, plan, swap_moves)))
        new = self.layout.with_block_size(block_size)
        if plan.num_new_blocks != new.num_blocks or plan.old_block_size != self.block_size:
            raise ValueError(f"the plan re-cuts {plan.old_block_size} -> {plan.num_new_blocks} blocks; this cache is "
                             f"{self.block_size} -> {new.num_blocks}")
        assert self.swap_space is not None
        started = time.perf_counter()
        self.swap_space.synchronize()  # copies in flight still read and write the old cut
        waited = time.perf_counter()
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        geometry = (new.num_kv_heads, new.head_dim, new.head_major)
        with torch.inference_mode():
            moved = kv_cache.relayout(self._kv_storage, plan, *geometry)
        if events is not None:
            events[1].record()
        copied = time.perf_counter()
        # views made outside inference mode, as at start: the swap space's copies may run outside it
        self.layout = new
        self.kv_caches = self._caches_for(block_size)
        host_moved = self.swap_space.recut(self.kv_caches, swap_moves, kv_cache.stacked_view(self._kv_storage, new))
        recut = time.perf_counter()
        self.graphs = self._graphs_for(block_size)
        return kv_cache.RelayoutCost(bytes_moved=moved, swap_bytes_moved=host_moved, wait_ms=(waited - started) * 1e3,
                                     copy_ms=(copied - waited) * 1e3, swap_ms=(recut - copied) * 1e3, copies=events)

    def _caches_for(self, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (K, V) block views of the cache cut into blocks of `block_size`, made once."""
        found = self._views_by_size.get(block_size)
        if found is None:
            found = self._views_by_size[block_size] = kv_cache.views(self._kv_storage, self.layout.with_block_size(block_size))
        return found

    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Issue this step's copies of (device, host) block pairs out to the swap space and (host,
        device) pairs back in (swap.py: they overlap the forward pass). Call once every step, before
        `launch`, even with no pairs: the swap space counts steps by these calls."""
        assert self.swap_space is not None
        if self.tp.size > 1 and self.tp.rank == 0 and (swap_out or swap_in or self.swap_space.has_unmarked_swap_in):
            self.tp.broadcast(("swap", (swap_out, swap_in)))
        self.swap_space.swap(swap_out, swap_in)

    def take_swap_stats(self) -> SwapStats:
        """Blocks moved and seconds the copies took since the last call (this rank's)."""
        assert self.swap_space is not None
        return self.swap_space.take_stats()

    def _run(self, inputs: StepInputs) -> tuple[torch.Tensor | None, DevicePromptLogprobs | None]:
        """Forward pass on this rank: logits (num_logits_rows, vocab), None when nothing samples,
        and the prompt logprobs the step's inputs ask for (inputs.py), None when none (and on
        tensor-parallel followers)."""
        if self.swap_space is not None:
            self.swap_space.before_forward()  # blocks swapped in by earlier steps are resident
        hidden = None
        if self.graphs is not None and inputs.is_decode_only:
            hidden = self.graphs.run(inputs, self._sampled)
        if hidden is None:
            input_ids, positions, meta = to_tensors(inputs, self.device)
            fill_pending(input_ids, inputs, self._sampled)
            plan = self.ops.plan(meta, positions, self.rope, self.block_size)
            hidden = self.model(input_ids, self.kv_caches, plan, self.ops)
        prompt = None
        if inputs.prompt_logprob_rows:
            rows = to_device(inputs.prompt_logprob_rows, torch.long, self.device)
            targets = to_device(inputs.prompt_logprob_targets, torch.long, self.device)
            prompt = score_prompt(self.model.compute_logits, hidden[rows], targets, inputs.prompt_logprob_k,
                                  self.model_config.vocab_size, keep=self.tp.rank == 0)
        if not inputs.logits_rows:
            return None, prompt
        if len(inputs.logits_rows) == hidden.shape[0]:  # every row samples (the rows ascend): decodes
            return self.model.compute_logits(hidden), prompt
        rows = to_device(inputs.logits_rows, torch.long, self.device)
        return self.model.compute_logits(hidden[rows]), prompt

    @torch.inference_mode()
    def launch(self, inputs: StepInputs) -> tuple[DeviceSample | None, DevicePromptLogprobs | None]:
        """Queue one step and its sampling (a token for each sampling row, in order) on the device
        without waiting for either (on a GPU): the host may prepare the next step meanwhile, whose
        pending tokens (inputs.py) come from this step's samples. The samples (None when nothing
        samples) and the prompt logprobs the inputs ask for (None when none)."""
        self.sampler.forget(inputs.finished_seq_ids)
        if self.tp.size > 1:  # the other ranks need only the model's inputs
            self.tp.broadcast(("step", dataclasses.replace(inputs, sampling_rows=[], finished_seq_ids=[])))
        logits, prompt = self._run(inputs)
        sampled = self.sampler.sample(logits, inputs.sampling_rows) if logits is not None else None
        self._sampled = sampled.token_ids if sampled is not None else None
        return sampled, prompt

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks 1..N-1: run what rank 0 broadcasts until it says stop."""
        while True:
            command, payload = self.tp.broadcast()
            if command == "step":
                self._run(payload)
            elif command == "relayout":
                self.relayout(*payload)
            elif command == "swap":
                self.swap_blocks(*payload)
            elif command == "stop":
                return

    def stop_workers(self) -> None:
        if self.tp.size > 1 and self.tp.rank == 0:
            self.tp.broadcast(("stop", None))

