"""Benchmarks: ``python -m moe_ep.bench [layer|gemm]`` (see ``--help``)."""
