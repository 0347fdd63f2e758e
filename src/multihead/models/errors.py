"""The error a model loader raises for a bad model folder: the CLI prints it as one line."""

from __future__ import annotations

__all__ = ["ModelFolderError"]


class ModelFolderError(ValueError):
    """A model folder that is missing, unreadable, or whose config does not match its tensors.

    The message says which file is wrong, what was found, what was expected and what to do.
    """
