"""Whether torch would find a CUDA device, answered without importing torch.

`kvpilot serve` resolves `--device auto` before it starts the engine core; importing torch for
`torch.cuda.is_available()` there takes seconds that the core's own start then waits behind. The
same answer comes from the installed torch's build (its `version.py` names a CUDA version or None)
and the driver's device count (libcuda's `cuDeviceGetCount`, which honours CUDA_VISIBLE_DEVICES),
in milliseconds. Once torch is imported, its own answer is used.
"""

from __future__ import annotations

import ast
import ctypes
import sys
from importlib.util import find_spec
from pathlib import Path


def _torch_built_with_cuda() -> bool:
    spec = find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    try:
        tree = ast.parse((Path(spec.origin).parent / "version.py").read_text())
    except (OSError, SyntaxError):
        return False
    for node in tree.body:
        target: ast.expr
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "cuda":
            return isinstance(value, ast.Constant) and value.value is not None
    return False


def _driver_device_count() -> int:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def cuda_available() -> bool:
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    return _torch_built_with_cuda() and _driver_device_count() > 0
