"""An artifact's weights: which folded constants become GGUF k-quant blocks (those from a param
used only as a matmul's weight, whose input dimension fills whole blocks), and the payload that
holds them all: a safetensors file of the float32 constants followed by a GGUF file of the blocks."""
from __future__ import annotations

import torch
import torch.fx as fx

try:
    import candle  # HF candle's Python bindings (candle-nn)
except ImportError:  # available() says so, with the install hint
    candle = None

from torchnative.delegates.hf_candle.lowerings import MAT2
from torchnative.delegates.hf_candle.transfer import memfile, safetensors

_BLOCK = {"q8_0": 32, "q4k": 256}  # GGUF block sizes along a weight's input dimension
GGUF_NAMES = {"Q8_0": "q8_0", "Q4K": "q4k"}  # candle's names of the types, as quantize() takes them


def weight(n: fx.Node, value: torch.Tensor, quant: str | None) -> torch.Tensor | None:
    """The (out, in) matrix to quantize for constant n, when every use is as a matmul weight."""
    if quant is None or not all(u.target in MAT2 and u.args[MAT2[u.target]] is n for u in n.users):
        return None
    if value.dim() == 3 and value.stride(0) == 0:  # bmm against an expanded 2-D weight
        value = value[0]
    if value.dim() != 2 or value.shape[0] % _BLOCK[quant]:
        return None
    return value.t().contiguous()


def pack(fp32: list[tuple[str, torch.Tensor]], quantize: dict[str, torch.Tensor], blocks: dict,
         quant: str | None) -> tuple[bytes, bytes]:
    """The payload's two files: the safetensors file of `fp32`, and the GGUF file of `blocks` (k-quants
    by name), to which `quantize`'s matrices are added, quantized to `quant` (b"" when there are none)."""
    gguf = b""
    if quantize or blocks:
        f = memfile()
        if quantize:
            f.write(safetensors(list(quantize.items())))
            loaded = candle.utils.load_safetensors(f.path)
            blocks.update({name: loaded[name].quantize(quant) for name in quantize})
        candle.utils.save_gguf(f.path, blocks, {})
        gguf = f.read()
    return b"".join(safetensors(fp32)), gguf


def unpack(payload: memoryview, safetensors_bytes: int) -> dict:
    """The candle constants, by name, of a payload whose first `safetensors_bytes` are its safetensors file."""
    f = memfile()
    f.write([payload[:safetensors_bytes]])
    constants = candle.utils.load_safetensors(f.path)
    if len(payload) > safetensors_bytes:
        f.write([payload[safetensors_bytes:]])
        constants.update(candle.utils.load_gguf(f.path)[0])
    return constants
