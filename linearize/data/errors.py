"""The one error type of the data pipeline."""


class DataError(ValueError):
    """The training data cannot be used: unknown format, no usable column, or no tokens."""
