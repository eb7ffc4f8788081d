"""Step inputs: token store, step batch, persistent step state, static buffers (slicing: microbatch/)."""
