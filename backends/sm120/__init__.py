"""SM120 (Blackwell workstation: RTX PRO 6000 class) backends."""
