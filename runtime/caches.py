"""The folders the engine compiles into and converts into: kvpilot's own cache (`$KVPILOT_CACHE`:
the CPU's C kernels, converted GGUF models) and Triton's (`$TRITON_CACHE_DIR`: compiled GPU
kernels). With both on a volume that outlives the pod (the chart's `engineCache.hostPath`), a
second pod on the node loads what the first compiled instead of compiling it again.

A folder the process cannot write (a node folder owned by root, say) would make the first
compile fail mid-start; `kvpilot serve` checks both before it starts anything and, for one it
cannot write, warns and uses a private temporary folder instead (the start is slower, not broken).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from kvpilot.runtime.model_source import cache_root

logger = logging.getLogger(__name__)


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            return True
    except OSError:
        return False


def ensure_writable_caches() -> None:
    """Point `KVPILOT_CACHE` and `TRITON_CACHE_DIR` at private folders where theirs cannot be
    written (set in this process's environment, which the engine core inherits)."""
    triton = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    for variable, folder in (("KVPILOT_CACHE", cache_root()), ("TRITON_CACHE_DIR", triton)):
        if _writable(folder):
            continue
        private = tempfile.mkdtemp(prefix=f"kvpilot-{variable.lower()}-")
        logger.warning("%s: cannot write %s (make it writable by uid %d to share compiled kernels between "
                       "pods); using %s for this process", variable, folder, os.getuid(), private)
        os.environ[variable] = private
