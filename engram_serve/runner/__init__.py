"""The runner: step preparation, microbatch execution (microbatch/), graphs, sampling."""
