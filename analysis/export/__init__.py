"""A run out to other tools: HDF5, TensorBoard event files, a torch data set.

Private: every module here starts with ``_``."""
