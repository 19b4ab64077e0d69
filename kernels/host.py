"""Integer helpers for the launchers' host code. `triton.cdiv` and `triton.next_power_of_2` are
constexpr functions whose host calls cost about 4-5 µs each through Triton's dispatch; eager
launches pay that per op, layer and step, so the launchers use these plain-Python twins."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, as triton.next_power_of_2 for n >= 1."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
