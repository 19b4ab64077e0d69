"""The launchers' plain-Python integer helpers give what Triton's would (they replace
triton.cdiv and triton.next_power_of_2 in host code, which cost microseconds a call)."""

import triton

from kvpilot.kernels.host import cdiv, next_power_of_2


def test_cdiv_matches_triton() -> None:
    for a in range(0, 3000):
        for b in (1, 2, 3, 16, 64, 512):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_power_of_2_matches_triton() -> None:
    for n in range(1, 70000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
