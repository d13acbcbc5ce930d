"""Native CPU kernels: AdamW under every strategy with a ``native_code``, hand-written C
called through ctypes.

On CPU the native path runs these where they cover a group (:func:`covers`); ``build``
compiles and loads the library, ``cache`` decides where it is cached and whether a cached
file may be loaded (``docs/security.md``), ``calls`` makes one call (the table of tensors,
threads, the non-finite check), ``plan`` reuses a group's call from step to step, and
``path`` is the dispatch's entry. ``COLLAGE_NATIVE=0`` turns them off.
"""

from .build import ABI, SOURCES, UNITS, available, backend, info, load, loaded
from .calls import (
    COLUMN_GRAD,
    COLUMN_KEY0,
    COLUMN_KEY1,
    FIELDS_COUNT,
    TABLE_COLUMNS,
    adamw,
    any_nonfinite,
    covers,
    row_layout,
    row_tensors,
)

__all__ = [
    "ABI",
    "COLUMN_GRAD",
    "COLUMN_KEY0",
    "COLUMN_KEY1",
    "FIELDS_COUNT",
    "SOURCES",
    "TABLE_COLUMNS",
    "UNITS",
    "adamw",
    "any_nonfinite",
    "available",
    "backend",
    "covers",
    "info",
    "load",
    "loaded",
    "row_layout",
    "row_tensors",
]
