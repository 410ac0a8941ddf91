"""Operators: one folder per op (kda/, dsa/, moe/), each with reference.py, kernels and a backend= switch."""
