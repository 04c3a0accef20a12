"""Reading a user's batch from ``.npz`` or ``.safetensors`` (NumPy only: no framework needed).

Expected arrays: ``logits`` ``[..., V]``; ``labels`` ``[...]`` (cross-entropy) and/or
``teacher_logits`` ``[..., V]`` (distillation); optional ``loss_mask`` ``[...]``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

KNOWN_KEYS = ("logits", "labels", "teacher_logits", "loss_mask")


class InputError(ValueError):
    """A user's file or argument is unusable; the message is one line naming the problem."""


_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 is the upper half of an fp32: widen exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(arrays, dtype names)``; bf16 tensors come back as exactly-equal float32 arrays."""
    data = path.read_bytes()
    if len(data) < 8:
        raise InputError(f"{path}: not a safetensors file (too short)")
    (header_size,) = struct.unpack("<Q", data[:8])
    if header_size > len(data) - 8:
        raise InputError(f"{path}: not a safetensors file (bad header size)")
    try:
        header = json.loads(data[8 : 8 + header_size])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{path}: not a safetensors file ({error})") from None
    body = memoryview(data)[8 + header_size :]
    arrays, dtypes = {}, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = np.frombuffer(body[begin:end], dtype=np.uint16 if info["dtype"] == "BF16" else _SAFETENSORS_DTYPES.get(info["dtype"], np.uint8))
        if info["dtype"] == "BF16":
            arrays[name] = bfloat16_bits_to_float32(raw).reshape(info["shape"])
            dtypes[name] = "bfloat16"
        elif info["dtype"] in _SAFETENSORS_DTYPES:
            arrays[name] = raw.reshape(info["shape"]).copy()
            dtypes[name] = arrays[name].dtype.name
        else:
            raise InputError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    return arrays, dtypes


def read_npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as error:
        raise InputError(f"{path}: not a readable .npz file ({error})") from None
    dtypes = {}
    for name, array in arrays.items():
        dtypes[name] = array.dtype.name
        # NumPy saves ml_dtypes' bfloat16 (what np.asarray gives for a JAX bf16 array) as a
        # 2-byte void type: read those bytes back as bfloat16.
        if array.dtype.kind == "V" and array.dtype.itemsize == 2:
            arrays[name] = bfloat16_bits_to_float32(array.view(np.uint16))
            dtypes[name] = "bfloat16"
    return arrays, dtypes


def read_inputs(path_text: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Load ``path_text`` (``.npz`` or ``.safetensors``) and check it holds the arrays we need."""
    path = Path(path_text)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if path.suffix == ".npz":
        arrays, dtypes = read_npz(path)
    elif path.suffix == ".safetensors":
        arrays, dtypes = read_safetensors(path)
    else:
        raise InputError(f"{path}: expected a .npz or .safetensors file")
    if "logits" not in arrays:
        raise InputError(f"{path}: no 'logits' array (found: {', '.join(sorted(arrays)) or 'nothing'})")
    if "labels" not in arrays and "teacher_logits" not in arrays:
        raise InputError(f"{path}: needs 'labels' (cross-entropy) or 'teacher_logits' (distillation) beside 'logits'")
    unknown = sorted(set(arrays) - set(KNOWN_KEYS))
    if unknown:
        raise InputError(f"{path}: unexpected array(s) {', '.join(unknown)}; expected {', '.join(KNOWN_KEYS)}")
    if dtypes["logits"] not in ("float32", "float16", "bfloat16", "float64"):
        raise InputError(f"{path}: 'logits' must be floating point; got {dtypes['logits']}")
    return arrays, dtypes
