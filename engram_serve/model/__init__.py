"""The Engram decoder: layers, paged attention, MoE, index sharing, loading."""
