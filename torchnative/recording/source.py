"""Where in the user's code an op was issued: the innermost frame outside torch and torchnative."""
from __future__ import annotations

import os
import sys
from typing import Any

import torch

# frames inside these directories are not the user's code
_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


def _user_code(f: Any) -> Any:
    while f is not None and (f.f_code.co_filename.startswith(_INTERNAL) or f.f_code.co_filename.startswith("<")):
        f = f.f_back
    return f


def user_frame(skip: int = 2) -> tuple[str, int]:
    """(filename, line) of the user code that issued the op, `skip` frames above the caller's."""
    f = _user_code(sys._getframe(skip))
    return (f.f_code.co_filename, f.f_lineno) if f is not None else ("<unknown>", 0)


def user_instruction(skip: int = 2) -> tuple[Any, int]:
    """(code, bytecode offset) of that user code: one call in one line, where a line may make
    several (`0.5 * x * (1.0 + torch.tanh(0.79788 * x))`)."""
    f = _user_code(sys._getframe(skip))
    return (f.f_code, f.f_lasti) if f is not None else (None, 0)
