"""The one exception a bad blob raises."""


class FormatError(ValueError):
    """A blob (or a stream inside it) is malformed, truncated, forged or corrupted.

    It is a ValueError so callers that already guard decoding with ``except ValueError`` keep working.
    """
