"""Trainer state (optimizer, scheduler, sampler, RNG) as JSON plus named tensors: no pickle anywhere.

A checkpoint must never run code when it is loaded: a run directory is shared between machines and users, and
`torch.load` of a pickle (even with `weights_only=True`, a restricted unpickler) trusts the file's bytecode-like
opcode stream. So the nested state is split into a JSON tree and a flat `{name: tensor}` dict that goes into a
safetensors file. Reading either is a parser, never an interpreter.

Encoding (`encode_state`), exact for every type the trainer's state holds:
  None, bool, int, str, finite or non-finite float  -> themselves (NaN/inf as Python's JSON writes them)
  list                                             -> JSON list
  tuple                                            -> {"__tuple__": [...]}
  dict with string keys that do not start with "__" -> JSON object
  any other dict (int keys: optimizer state)       -> {"__dict__": [[key, value], ...]}
  torch.Tensor                                     -> {"__tensor__": "t12"} (the tensor stored as "t12")
  numpy.ndarray (numpy's RNG state)                -> {"__ndarray__": "t13"} (stored as a tensor)
  numpy scalar                                     -> the Python number
Anything else raises TypeError when the checkpoint is written, not when it is read back.
`decode_state` is the inverse; an unknown tag or a missing tensor raises ValueError.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

_TAGS = ("__tuple__", "__dict__", "__tensor__", "__ndarray__", "__float__")


def encode_state(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-serialisable tree, tensors by name) for `state`; the tensors are the state's own (detached)."""
    tensors: dict[str, torch.Tensor] = {}

    def store(tensor: torch.Tensor) -> str:
        name = f"t{len(tensors)}"
        # No copy: the writer (durable_io.write_safetensors) moves one tensor at a time to the CPU.
        tensors[name] = tensor.detach()
        return name

    def encode(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            # Strict JSON has no NaN/inf; keep them exact and parseable by any reader.
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, np.generic):
            return encode(value.item())
        if isinstance(value, torch.Tensor):
            return {"__tensor__": store(value)}
        if isinstance(value, np.ndarray):
            return {"__ndarray__": store(torch.from_numpy(np.ascontiguousarray(value)))}
        if isinstance(value, tuple):
            return {"__tuple__": [encode(item) for item in value]}
        if isinstance(value, list):
            return [encode(item) for item in value]
        if isinstance(value, dict):
            if all(isinstance(key, str) and not key.startswith("__") for key in value):
                return {key: encode(item) for key, item in value.items()}
            return {"__dict__": [[encode(key), encode(item)] for key, item in value.items()]}
        raise TypeError(f"cannot store {type(value).__name__} in a checkpoint's trainer state: {value!r:.80}")

    return encode(state), tensors


def decode_state(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of `encode_state`."""

    def tensor(name: Any) -> torch.Tensor:
        if not isinstance(name, str) or name not in tensors:
            raise ValueError(f"trainer state refers to tensor {name!r}, which the tensor file does not hold")
        return tensors[name]

    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return [decode(item) for item in value]
        if not isinstance(value, dict):
            return value
        tags = [key for key in value if key in _TAGS]
        if not tags:
            return {key: decode(item) for key, item in value.items()}
        if len(value) != 1:
            raise ValueError(f"malformed trainer state entry {value!r:.80}")
        tag, payload = tags[0], value[tags[0]]
        if tag == "__tensor__":
            return tensor(payload)
        if tag == "__ndarray__":
            return tensor(payload).numpy()
        if tag == "__float__":
            return float(payload)
        if not isinstance(payload, list):
            raise ValueError(f"malformed trainer state entry {value!r:.80}")
        if tag == "__tuple__":
            return tuple(decode(item) for item in payload)
        pairs = []
        for pair in payload:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ValueError(f"malformed trainer state entry {value!r:.80}")
            pairs.append((_hashable(decode(pair[0])), decode(pair[1])))
        return dict(pairs)

    return decode(tree)


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict)):
        raise ValueError(f"trainer state has an unhashable dict key {key!r:.80}")
    return key
