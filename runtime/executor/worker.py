"""Tensor-parallel workers: ranks 1..N-1, each a process of its own whose `ModelRunner` follows
rank 0's commands (parallel.py says how the model is split). Rank 0 is the engine's process.

Every wait on a worker is bounded by the workers' liveness. A monitor thread in rank 0 watches
each worker's process; when one exits or fails (at start, while loading, mid-run), it records
the worker's error (sent back over a pipe), stops the other workers (their collectives would
wait on the dead one), and aborts an NCCL group, whose collectives would otherwise wait for its
timeout (gloo's fail at once when a peer's socket closes). Rank 0's blocked call then returns
with an error, which the engine turns into `WorkerDiedError` carrying the worker's. A worker in
turn exits when rank 0's process goes away, so no worker is ever orphaned.

A script that creates an engine at module level without an `if __name__ == "__main__":` guard
runs again in each spawned worker, which would start workers of its own: that worker exits with
`EXIT_UNGUARDED_MAIN` and rank 0 raises with the fix.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch.distributed as dist

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.errors import EngineDeadError
from kvpilot.runtime.executor.model_runner import ModelRunner
from kvpilot.runtime.executor.parallel import TPInfo, destroy_group, free_port, init_group

logger = logging.getLogger(__name__)

EXIT_UNGUARDED_MAIN = 87  # a worker found itself re-running the user's main module
STOP_TIMEOUT_S = 30.0  # a worker told to stop gets this long before it is killed
CONFIRM_DEATH_S = 5.0  # after an error in rank 0, how long to wait for a worker's exit to show

GUARD_HINT = (
    "the script that creates the engine runs again in each tensor-parallel worker (workers are "
    "spawned, so they import the main module): put that code under `if __name__ == \"__main__\":`"
)


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel worker exited or failed; the engine can run nothing more."""


class Workers:
    """Ranks 1..N-1 of one engine, started by `start` (which joins rank 0 to the group)."""

    def __init__(self, config: EngineConfig) -> None:
        check_not_in_worker_bootstrap()
        self.size = config.device.tensor_parallel_size
        self.backend = "nccl" if config.device.device == "cuda" else "gloo"
        self.error: WorkerDiedError | None = None
        self._stopping = False
        self._lock = threading.Lock()
        self._detected = threading.Event()  # a worker is gone ...
        self._died = threading.Event()  # ... and the others are stopped: `error` is set
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)  # ends the monitor at shutdown
        ctx = mp.get_context("spawn")
        port = free_port()
        self.procs: list[BaseProcess] = []
        self._errors: dict[int, Connection] = {}  # rank -> the read end of its error pipe
        for rank in range(1, self.size):
            read, write = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(config, rank, self.size, port, write),
                               daemon=True, name=f"kvpilot-tp{rank}")
            proc.start()
            write.close()  # the worker holds the only write end: EOF once it is gone
            self.procs.append(proc)
            self._errors[rank] = read
        self._monitor = threading.Thread(target=self._watch, name="kvpilot-tp-monitor", daemon=True)
        self._monitor.start()
        self.port, self.device_type = port, config.device.device

    @classmethod
    def start(cls, config: EngineConfig) -> tuple[Workers, TPInfo]:
        """Start ranks 1..N-1 and join the group as rank 0; raises `WorkerDiedError` as soon as a
        worker dies before the group is complete (the workers are stopped first)."""
        workers = cls(config)
        try:
            return workers, workers._join()
        except BaseException:
            workers.shutdown()
            raise

    def _join(self) -> TPInfo:
        """Rank 0's rendezvous, on a thread so that a worker's death ends the wait: the
        rendezvous itself would wait for the group's timeout."""
        joined: list[TPInfo] = []
        failed: list[BaseException] = []

        def join() -> None:
            try:
                joined.append(init_group(0, self.size, self.port, self.device_type))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                failed.append(e)

        thread = threading.Thread(target=join, name="kvpilot-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            if self._died.wait(timeout=0.05):
                assert self.error is not None
                raise self.error
        if failed:
            failure = self.confirm(failed[0])
            if failure is failed[0]:
                raise failure
            raise failure from failed[0]
        return joined[0]

    # ---- failure --------------------------------------------------------------------------

    def _watch(self) -> None:
        sentinels = {proc.sentinel: (rank, proc) for rank, proc in enumerate(self.procs, start=1)}
        ready = wait([*sentinels, self._wake_r])
        with self._lock:
            if self._stopping:
                return
            self._detected.set()
            rank, proc = next(sentinels[s] for s in ready if s in sentinels)  # type: ignore[index]
            proc.join()
            error = WorkerDiedError(self._describe(rank, proc))
            logger.error("%s", error)
            self._stop_others(proc)
            if self.backend == "nccl":
                _abort_group()
            self.error = error
            self._died.set()

    def _describe(self, rank: int, proc: BaseProcess) -> str:
        code = proc.exitcode
        if code == EXIT_UNGUARDED_MAIN:
            return f"tensor-parallel worker {rank} could not start: {GUARD_HINT}"
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        message = f"tensor-parallel worker {rank} (pid {proc.pid}) {how}"
        conn = self._errors[rank]
        try:
            if conn.poll():
                return f"{message}; its error:\n{conn.recv()}"
        except (EOFError, OSError):
            pass
        return message

    def confirm(self, error: BaseException) -> BaseException:
        """The error to raise for `error`, raised in rank 0 while workers run: `WorkerDiedError`
        when a worker has died, else `error` itself. Collectives fail with a `RuntimeError` once
        a peer is gone, and the monitor may see the exit a moment later: for those, wait for it
        briefly. Other errors (a bad config, say, which fails every rank alike) are rank 0's own."""
        if not isinstance(error, RuntimeError):
            return error
        if self._detected.wait(timeout=CONFIRM_DEATH_S):
            self._died.wait()  # bounded: the other workers are killed after STOP_TIMEOUT_S
        return self.error if self.error is not None else error

    def _stop_others(self, dead: BaseProcess | None) -> None:
        others = [p for p in self.procs if p is not dead and p.is_alive()]
        for proc in others:
            proc.terminate()
        for proc in others:
            proc.join(timeout=STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()

    # ---- shutdown -------------------------------------------------------------------------

    def shutdown(self, stop: Callable[[], None] | None = None) -> None:
        """End every worker: `stop()` (rank 0's broadcast of "stop") first when all are alive,
        then wait for them, killing any that do not exit; leave the group."""
        with self._lock:
            self._stopping = True
            self._wake_w.send(None)
        if self.error is None and stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001 - a worker gone meanwhile: it is reaped below
                logger.warning("telling the tensor-parallel workers to stop failed", exc_info=True)
        for proc in self.procs:
            proc.join(timeout=STOP_TIMEOUT_S)
        self._stop_others(None)
        for conn in self._errors.values():
            conn.close()
        self._monitor.join()
        destroy_group()


def _abort_group() -> None:
    """Make rank 0's pending NCCL collectives return instead of waiting for the group's timeout."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except Exception:  # noqa: BLE001 - best effort: the caller raises the worker's error anyway
            logger.warning("aborting the NCCL group failed", exc_info=True)


def check_not_in_worker_bootstrap() -> None:
    """Called before starting workers: in a spawned worker that is still importing the user's
    main module (an unguarded script), explain and exit with `EXIT_UNGUARDED_MAIN` instead of
    Python's own error, so rank 0 can name the fix."""
    if getattr(mp.current_process(), "_inheriting", False):
        sys.stderr.write(f"kvpilot: {GUARD_HINT}\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_UNGUARDED_MAIN)


def worker_main(config: EngineConfig, rank: int, size: int, port: int, errors: Connection) -> None:
    """Entry point of ranks 1..N-1: build this rank's runner, then follow rank 0's commands. Any
    failure goes back to rank 0 over `errors` before the process exits."""
    _exit_with_parent()
    try:
        tp = init_group(rank, size, port, config.device.device)
        runner = ModelRunner(config, tp)
        runner.follow()
    except BaseException:
        errors.send(traceback.format_exc())
        raise
    finally:
        errors.close()
        destroy_group()


def _exit_with_parent() -> None:
    """End this worker when rank 0's process is gone (a blocked NCCL call would wait forever)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="kvpilot-parent-watch", daemon=True).start()
