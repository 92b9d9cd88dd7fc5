"""The input's errors, shared by the readers of each format (batchgen.data.reader, batchgen.data.formats)."""


class InputError(ValueError):
    """The input as a whole cannot be used; nothing was generated."""
