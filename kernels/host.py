"""Host-side helpers for the launchers.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions whose host calls go through
Triton's dispatch, which costs more than the arithmetic; eager launches pay that per op, layer and
step, so the
launchers use the plain-Python twins here. `INTERPRETING` is read once, at import: Triton
decides when `@triton.jit` decorates a kernel whether TRITON_INTERPRET runs it, and the
kernels here are decorated on import, so no launch needs to read the environment again.
"""

import os

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, as triton.next_power_of_2 for n >= 1."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
