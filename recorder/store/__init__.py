"""A rank's part of a run on disk: ``RankLog`` (its durable state and the fenced
commit), the ranks' joint decision, the tables and the threads that write chunks.

Private: every module here starts with ``_``."""
