"""The open step: its captures and scalars, packed at its end into the record the
writer thread resolves (the thread contract).

Private: every module here starts with ``_``."""
