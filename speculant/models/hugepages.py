"""A loaded model's weights moved into one mapping of 2 MB pages (Linux's transparent huge pages, asked for
with madvise: most machines, this one included, give them only to memory that asks).

A decode pass reads every weight once. SmolLM2-135M in int4 is ~92 MB: ~23,000 pages of 4 KB a pass,
far more than the TLB holds, so nearly every page costs a page-table walk; in 2 MB pages it is 46.
The gain is the page walks' share of a pass, small but steady, the outputs identical. The KV cache in
huge pages as well made no difference, so it stays where it is.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import torch
from torch import nn

PAGE = 2 ** 21
MIN_BYTES = 4096  # smaller tensors (norm weights) stay where they are
ALIGN = 64
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# SPECULANT_HUGE_PAGES=off leaves the weights where they were loaded (to compare).
SWITCH_ENV = "SPECULANT_HUGE_PAGES"


def huge_pages_available() -> bool:
    """Whether madvise(MADV_HUGEPAGE) can give this process huge pages (Linux, THP not "never"), and
    SWITCH_ENV does not turn them off."""
    if os.environ.get(SWITCH_ENV, "on") == "off" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def move_to_huge_pages(model: nn.Module) -> int:
    """Move the model's CPU parameters and buffers of MIN_BYTES or more (each its whole storage) into one
    mapping advised for huge pages, each tensor shared by several modules (tied weights) moved once.
    Returns the bytes moved (0 where huge pages are not available)."""
    if not huge_pages_available():
        return 0
    # (module, name, is_parameter, key): no tensor held here, so that each original is freed as soon as its
    # last module moves to the copy (a model twice over would not fit where it barely does once).
    slots, sizes = [], {}
    for module in model.modules():
        for table, is_parameter in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                nbytes = 0 if t is None else t.numel() * t.element_size()
                # A whole storage only: not a view into a larger one, nor a layout with padding past numel,
                # nor oneDNN's packed weights (PackedLinear without the native kernels), which have none.
                if (t is not None and t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
                        and nbytes >= MIN_BYTES and t.untyped_storage().nbytes() == nbytes):
                    key = (t.data_ptr(), t.dtype, tuple(t.shape))
                    slots.append((module, name, is_parameter, key))
                    sizes[key] = nbytes
    if not slots:
        return 0
    offsets, end = {}, 0
    for key, nbytes in sizes.items():
        offsets[key] = end
        end += -(-nbytes // ALIGN) * ALIGN
    region = huge_page_region(end)
    moved: dict[tuple, torch.Tensor] = {}
    for module, name, is_parameter, key in slots:
        table = module._parameters if is_parameter else module._buffers
        if key not in moved:
            t, at = table[name], offsets[key]
            moved[key] = region[at:at + sizes[key]].view(t.dtype).view(t.shape).copy_(t)
            del t
        if is_parameter:
            table[name].data = moved[key]
        else:
            table[name] = moved[key]
    return end


def huge_page_region(nbytes: int) -> torch.Tensor:
    """nbytes of a fresh anonymous mapping advised for huge pages, from a 2 MB boundary, as uint8. The
    tensor keeps the mapping alive."""
    mapping = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: faults then map 2 MB at once
    region = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -region.data_ptr() % PAGE
    return region[start:start + nbytes]


class Reading:
    """A file being copied into huge pages by a thread: the region is there at once (views of it can be
    made), its bytes once wait() returns. The copy releases the GIL, so building the model overlaps it."""

    def __init__(self, path: Path):
        self.path, self.error = path, None
        self.region = huge_page_region(path.stat().st_size)
        self.thread = threading.Thread(target=self._copy, name=f"read {path.name}", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        try:
            view, done = memoryview(self.region.numpy()), 0
            with open(self.path, "rb", buffering=0) as f:
                while done < len(view):
                    n = f.readinto(view[done:])
                    if not n:
                        raise OSError(f"{self.path}: ended after {done} of {len(view)} bytes")
                    done += n
        except BaseException as e:  # handed to whoever waits
            self.error = e

    def wait(self) -> torch.Tensor:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.region


def start_reading(path: Path) -> Reading | None:
    """A copy of the file into a fresh mapping advised for huge pages, begun in the background, or None where
    huge pages are not available (a mapping of the file itself stays in the page cache's 4 KB pages)."""
    return Reading(path) if huge_pages_available() else None

