"""The runner: step preparation, dual-batch-overlap executor, graphs, sampling."""
