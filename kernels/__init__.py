"""Attention kernels: one folder per op, each with a pure-torch reference and a GPU implementation."""
