"""Library errors. Every one is a `ValueError` whose message names the bad key, value, shape or position."""


class FlashNextError(ValueError):
    """Base class of flashnext's errors."""


class ConfigError(FlashNextError):
    """A model or run config field has an invalid value; the message names the field and value (and the file,
    when read from one)."""


class CheckpointError(FlashNextError):
    """A checkpoint is missing keys, has unexpected/mis-shaped/wrong-dtype keys, or is truncated.

    Attributes:
        problems: one line per offending key.
    """

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = list(problems or [])
        if self.problems:
            message = message + "\n  " + "\n  ".join(self.problems)
        super().__init__(message)


class InputError(FlashNextError):
    """Model inputs (ids, cu_seqlens, positions, masks, labels, router replay, images) are malformed; the message
    names the argument and its shape or dtype."""


class FieldsError(ValueError):
    """A pydantic validator's verdict on a combination of fields; `fields` are their dotted names relative to the
    model validated, so the run config's error (a `ConfigError`) can say where each value came from."""

    def __init__(self, message: str, fields: tuple[str, ...]):
        super().__init__(message)
        self.fields = fields
