"""What a caught tensor becomes (summary vector, NaN/Inf counts, snapshot) and the
statistics engines that make it on each device type.

Private: every module here starts with ``_``."""
