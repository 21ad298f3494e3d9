"""Small helpers shared across layers (no verl, no torch): one-time warnings, parquet files."""

from __future__ import annotations

import logging
import os
import warnings

_warned: set[str] = set()


def warn_once(message: str, category: type[Warning] = UserWarning, logger: logging.Logger | None = None) -> None:
    """``warnings.warn`` (and ``logger.warning``) the first time ``message`` comes up in this process."""
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, category, stacklevel=3)
    if logger is not None:
        logger.warning(message)


def registrar(table: dict):
    """A class decorator that puts an instance of the class in ``table`` under the class's ``name``."""

    def register(cls):
        table[cls.name] = cls()
        return cls

    return register


def write_parquet(rows: list[dict], path: str, schema=None) -> None:
    """``rows`` as a parquet file (a pyarrow ``schema`` fixes the column types), creating its folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
