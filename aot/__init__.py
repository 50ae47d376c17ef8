"""``python -m moe_ep.aot``: prebuild a layer's kernels into the disk compile cache (no GPU needed),
list what a cache holds, verify that it loads. See ``python -m moe_ep.aot --help``."""
