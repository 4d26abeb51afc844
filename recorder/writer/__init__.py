"""The writer thread: its inbox, the policy of which full tensors a step keeps, and
the budget they are kept within.

Private: every module here starts with ``_``."""
