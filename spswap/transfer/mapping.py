"""A pool entry's ``data.bin`` mapped read-only, with a zero-copy torch view per tensor.

The views point straight into the mapping: they are valid only while the
:class:`MappedEntry` is open, and they must never be written (the pages are mapped
read-only; a write would fault). Registering the mapping with CUDA (see
:mod:`spswap.transfer.cuda_host`) happens at most once per mapping and lasts until
:meth:`MappedEntry.close`, so repeated wakes pay the registration cost once.
"""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path
from types import TracebackType

import torch

from spswap.errors import TransferError
from spswap.pool.manifest import Manifest
from spswap.transfer import cuda_host
from spswap.transfer.dtypes import to_torch
from spswap.transfer.staging import Piece, staging_plan

MAX_PLANS = 8  # staged plans a mapping keeps (one per piece size and left-out set)


class MappedEntry:
    """``data.bin`` of one pool entry, mapped read-only; a context manager."""

    def __init__(self, manifest: Manifest, data_path: Path, *, populate: bool = False) -> None:
        """``populate``: map every page now (``MAP_POPULATE``), so that reading the views
        later never faults: what a CPU engine that computes on the views wants (on the
        2-core CI machine 15.7 GB/s against 9.5 GB/s for a first read that faults)."""
        self.manifest = manifest
        self.data_path = Path(data_path)
        self._mmap: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] | None = None
        self._registration: cuda_host.Registration | None = None
        # by piece size and the tensors left out (a pulled share's: few, see staging_plan)
        self._plans: dict[tuple[int, frozenset[str]], tuple[Piece, ...]] = {}
        self._closed = False
        try:
            fd = os.open(self.data_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise TransferError(
                f"cannot open pool data {self.data_path}: {e.strerror}; check that the entry "
                f"still exists (spswap pool ls) and that this user may read it"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < manifest.data_size_bytes:
                raise TransferError(
                    f"{self.data_path} holds {size} bytes but its manifest says "
                    f"{manifest.data_size_bytes}: the entry is damaged; remove it "
                    f"(spswap pool rm {manifest.name}) and import it again"
                )
            if manifest.data_size_bytes > 0:
                flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
                self._mmap = mmap.mmap(fd, manifest.data_size_bytes, flags, mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping keeps the pages; the descriptor is not needed
        with warnings.catch_warnings():
            # torch warns that the buffer is not writable: that is the point.
            warnings.simplefilter("ignore", UserWarning)
            # Through a memoryview: the mapping then counts the tensor as an export and
            # refuses to unmap while any view lives (instead of leaving it dangling).
            self._base = (
                torch.frombuffer(memoryview(self._mmap), dtype=torch.uint8)
                if self._mmap is not None
                else torch.empty(0, dtype=torch.uint8)
            )

    # -- views -------------------------------------------------------------------------
    def tensors_base(self) -> torch.Tensor:
        """The whole data file as one read-only uint8 tensor (no copy)."""
        self._check_open()
        assert self._base is not None  # set in __init__, dropped only by close()
        return self._base

    @property
    def size_bytes(self) -> int:
        return self.manifest.data_size_bytes

    @property
    def address(self) -> int:
        """Address of the first mapped byte (0 when the entry holds no data)."""
        self._check_open()
        assert self._base is not None
        return self._base.data_ptr() if self._mmap is not None else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the entry as a read-only CPU view into the mapping, by name."""
        self._check_open()
        if self._views is None:
            assert self._base is not None
            views: dict[str, torch.Tensor] = {}
            for t in self.manifest.tensors:
                end = t.offset + t.size_bytes
                if end > self.size_bytes:
                    raise TransferError(
                        f"tensor {t.name} ends at byte {end}, past the end of "
                        f"{self.data_path} ({self.size_bytes}): the manifest is damaged; "
                        f"remove the entry and import it again"
                    )
                raw = self._base[t.offset : end]
                views[t.name] = raw.view(to_torch(t.dtype)).view(t.shape)
            self._views = views
        return self._views

    def staging_plan(
        self, piece_bytes: int, skip: frozenset[str] = frozenset()
    ) -> tuple[Piece, ...]:
        """The staged copy's plan for pieces of ``piece_bytes`` (:func:`staging_plan`),
        the tensors named in ``skip`` left out, made once per piece size and ``skip``: a
        wake copies without planning again."""
        key = (piece_bytes, skip)
        if key not in self._plans:
            if len(self._plans) >= MAX_PLANS:  # a pulled share varies: keep the plain ones
                self._plans = {k: v for k, v in self._plans.items() if not k[1]}
                if len(self._plans) >= MAX_PLANS:  # (many piece sizes: start again)
                    self._plans = {}
            self._plans[key] = tuple(staging_plan(self.manifest, piece_bytes, skip=skip))
        return self._plans[key]

    # -- CUDA registration ---------------------------------------------------------------
    @property
    def registered(self) -> bool:
        return self._registration is not None

    def register_cuda(self) -> float:
        """Page-lock the mapping for DMA (once); returns the seconds it took (0 if done)."""
        self._check_open()
        if self._registration is not None or self._mmap is None:
            return 0.0
        self._registration = cuda_host.register(self.address, self.size_bytes)
        return self._registration.seconds

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Unregister, drop the views, unmap. The views must not be used afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._registration is not None:
                registration, self._registration = self._registration, None
                cuda_host.unregister(registration)
        finally:
            self._views = None
            self._base = None
            mm, self._mmap = self._mmap, None
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # a view is still alive: the mapping goes when the last view does

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"the mapping of {self.data_path} is closed; open the entry again")

    def __enter__(self) -> MappedEntry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
