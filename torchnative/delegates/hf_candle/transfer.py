"""Moving tensors between torch and candle: small ones as Python lists, big ones through a
safetensors file in a memfd (one per thread, reused), which candle opens by its /proc path."""
from __future__ import annotations

import array
import json
import math
import os
import struct
import threading

import torch

try:
    import candle  # HF candle's Python bindings (candle-nn)
except ImportError:  # available() says so, with the install hint
    candle = None

# The bindings convert element by element through Python objects: per 4 MiB, candle.Tensor(ndarray)
# takes 73-79 ms, candle.Tensor(list) 52-63 ms, Tensor.to_torch() 190-300 ms. candle reads and
# writes safetensors files, so a memfd (an in-memory file candle opens by its /proc path) carries
# the big tensors: 4 MiB in 4-10 ms, out 3-5 ms (a safetensors.torch file in /dev/shm: 6-7 ms in,
# 2.5-4.6 ms out), and at least ~55 µs a call. Python lists win below ~1000 elements: 768 floats take
# 31-52 µs in and 40-72 µs out (memfd 52-64 and 52-77 µs). Measured on this 2-core VM, noisy.
_LIST_IN, _LIST_OUT = 1024, 512  # elements: at most this many move as a Python list

DTYPES = {torch.float32: "f32", torch.int64: "i64", torch.bool: "u8"}  # bool is candle's u8 mask
_SAFETENSORS = {torch.float32: "F32", torch.int64: "I64", torch.bool: "U8"}
_ARRAY = {torch.float32: "f", torch.int64: "q", torch.bool: "B"}


class _Memfile:
    """An in-memory file that candle opens by path; one per thread, reused call after call."""

    def __init__(self):
        self.fd = os.memfd_create("torchnative-candle", os.MFD_CLOEXEC)
        self.path = f"/proc/self/fd/{self.fd}"

    def __del__(self):
        os.close(self.fd)

    def write(self, buffers: list) -> None:
        offset = 0
        for b in buffers:
            b = memoryview(b)
            while b:  # a write moves at most ~2 GiB
                n = os.pwrite(self.fd, b, offset)
                offset, b = offset + n, b[n:]
        os.ftruncate(self.fd, offset)  # candle reads the whole file

    def read_into(self, t: torch.Tensor, offset: int) -> None:
        b = memoryview(t.view(-1).view(torch.uint8).numpy())  # t is fresh, hence contiguous
        while b:
            n = os.preadv(self.fd, [b], offset)
            offset, b = offset + n, b[n:]

    def read(self) -> bytes:
        return os.pread(self.fd, os.fstat(self.fd).st_size, 0)


_local = threading.local()


def memfile() -> _Memfile:
    if not hasattr(_local, "file"):
        _local.file = _Memfile()
    return _local.file


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.reshape(-1)
    if flat.stride(0) != 1:  # a broadcast scalar (stride 0) counts as contiguous
        flat = torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)
    return memoryview(flat.view(torch.uint8).numpy())


def safetensors(named: list[tuple[str, torch.Tensor]]) -> list:
    """The buffers of a safetensors file holding `named` (contiguous tensors)."""
    header, offset = {}, 0
    for name, t in named:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)  # keeps the data 8-byte aligned, so candle can cast it in place
    return [struct.pack("<Q", len(h)) + h] + [_bytes(t) for _, t in named]


def to_candle(tensors: list[torch.Tensor]) -> list:
    out: list = []
    big = []
    for i, t in enumerate(tensors):
        if t.numel() <= _LIST_IN:
            c = candle.Tensor(t.reshape(-1).tolist())  # ints and bools arrive as u32
            out.append(c.to_dtype(DTYPES[t.dtype]).reshape(tuple(t.shape)))
        else:
            out.append(None)
            big.append((str(i), t.detach().contiguous()))
    if big:
        f = memfile()
        f.write(safetensors(big))
        loaded = candle.utils.load_safetensors(f.path)
        for name, _ in big:
            out[int(name)] = loaded[name]
    return out


def to_torch(values: list, kinds: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    out: list = []
    big = {}
    for i, (c, (shape, dtype)) in enumerate(zip(values, kinds)):
        if math.prod(shape) <= _LIST_OUT:
            flat = array.array(_ARRAY[dtype], c.flatten_all().values())
            out.append(torch.frombuffer(flat, dtype=dtype).reshape(shape))
        else:
            out.append(torch.empty(shape, dtype=dtype))
            big[str(i)] = c
    if big:
        f = memfile()
        candle.utils.save_safetensors(f.path, big)
        n = struct.unpack("<Q", os.pread(f.fd, 8, 0))[0]
        header = json.loads(os.pread(f.fd, n, 8))
        for name in big:
            f.read_into(out[int(name)], 8 + n + header[name]["data_offsets"][0])
    return out
