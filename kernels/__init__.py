"""Attention kernels: one folder per op, each with a pure-torch reference and a GPU implementation."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (b > 0), exact for any size."""
    return -(-a // b)
