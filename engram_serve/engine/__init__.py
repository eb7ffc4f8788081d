"""Request bookkeeping (torch-free): sequences, KV block manager, scheduler; and the engines on top."""
