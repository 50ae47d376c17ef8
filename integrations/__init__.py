"""Adapters that plug moe_ep into other libraries (each imports only :mod:`moe_ep.api` and its
library, which stays an optional dependency: importing moe_ep never imports them)."""
