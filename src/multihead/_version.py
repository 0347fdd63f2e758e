"""The package's version, written once: ``pyproject.toml`` reads it at build time
(``[tool.setuptools.dynamic]``), :data:`multihead.__version__` and ``multihead --version`` report it."""

__version__ = "0.1.0"
