"""The kernel tests' interpreter worker, one for the whole pytest run (see interpreted.py)."""

from interpreted import interpreter  # noqa: F401
