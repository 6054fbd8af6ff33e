"""Host-side integer helpers of the launchers, in plain Python.

`triton.cdiv` and `triton.next_power_of_2` are `constexpr_function`s in recent Tritons: a host call
unwraps its arguments through Triton's constexpr machinery (about 1.5 us, against 0.1 us here), and
an eager launch computes a dozen of them. Same results for ints (`next_power_of_2(n)` is 0 for n <= 0,
as Triton's bit trick gives).
"""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    return (x + (y - 1)) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
