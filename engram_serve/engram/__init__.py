"""Engram: layout (primes, offsets, multipliers), compressed token map, hashing, tables, layer."""
