"""Durable file writes (checkpoints, exports): fsync'd, digested while written, the storage's OSError intact.

- `write_safetensors` streams tensors into a safetensors file (format: 8-byte little-endian header length, a JSON
  header `{name: {dtype, shape, data_offsets}}` padded with spaces to a multiple of 8, then the raw bytes). It is
  written here rather than by `safetensors.torch.save_file` for three reasons: a full disk surfaces as the
  OSError (errno ENOSPC) that `errors.storage_error` can name, not as a native container error; the SHA-256
  of the file is computed from the bytes as they are written (no second read of gigabytes); and the file is
  fsync'd before anyone renames the directory holding it. Tensors are laid out largest element size first,
  so with the 8-byte aligned header every tensor starts at a multiple of its element size. Reading stays with
  `safetensors.torch.load_file` (the reference parser), through `read_safetensors`, which names the file when it
  is damaged (`CorruptFileError`; the parser's own message names none); `check_safetensors_file` parses only the
  header (a truncated or overwritten file fails there), for files another library reads (a target's weights).
- `write_bytes` does the same for small files (JSON, YAML); `file_digest` recomputes a file's digest for
  verification at load; `fsync_dir` makes a rename inside a directory durable.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .errors import CorruptFileError

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_CHUNK = 1 << 24  # bytes per write: large enough for throughput, small enough to bound the extra memory


@dataclass(frozen=True)
class FileDigest:
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, int | str]:
        return {"bytes": self.bytes, "sha256": self.sha256}


class _DigestWriter:
    """Writes to a binary file, counting and hashing every byte."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.hash = hashlib.sha256()
        self.count = 0

    def write(self, data: bytes | memoryview) -> None:
        self.file.write(data)
        self.hash.update(data)
        self.count += len(data)

    def digest(self) -> FileDigest:
        return FileDigest(bytes=self.count, sha256=self.hash.hexdigest())


def safetensors_file_size(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """The exact size in bytes of the file `write_safetensors(path, tensors, metadata)` writes."""
    header, _ = _header(tensors, metadata)
    return 8 + len(header) + sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    """(the padded JSON header, the tensors' names in file order)."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, object] = {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors code")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return header_bytes + b" " * (-len(header_bytes) % 8), order


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> FileDigest:
    """Write `tensors` (CPU or device; copied to CPU one at a time) as a safetensors file, fsync'd."""
    header_bytes, order = _header(tensors, metadata)
    with path.open("wb") as file:
        writer = _DigestWriter(file)
        writer.write(struct.pack("<Q", len(header_bytes)))
        writer.write(header_bytes)
        for name in order:
            flat = tensors[name].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)  # [bytes]
            for start in range(0, flat.numel(), _CHUNK):
                writer.write(memoryview(flat[start : start + _CHUNK].numpy()))
        file.flush()
        os.fsync(file.fileno())
    return writer.digest()


def write_bytes(path: Path, data: bytes) -> FileDigest:
    """Write `data` to `path`, fsync'd."""
    with path.open("wb") as file:
        writer = _DigestWriter(file)
        writer.write(data)
        file.flush()
        os.fsync(file.fileno())
    return writer.digest()


def file_digest(path: Path) -> FileDigest:
    digest, count = hashlib.sha256(), 0
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
            count += len(chunk)
    return FileDigest(bytes=count, sha256=digest.hexdigest())


def fsync_dir(path: Path) -> None:
    """Make the directory entries of `path` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _corrupt(path: Path, what: str, error: BaseException) -> CorruptFileError:
    problem = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return CorruptFileError(
        f"{path}: {what} is damaged or incomplete, not a readable safetensors file ({problem}); copy or write it again"
    )


def check_safetensors_file(path: Path, *, what: str = "this file") -> None:
    """Parse the header of safetensors file `path` (tensor names, dtypes, offsets covering the file exactly) without
    reading the tensors; CorruptFileError naming the file when it does not parse."""
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError, ValueError) as error:
        raise _corrupt(path, what, error) from error


def read_safetensors(path: Path, *, what: str = "this file", device: str = "cpu") -> dict[str, torch.Tensor]:
    """`safetensors.torch.load_file(path)`, with a damaged file reported as CorruptFileError naming it."""
    try:
        return load_file(str(path), device=device)
    except (SafetensorError, ValueError) as error:
        raise _corrupt(path, what, error) from error
