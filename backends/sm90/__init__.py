"""SM90 (Hopper) backends."""
