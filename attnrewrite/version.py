"""The package version, in a module of its own so that any module can read it at import time
(the package ``__init__`` imports the API, and so nearly every module)."""

__version__ = "0.1.0"
