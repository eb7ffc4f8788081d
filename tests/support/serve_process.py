"""`engram-serve serve` as a real process on a free loopback port, for the tests that need one."""
from engram_serve.server.run import start_serve_process as start_serve  # noqa: F401
