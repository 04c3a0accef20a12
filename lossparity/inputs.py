"""Reading a user's batch from ``.npz`` or ``.safetensors`` (NumPy only: no framework needed).

Expected arrays: ``logits`` ``[..., V]`` (alone enough for ``entropy``); ``labels`` ``[...]``
(cross-entropy) and/or ``teacher_logits`` ``[..., V]`` (the teacher kinds); optional
``loss_mask`` ``[...]`` and ``segment_ids`` ``[...]`` (packed documents; lossspec.sequences).
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import numpy as np

KNOWN_KEYS = ("logits", "labels", "teacher_logits", "loss_mask", "segment_ids")


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


def _safetensors_header(path: Path, data: bytes) -> tuple[dict, memoryview]:
    """The JSON header (a dict) and the data after it; one-line errors for anything else."""
    if len(data) < 8:
        raise InputError(f"{path}: not a safetensors file (too short)")
    (header_size,) = struct.unpack("<Q", data[:8])
    if header_size > len(data) - 8:
        raise InputError(f"{path}: not a safetensors file (bad header size)")
    try:
        header = json.loads(data[8 : 8 + header_size])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{path}: not a safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: not a safetensors file (the header is not a JSON object)")
    return header, memoryview(data)[8 + header_size :]


def _safetensors_bytes(path: Path, name: str, info: object, body: memoryview) -> tuple[memoryview, str, list[int]]:
    """``(raw bytes, dtype code, shape)`` of one header entry, checked against the data it names:
    ``end - begin == prod(shape) * itemsize`` and ``0 <= begin <= end <= len(body)``."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise InputError(f"{where}: header entry needs 'dtype', 'shape' and 'data_offsets'")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if code != "BF16" and code not in _SAFETENSORS_DTYPES:
        raise InputError(f"{where} has unsupported dtype {code}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise InputError(f"{where}: shape must be a list of sizes; got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise InputError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end; got {offsets!r}")
    begin, end = offsets
    if end > len(body):
        raise InputError(f"{where}: data_offsets {offsets} run past the end of the data ({len(body)} bytes)")
    itemsize = 2 if code == "BF16" else np.dtype(_SAFETENSORS_DTYPES[code]).itemsize
    needed = int(np.prod(shape, dtype=np.int64)) * itemsize
    if end - begin != needed:
        raise InputError(f"{where}: shape {shape} of {code} needs {needed} bytes; data_offsets hold {end - begin}")
    return body[begin:end], code, shape


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(arrays, dtype names)``; bf16 tensors come back as exactly-equal float32 arrays."""
    header, body = _safetensors_header(path, path.read_bytes())
    arrays, dtypes = {}, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        raw, code, shape = _safetensors_bytes(path, name, info, body)
        if code == "BF16":
            arrays[name] = bfloat16_bits_to_float32(np.frombuffer(raw, dtype="<u2")).reshape(shape)
            dtypes[name] = "bfloat16"
        else:  # safetensors is little-endian
            arrays[name] = np.frombuffer(raw, dtype=np.dtype(_SAFETENSORS_DTYPES[code]).newbyteorder("<")).reshape(shape).copy()
            dtypes[name] = arrays[name].dtype.name
    return arrays, dtypes


def _check_npz_magic(path: Path) -> None:
    """An .npz is a zip archive (``np.savez``): say what the file is when it is not one, instead of
    letting ``np.load`` guess (it takes non-zip bytes for pickled data, and a .npy for an array)."""
    with path.open("rb") as handle:
        head = handle.read(6)
    if not head:
        raise InputError(f"{path}: empty file")
    if head == b"\x93NUMPY":
        raise InputError(f"{path}: a .npy file (one array), not an .npz of named arrays; "
                         "write it with np.savez(path, logits=..., labels=...)")
    if not head.startswith(b"PK"):
        raise InputError(f"{path}: not an .npz file (an .npz is a zip archive written by np.savez; "
                         f"this file starts with {head!r})")


def read_npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(arrays, dtype names)`` of an ``np.savez`` archive; bf16 (2-byte voids) as float32."""
    _check_npz_magic(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as error:
        raise InputError(f"{path}: unreadable .npz archive ({type(error).__name__}: {error})") from None
    dtypes = {}
    for name, array in arrays.items():
        dtypes[name] = array.dtype.name
        # NumPy saves ml_dtypes' bfloat16 (what np.asarray gives for a JAX bf16 array) as a
        # 2-byte void type: read those bytes back as bfloat16.
        if array.dtype.kind == "V" and array.dtype.itemsize == 2:
            arrays[name] = bfloat16_bits_to_float32(array.view(np.uint16))
            dtypes[name] = "bfloat16"
    return arrays, dtypes


def found_keys(arrays: dict[str, np.ndarray]) -> str:
    """The file's array names, for messages about a missing one."""
    return ", ".join(sorted(arrays)) or "nothing"


def read_inputs(path_text: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Load ``path_text`` (``.npz`` or ``.safetensors``) and check it holds the arrays we need."""
    path = Path(path_text)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if path.suffix not in (".npz", ".safetensors"):
        raise InputError(f"{path}: expected a .npz or .safetensors file")
    try:
        arrays, dtypes = read_npz(path) if path.suffix == ".npz" else read_safetensors(path)
    except OSError as error:  # unreadable (permissions, I/O): the file, not our code
        raise InputError(f"{path}: cannot read ({error.strerror or error})") from None
    found = f"(found: {found_keys(arrays)})"
    if "logits" not in arrays:
        raise InputError(f"{path}: no 'logits' array {found}")
    unknown = sorted(set(arrays) - set(KNOWN_KEYS))
    if unknown:
        raise InputError(f"{path}: unexpected array(s) {', '.join(unknown)}; expected {', '.join(KNOWN_KEYS)} {found}")
    if dtypes["logits"] not in ("float32", "float16", "bfloat16", "float64"):
        raise InputError(f"{path}: 'logits' must be floating point; got {dtypes['logits']}")
    return arrays, dtypes
