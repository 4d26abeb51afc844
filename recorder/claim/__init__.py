"""One job owns a run: what is at a store location, the claim, its local and
object-store locks, and its heartbeat.

Private: every module here starts with ``_``."""
