"""The training loop's user-facing error (the CLI prints its message alone, no traceback)."""


class TrainingError(RuntimeError):
    """A run cannot continue; the message says why and what to change."""
