"""The hooks: where a module's call is caught (registered and removed in one place),
named, matched to its gradient and to its recomputation, under torch.compile too.

Private: every module here starts with ``_``."""
