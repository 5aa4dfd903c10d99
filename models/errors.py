"""The exceptions every loader and validator in ``models`` raises."""


class ModelError(ValueError):
    """A model config, checkpoint or tensor is not what it should be.

    Messages name the offending config key or tensor, and the expected versus
    found value or shape.
    """


class ModelNotFoundError(FileNotFoundError):
    """The model file or directory asked for does not exist."""
