"""Reading a user's batch from ``.npz`` or ``.safetensors`` (NumPy only: no framework needed).

Expected arrays: ``logits`` ``[..., V]`` (alone enough for ``entropy``); ``labels`` ``[...]``
(cross-entropy) and/or ``teacher_logits`` ``[..., V]`` (the teacher kinds); optional
``loss_mask`` ``[...]`` and ``segment_ids`` ``[...]`` (packed documents; lossspec.sequences).
"""

from __future__ import annotations

import json
import math
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Iterable

import numpy as np

KNOWN_KEYS = ("logits", "labels", "teacher_logits", "loss_mask", "segment_ids")

# Limits on a hostile or damaged file, all checked before the data is read or inflated (the
# sizes an archive or header declares are checked against them, and against each other, first):
# the arrays' bytes in all (a .safetensors file's size; an .npz's members, uncompressed) ...
MAX_INPUT_BYTES = 8 * 2**30
# ... a safetensors JSON header (the safetensors library's own limit) ...
MAX_SAFETENSORS_HEADER_BYTES = 100 * 2**20
# ... and how far an .npz member may inflate: np.savez stores its members as they are and
# np.savez_compressed shrinks logits by a few times at most, while a zip bomb of zeros inflates
# about 1000 times; up to RATIO_FREE_BYTES a member may inflate without limit (small masks of ones).
MAX_COMPRESSION_RATIO = 100
RATIO_FREE_BYTES = 16 * 2**20


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
    if header_size > len(data) - 8 or header_size > MAX_SAFETENSORS_HEADER_BYTES:
        raise InputError(f"{path}: not a safetensors file (bad header size)")
    try:
        header = json.loads(data[8 : 8 + header_size])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{path}: not a safetensors file ({error})") from None
    except RecursionError:  # a header of lists in lists, deeper than Python's recursion limit
        raise InputError(f"{path}: not a safetensors file (the header is nested too deeply)") from None
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
    if not isinstance(code, str) or (code != "BF16" and code not in _SAFETENSORS_DTYPES):
        raise InputError(f"{where} has unsupported dtype {code!r}")
    # `type(...) is int`: JSON's true and false are Python ints too, and 1e30 a float.
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise InputError(f"{where}: shape must be a list of sizes; got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise InputError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end; got {offsets!r}")
    begin, end = offsets
    if end > len(body):
        raise InputError(f"{where}: data_offsets {offsets} run past the end of the data ({len(body)} bytes)")
    itemsize = 2 if code == "BF16" else np.dtype(_SAFETENSORS_DTYPES[code]).itemsize
    # Python's exact integers: a shape like [2**32, 2**32] must not wrap around to 0 bytes.
    needed = math.prod(shape) * itemsize
    if end - begin != needed:
        raise InputError(f"{where}: shape {shape} of {code} needs {needed} bytes; data_offsets hold {end - begin}")
    return body[begin:end], code, shape


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(arrays, dtype names)``; bf16 tensors come back as exactly-equal float32 arrays."""
    size = path.stat().st_size
    if size > MAX_INPUT_BYTES:
        raise InputError(f"{path}: {size} bytes; lossparity reads input files of at most {MAX_INPUT_BYTES} bytes")
    header, body = _safetensors_header(path, path.read_bytes())
    check_keys(path, [name for name in header if name != "__metadata__"])
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


def _npz_members(path: Path, archive: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    """The archive's members by array name, from its central directory alone (nothing inflated
    yet): each a ``NAME.npy``, named once, and their declared sizes within the limits above."""
    members: dict[str, zipfile.ZipInfo] = {}
    for info in archive.infolist():
        if not info.filename.endswith(".npy") or info.is_dir():
            raise InputError(f"{path}: member {info.filename!r} is not a .npy array (np.savez writes NAME.npy members)")
        name = info.filename[: -len(".npy")]
        if name in members:
            raise InputError(f"{path}: the array {name!r} is stored twice")
        members[name] = info
    check_keys(path, members)
    total = sum(info.file_size for info in members.values())
    if total > MAX_INPUT_BYTES:
        raise InputError(f"{path}: the arrays declare {total} bytes uncompressed; lossparity reads input files "
                         f"of at most {MAX_INPUT_BYTES} bytes")
    for name, info in members.items():
        if info.file_size > RATIO_FREE_BYTES + MAX_COMPRESSION_RATIO * info.compress_size:
            raise InputError(f"{path}: the array {name!r} would inflate from {info.compress_size} to {info.file_size} "
                             f"bytes (more than {MAX_COMPRESSION_RATIO} times): refused as a zip bomb")
    return members


def _read_npy_member(path: Path, archive: zipfile.ZipFile, name: str, info: zipfile.ZipInfo) -> np.ndarray:
    """One member's array: its .npy header first (shape and dtype), checked to need exactly the
    bytes the archive declares for it, then exactly those bytes, never more."""
    with archive.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(member)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(member)
        else:  # (3, 0): utf8 field names in a structured dtype, not an array of numbers
            raise InputError(f"{path}: the array {name!r} has .npy format {version}; expected 1.0 or 2.0")
        if dtype.hasobject:
            raise InputError(f"{path}: the array {name!r} holds Python objects (pickled); expected numbers")
        header_bytes = member.tell()
        needed = math.prod(shape) * dtype.itemsize  # exact: no wrap-around
        if header_bytes + needed != info.file_size:
            raise InputError(f"{path}: the array {name!r} declares shape {list(shape)} of {dtype} ({needed} bytes); "
                             f"the archive holds {info.file_size - header_bytes}")
        data = bytearray(needed)  # writable, as np.load's arrays are; filled in place, no second copy
        view, filled = memoryview(data), 0
        while filled < needed:
            count = member.readinto(view[filled:])
            if not count:
                raise InputError(f"{path}: the array {name!r} is truncated ({filled} of {needed} bytes)")
            filled += count
    array = np.frombuffer(data, dtype=dtype)
    return array.reshape(shape[::-1]).T if fortran_order else array.reshape(shape)


def read_npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(arrays, dtype names)`` of an ``np.savez`` archive; bf16 (2-byte voids) as float32.

    Read by hand rather than with ``np.load``: the names and declared sizes of the zip's central
    directory, then each member's .npy header, are checked before any data is inflated, so a zip
    bomb or a header declaring gigabytes costs a one-line error, not the memory."""
    _check_npz_magic(path)
    try:
        with zipfile.ZipFile(path) as archive:
            members = _npz_members(path, archive)
            arrays = {name: _read_npy_member(path, archive, name, info) for name, info in members.items()}
    except InputError:
        raise
    except (OSError, ValueError, EOFError, KeyError, RuntimeError, NotImplementedError, zipfile.BadZipFile,
            zlib.error) as error:  # RuntimeError: encrypted; NotImplementedError: unknown compression
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


def found_keys(arrays: Iterable[str]) -> str:
    """The file's array names, for messages about a missing one."""
    return ", ".join(sorted(arrays)) or "nothing"


def check_keys(path: Path, names: Iterable[str]) -> None:
    """The file's array names (checked before its data is read): ``logits`` and known names only."""
    names = set(names)
    found = f"(found: {found_keys(names)})"
    if "logits" not in names:
        raise InputError(f"{path}: no 'logits' array {found}")
    unknown = sorted(names - set(KNOWN_KEYS))
    if unknown:
        raise InputError(f"{path}: unexpected array(s) {', '.join(unknown)}; expected {', '.join(KNOWN_KEYS)} {found}")


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
    if dtypes["logits"] not in ("float32", "float16", "bfloat16", "float64"):
        raise InputError(f"{path}: 'logits' must be floating point; got {dtypes['logits']}")
    return arrays, dtypes
