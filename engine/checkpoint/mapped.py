"""Zero-copy views of checkpoint tensors: each shard memory-mapped once, a tensor a view of its bytes.

The loader copies each view (or a slice of it) straight into its destination parameter, on the
host or the device: one pass over the stored bytes, no intermediate copy, and ``Tensor.copy_``
releases the GIL, so a thread pool reads several tensors at once. The shard headers were parsed and
checked by ``engine.checkpoint.shards.scan_checkpoint`` (byte offsets included) before any view is made.
"""
from __future__ import annotations

import mmap
import threading
import warnings
from pathlib import Path

import torch

from engine.checkpoint.shards import CheckpointError, StoredTensor

TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu, "I16": torch.int16,
                "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
                "U32": torch.uint32, "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64,
                "F64": torch.float64}


class MappedShards:
    """Read-only memory maps of a checkpoint's shards (a context manager; opened on first use)."""

    def __init__(self, ckpt: Path, found: dict[str, StoredTensor]):
        self.ckpt, self.found = ckpt, found
        self._maps: dict[str, tuple] = {}
        self._lock = threading.Lock()                # loader threads map shards on first use

    def _map(self, file: str) -> mmap.mmap:
        with self._lock:
            return self._map_locked(file)

    def _map_locked(self, file: str) -> mmap.mmap:
        if file not in self._maps:
            f = (self.ckpt / file).open("rb")
            try:
                self._maps[file] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            except (OSError, ValueError) as e:
                f.close()
                raise CheckpointError(f"checkpoint: shard {file} cannot be mapped: {e}") from None
        return self._maps[file][1]

    def view(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a read-only view of the mapped shard (its dtype and shape; no copy
        unless the bytes are misaligned for the dtype). Callers copy it, never write to it.

        Raises:
            CheckpointError: an unknown dtype, or the shard cannot be mapped.
        """
        t = self.found[name]
        dtype = TORCH_DTYPES.get(t.dtype)
        if dtype is None:
            raise CheckpointError(f"checkpoint: tensor '{name}' has dtype {t.dtype}, which torch cannot hold")
        with warnings.catch_warnings():          # a read-only buffer: the views are only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(self._map(t.file), dtype=torch.uint8, count=t.nbytes, offset=t.offset) \
                if t.nbytes else torch.empty(0, dtype=torch.uint8)
        if t.offset % dtype.itemsize:
            raw = raw.clone()                    # safetensors does not promise alignment
        return raw.view(dtype).view(t.shape)

    def release(self, name: str, start: int = 0, nbytes: int | None = None) -> None:
        """Drop the mapped pages of bytes ``[start, start + nbytes)`` of tensor ``name`` (default:
        all of it) from this process, after they were copied: file pages count in the RSS while
        mapped; a later access reads them again from the file, so a page shared with a tensor still
        being copied stays correct."""
        t = self.found[name]
        if t.file not in self._maps or not t.nbytes or not hasattr(mmap, "MADV_DONTNEED"):
            return
        begin = t.offset + start
        end = t.offset + (t.nbytes if nbytes is None else min(t.nbytes, start + nbytes))
        lo = begin // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self._maps[t.file][1].madvise(mmap.MADV_DONTNEED, lo, end - lo)
        except (OSError, ValueError):
            pass                                  # only the RSS figure is at stake

    def close(self) -> None:
        """Unmap every shard (views still alive keep their map open until they are freed)."""
        for f, m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass
            f.close()
        self._maps.clear()

    def __enter__(self) -> "MappedShards":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
