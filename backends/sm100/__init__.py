"""SM100 (Blackwell datacenter: B200/GB200) backends."""
