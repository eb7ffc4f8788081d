"""Split-invariant step inputs: token store, step batch, microbatch planning and slicing, static buffers."""
