"""posenc's version, in one place: the package, the CLI, checkpoints and results read it from here
(and ``pyproject.toml`` takes it from here at build time)."""

__version__ = "0.1.0"
