"""The optional C extension (`_native.c`, built by `pip install` where a C compiler is present), or None.

Every caller keeps a numpy path that gives the same results; tests compare the two.
"""
from __future__ import annotations

try:
    from backends.compression import _native as native
except ImportError:     # built without a C compiler
    native = None

__all__ = ["native"]
