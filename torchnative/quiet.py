"""Imports of dependencies that log notes meant for their own developers: torchao (which
executorch and transformers import) logs each CUDA kernel library a CPU build cannot load, and its
enums registered as pytree constants, which torch deprecates. A user of torchnative sees only
torchnative's own output; every other record of those loggers is kept."""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

_IMPORT_NOTES = {"torchao": "Failed to load ",
                 "torch.utils._pytree": "%s is an Enum subclass and is now natively supported by torch.compile"}


def _drop_import_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_IMPORT_NOTES[record.name])


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """Import inside: `_IMPORT_NOTES` are dropped while the block runs."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOTES]
    for logger in loggers:
        logger.addFilter(_drop_import_note)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_drop_import_note)
