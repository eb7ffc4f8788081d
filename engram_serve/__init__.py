"""engram-serve: a serving runtime for Engram language models.

A step's result never depends on how the step was cut (microbatches, prefill
chunks, padded graph replays): hash ids and staged rows match bit for bit.
"""
__version__ = "0.1.0"
