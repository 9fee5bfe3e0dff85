"""The prefix cache's second tier: its entries written to a folder, so that a restarted server still has the
keys and values of the conversations it served (Ollama and vLLM users ask for this; llama.cpp saves and restores
slots by hand).

Every entry the memory tier keeps is written through, by a background thread, as one safetensors file: its
tokens, keys and values (and a hybrid model's recurrent states, by the lengths they follow), with a header naming
the model identity the numbers came from and a checksum of every tensor. A request the memory tier misses looks
here; a file read back joins the memory tier. A hit is exact only if the file holds the bits this process would
compute, so the identity covers what changes them (the model's files, dtype, quantization, the native kernels'
build and level, the layers' kernels), and a file that fails any check (another identity, cut short, a flipped
bit, not a safetensors file) is skipped with one line and removed: it costs a cold prefill, never an answer.
The folder holds at most `capacity_bytes` of one identity's files, the least recently used dropped first.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save_file

from speculant.models import native
from speculant.models.kv_cache import KVCache

log = logging.getLogger("speculant")

FORMAT = "speculant-prefix-1"
SUFFIX = ".safetensors"
MAX_HEADER = 1 << 24  # a header longer than this is not one this module wrote
# A file is read whole (its checksum covers all of it): only where the tokens it saves are worth it, not for the
# few tokens a chat template starts every conversation with. Reading and checking a token's keys costs about a
# hundredth of computing them on a CPU.
MIN_GAIN_TOKENS = 16
GAIN_SHARE = 32  # and at least 1/GAIN_SHARE of the file's tokens
STALE_WRITE_S = 600


def default_disk_bytes(folder: Path) -> int:
    """A quarter of the free space where the folder lives (or will: its nearest existing parent), at most 16 GiB."""
    where = folder.resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = 0
    return min(16 << 30, free // 4)


def model_files(source: str) -> str:
    """The model's path and its files' names, sizes and modification times: a file replaced or re-saved is
    another model."""
    path = Path(source).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return f"{path} " + ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def model_identity(target, cache: KVCache) -> dict[str, str]:
    """Everything a position's keys and values depend on besides the tokens (`target` a LoadedModel)."""
    model = target.model
    level = native.level()
    return {
        "format": FORMAT,
        "model": model_files(target.source),
        "dtype": str(model.dtype),
        "cache": f"{str(cache.k.dtype)} {tuple(cache.k.shape[i] for i in (0, 2, 4))}",
        "states": str(getattr(cache, "shapes", None)),
        "quantization": str(target.quantization),
        "kernels": f"{level} {native.module_name(native.build_of(level)) if level != 'off' else ''}",
        "layers": " ".join(sorted({f"{type(m).__name__}:{getattr(m, 'row_exact', '')}" for m in model.modules()})),
        "torch": torch.__version__,
    }


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def intact(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bool:
    return meta.get("checksum") == checksum(tensors)


def parse_header(data: bytes) -> tuple[dict, int]:
    """A safetensors file's header (its JSON) from the file's first bytes, and where its data starts; ValueError
    where they are not one."""
    if len(data) < 8:
        raise ValueError("shorter than a header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER:
        raise ValueError("not a safetensors header")
    if len(data) < 8 + n:
        raise ValueError("cut short in its header")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise ValueError("no metadata in its header")
    return header, 8 + n


def read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        return parse_header(head + f.read(min(n, MAX_HEADER + 1)))


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclass
class Stored:
    """What a file holds, as prefix_cache.Entry holds it."""

    tokens: np.ndarray
    k: torch.Tensor
    v: torch.Tensor
    states: dict[int, list]


@dataclass(eq=False)
class DiskEntry:
    path: Path
    tokens: np.ndarray  # [n] int64, as the file's header claims (checked again when the file is read)
    state_lengths: tuple[int, ...]  # a hybrid model's: the lengths a hit may start from
    nbytes: int
    last_used: int  # the file's modification time (ns): read hits touch it

    def usable(self, n: int) -> int:
        if not self.state_lengths:
            return n
        return max((b for b in self.state_lengths if b <= n), default=0)

    def worth_reading(self, gain: int) -> bool:
        return gain >= max(MIN_GAIN_TOKENS, len(self.tokens) // GAIN_SHARE)


def entry_tensors(entry) -> dict[str, torch.Tensor]:
    tensors = {"tokens": torch.from_numpy(np.ascontiguousarray(entry.tokens, dtype=np.int64)),
               "k": entry.k.contiguous(), "v": entry.v.contiguous()}
    for n, layers in list(entry.states.items()):  # a copy: the engine's thread may add lengths meanwhile
        for i, (matrix, window) in enumerate(layers):
            # Copies: a state may be a view into a tensor the recurrence made for several positions.
            tensors[f"state.{n}.{i}.matrix"] = matrix.contiguous().clone()
            tensors[f"state.{n}.{i}.window"] = window.contiguous().clone()
    return tensors


class PrefixStore:
    """One model identity's prefix cache files in `folder`/<identity hash>/, at most `capacity_bytes`."""

    def __init__(self, folder: str | Path, identity: dict[str, str], capacity_bytes: int, cache: KVCache):
        self.identity = identity
        self.capacity_bytes = capacity_bytes
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        self.folder = Path(folder).expanduser() / digest[:16]
        self.layers, self.heads, self.head_dim = (cache.k.shape[i] for i in (0, 2, 4))
        self.dtype = cache.k.dtype
        self.n_linear = getattr(cache, "n_linear", 0)
        self.state_shapes = getattr(cache, "shapes", None)
        self.entries: list[DiskEntry] = []
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._write_failed = self._too_big_said = False
        self.folder.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-store", daemon=True)
        self._writer.start()
        atexit.register(self.close)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    # -- reading --------------------------------------------------------------------------------

    def _scan(self) -> None:
        for path in self.folder.iterdir():
            if path.name.endswith(".tmp"):
                self._drop_stale(path)
            elif path.suffix == SUFFIX:
                try:
                    self.entries.append(self._index(path))
                except Exception as e:  # noqa: BLE001 (any unreadable file is skipped, never raised)
                    self._skip(path, e)
        log.info("prefix cache on disk: %d entries, %d tokens, %.2f GiB of at most %.2f in %s", len(self.entries),
                 sum(len(e.tokens) for e in self.entries), self.nbytes / 2**30, self.capacity_bytes / 2**30,
                 self.folder)

    def _index(self, path: Path) -> DiskEntry:
        header, start = read_header(path)
        meta = header["__metadata__"]
        if meta.get("identity") != json.dumps(self.identity, sort_keys=True):
            raise ValueError("written for another model identity (model file, dtype, quantization or kernels)")
        info = header["tokens"]
        if info.get("dtype") != "I64" or len(info.get("shape", ())) != 1:
            raise ValueError("its tokens are not a list of int64")
        lo, hi = info["data_offsets"]
        with open(path, "rb") as f:
            f.seek(start + lo)
            raw = f.read(hi - lo)
        if len(raw) != hi - lo or hi - lo != 8 * info["shape"][0]:
            raise ValueError("cut short")
        st = path.stat()
        lengths = tuple(sorted({int(name.split(".")[1]) for name in header if name.startswith("state.")}))
        return DiskEntry(path, np.frombuffer(raw, dtype=np.int64).copy(), lengths, st.st_size, st.st_mtime_ns)

    @staticmethod
    def _drop_stale(path: Path) -> None:
        """A write a stopped process left half done (a live one's, sharing the folder, is younger than this)."""
        try:
            if time.time() - path.stat().st_mtime > STALE_WRITE_S:
                path.unlink()
        except OSError:
            pass

    def _skip(self, path: Path, why: Exception | str) -> None:
        text = str(why).splitlines()[0][:200] if str(why) else ""
        log.warning("prefix cache on disk: %s skipped and removed (%s)", path.name,
                    text if isinstance(why, (str, ValueError)) and text else f"{type(why).__name__}: {text}")
        path.unlink(missing_ok=True)

    def longest(self, ids: np.ndarray) -> tuple[DiskEntry | None, int]:
        best, best_n = None, 0
        with self._lock:
            for entry in self.entries:
                n = entry.usable(common_prefix(entry.tokens, ids))
                if n > best_n:
                    best, best_n = entry, n
        return best, best_n

    def read(self, disk: DiskEntry) -> Stored | None:
        """The file's tokens, keys, values and states, checked against this model and its checksum; None (with
        one line, and the file removed) where any check fails."""
        try:
            data = disk.path.read_bytes()
            header, _ = parse_header(data)
            meta = header["__metadata__"]
            if meta.get("identity") != json.dumps(self.identity, sort_keys=True):
                raise ValueError("written for another model identity")
            tensors = load_tensors(data)
            if not intact(tensors, meta):
                raise ValueError("checksum mismatch")
            entry = Stored(tensors["tokens"].numpy(), tensors["k"], tensors["v"], {})
            self._check(entry, disk, tensors)
        except Exception as e:  # noqa: BLE001 (a file that fails any check is skipped, never raised)
            with self._lock:
                self.entries = [x for x in self.entries if x is not disk]
            self._skip(disk.path, e)
            return None
        self._touch(disk)
        return entry

    def _touch(self, disk: DiskEntry) -> None:
        """Mark a file used now, in this process and in its modification time (a restart's order)."""
        disk.last_used = time.time_ns()
        try:
            os.utime(disk.path, ns=(disk.last_used, disk.last_used))
        except OSError:
            pass

    def _check(self, entry: Stored, disk: DiskEntry, tensors: dict[str, torch.Tensor]) -> None:
        n = len(entry.tokens)
        shape = (self.layers, self.heads, n, self.head_dim)
        if not np.array_equal(entry.tokens, disk.tokens):
            raise ValueError("its tokens changed since it was indexed")
        for t in (entry.k, entry.v):
            if tuple(t.shape) != shape or t.dtype != self.dtype:
                raise ValueError(f"keys of shape {tuple(t.shape)} {t.dtype}, this model's are {shape} {self.dtype}")
        for length in disk.state_lengths:
            layers = []
            for i in range(self.n_linear):
                matrix, window = tensors[f"state.{length}.{i}.matrix"], tensors[f"state.{length}.{i}.window"]
                if (tuple(matrix.shape), tuple(window.shape)) != tuple(tuple(s) for s in self.state_shapes):
                    raise ValueError("recurrent states of another shape")
                layers.append((matrix, window))
            if not 0 < length <= n:
                raise ValueError(f"a state at length {length} of {n} tokens")
            entry.states[length] = layers
        if bool(disk.state_lengths) != bool(self.n_linear):
            raise ValueError("recurrent states where the model has none, or none where it has")

    # -- writing --------------------------------------------------------------------------------

    def put(self, entry) -> None:
        """Write `entry` (a prefix_cache.Entry the memory tier just kept, or anything with its fields) in the
        background; the files of entries it extends are removed once it is written."""
        self._jobs.put(entry)

    def flush(self) -> None:
        """Wait for the writes asked so far."""
        self._jobs.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._jobs.put(None)
            self._writer.join(timeout=30)

    def _write_loop(self) -> None:
        while True:
            entry = self._jobs.get()
            try:
                if entry is None:
                    return
                self._write(entry)
            except Exception as e:  # noqa: BLE001 (a full disk or a gone folder: the memory tier goes on)
                if not self._write_failed:
                    log.warning("prefix cache on disk: writing to %s failed (%s); entries stay in memory only "
                                "(later failures are not logged)", self.folder, str(e).splitlines()[0][:200])
                self._write_failed = True
            finally:
                self._jobs.task_done()

    def _write(self, entry) -> None:
        ids = entry.tokens
        with self._lock:
            covering = [e for e in self.entries if e.usable(common_prefix(e.tokens, ids)) == len(ids)]
        if covering:  # held already, as this file or part of a longer one
            self._touch(covering[0])
            return
        tensors = entry_tensors(entry)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.capacity_bytes:
            if not self._too_big_said:
                log.info("prefix cache on disk: an entry of %.1f MiB is more than the folder may hold (%.1f MiB); "
                         "such entries stay in memory only", size / 2**20, self.capacity_bytes / 2**20)
            self._too_big_said = True
            return
        name = hashlib.sha256(ids.tobytes()).hexdigest()[:32] + SUFFIX
        path = self.folder / name
        tmp = path.with_name(f"{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        meta = {"format": FORMAT, "identity": json.dumps(self.identity, sort_keys=True),
                "checksum": checksum(tensors)}
        self._make_room(size)
        try:
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)  # atomic: a reader sees the whole file or none
        finally:
            tmp.unlink(missing_ok=True)
        lengths = tuple(sorted({int(name.split(".")[1]) for name in tensors if name.startswith("state.")}))
        written = DiskEntry(path, ids.copy(), lengths, path.stat().st_size, 0)
        self._touch(written)
        with self._lock:
            extended = [e for e in self.entries if common_prefix(e.tokens, ids) == len(e.tokens)]
            self.entries = [e for e in self.entries if e not in extended and e.path != path]
            self.entries.append(written)
        for e in extended:
            if e.path != path:
                e.path.unlink(missing_ok=True)
        self._make_room(0)  # the header's bytes, which `size` left out

    def _make_room(self, need: int) -> None:
        with self._lock:
            self.entries.sort(key=lambda e: e.last_used)
            total = self.nbytes
            dropped = []
            while self.entries and total + need > self.capacity_bytes:
                dropped.append(self.entries.pop(0))
                total -= dropped[-1].nbytes
        for e in dropped:
            e.path.unlink(missing_ok=True)


def open_store(folder: str | Path, capacity_bytes: int | None, target, cache: KVCache) -> PrefixStore | None:
    """The store for `target`'s prefix cache in `folder`; None, with one line, where the folder cannot be used."""
    folder = Path(folder).expanduser()
    if capacity_bytes is None:
        capacity_bytes = default_disk_bytes(folder)
    try:
        store = PrefixStore(folder, model_identity(target, cache), capacity_bytes, cache)
    except OSError as e:
        log.warning("prefix cache on disk is off: %s cannot be used (%s)", folder, e.strerror or e)
        return None
    return store
