#!/usr/bin/env python3
"""Zero the GPU code that an H100/H200 (sm_90) cannot run in shared libraries' .nv_fatbin.

Why: vLLM's kernels ship as fat binaries with cubins for every supported architecture
(sm_75/80/86/89/100/120 ...). A Hopper GPU only ever loads the sm_90 ones; the rest is
dead weight in the vLLM kit. Zeroed bytes compress to almost nothing under xz.

What: the file keeps its size and layout. Every fatbin container and entry header stays
where it was; only the payloads of ELF (cubin) entries built for other architectures are
overwritten with zeros, and their headers are marked uncompressed with zero sizes (so that
tools walking every entry do not try to inflate zeros). PTX entries are zeroed only in
containers (compilation units) that also hold a kept cubin; elsewhere the PTX stays as the
JIT fallback (--keep-ptx keeps all PTX). The CUDA driver picks the sm_90 cubin on Hopper
and never reads the others.

Usage: prune_fatbin.py [--keep 90,90a] [--keep-ptx] [--dry-run] FILE.so [FILE.so ...]
"""

from __future__ import annotations

import argparse
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
# Entry flag bits seen on compressed entries.
COMPRESS_BITS = 0x2000 | 0x8000
KIND_NAMES = {1: "ptx", 2: "elf"}
KIND_PTX = 1
KIND_ELF = 2


@dataclass(frozen=True)
class Section:
    offset: int
    size: int
    type: int


@dataclass(frozen=True)
class Entry:
    """One entry of a fatbin container: its header's offset and its payload."""

    kind: int
    arch: int
    header: int
    payload: int
    size: int


def elf_sections(data: bytes | bytearray) -> dict[str, Section]:
    """The section table of a little-endian ELF64 file, by section name."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    (e_shoff,) = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers: list[tuple[int, Section]] = []
    for i in range(e_shnum):
        name, typ, _flags, _addr, offset, size = struct.unpack_from(
            "<IIQQQQ", data, e_shoff + i * e_shentsize
        )
        headers.append((name, Section(offset, size, typ)))
    strtab = headers[e_shstrndx][1].offset
    out: dict[str, Section] = {}
    for name, sec in headers:
        end = data.index(b"\0", strtab + name)
        out[data[strtab + name : end].decode()] = sec
    return out


def container_entries(data: bytes | bytearray, start: int, end: int) -> list[Entry]:
    """The entries of the fatbin container whose entries span data[start:end]."""
    entries: list[Entry] = []
    pos = start
    while pos + 64 <= end:
        kind, _version, header_size, payload_size = struct.unpack_from("<HHIQ", data, pos)
        if header_size == 0:
            break
        (arch,) = struct.unpack_from("<I", data, pos + 28)
        entries.append(Entry(kind, arch, pos, pos + header_size, payload_size))
        pos += header_size + payload_size
    return entries


def zero_entry(data: bytearray, entry: Entry) -> None:
    """Zero an entry's payload and mark it uncompressed, with zero sizes."""
    data[entry.payload : entry.payload + entry.size] = bytes(entry.size)
    (flags,) = struct.unpack_from("<Q", data, entry.header + 40)
    struct.pack_into("<Q", data, entry.header + 40, flags & ~COMPRESS_BITS)
    struct.pack_into("<I", data, entry.header + 16, 0)  # compressed size
    struct.pack_into("<Q", data, entry.header + 56, 0)  # decompressed size


def prune(
    path: Path, keep: Sequence[int] = (90,), dry_run: bool = False, drop_ptx: bool = True
) -> int:
    """Zero the unneeded GPU code in path (in place unless dry_run); return the bytes zeroed."""
    data = bytearray(path.read_bytes())
    fatbin = elf_sections(data).get(".nv_fatbin")
    if fatbin is None:
        print(f"{path}: no .nv_fatbin")
        return 0
    end = fatbin.offset + fatbin.size
    pos = fatbin.offset
    # (kind, arch, zeroed) -> [entries, payload bytes]
    stats: dict[tuple[str, int, bool], list[int]] = {}
    zeroed = 0
    while pos + 16 <= end:
        magic, _version, header_size, body_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-aligned: skip the padding
            continue
        body = pos + header_size
        entries = container_entries(data, body, body + body_size)
        # A compilation unit with a cubin we keep needs no PTX: the driver prefers the cubin.
        has_kept_elf = any(e.kind == KIND_ELF and e.arch in keep for e in entries)
        for e in entries:
            drop = (e.kind == KIND_ELF and e.arch not in keep) or (
                e.kind == KIND_PTX and has_kept_elf and drop_ptx
            )
            st = stats.setdefault((KIND_NAMES.get(e.kind, f"kind{e.kind}"), e.arch, drop), [0, 0])
            st[0] += 1
            st[1] += e.size
            if drop:
                if not dry_run:
                    zero_entry(data, e)
                zeroed += e.size
        pos = body + body_size
    for (kind, arch, drop), (n, size) in sorted(stats.items()):
        print(f"  {kind} sm_{arch}: {n} entries, {size / 1e6:.1f} MB{'  (zeroed)' if drop else ''}")
    print(f"{path}: .nv_fatbin {fatbin.size / 1e6:.1f} MB, zeroed {zeroed / 1e6:.1f} MB")
    if not dry_run:
        path.write_bytes(data)
    return zeroed


def parse_archs(text: str) -> tuple[int, ...]:
    """'90,90a' -> (90, 90): the arch-specific 'a' variants share the cubin's arch number."""
    try:
        return tuple(int(x.strip().rstrip("a")) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of sm numbers: {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("files", nargs="+", type=Path, metavar="FILE.so")
    ap.add_argument(
        "--keep",
        type=parse_archs,
        default=(90,),
        help="architectures whose cubins stay (default: 90)",
    )
    ap.add_argument("--keep-ptx", action="store_true", help="keep every PTX entry")
    ap.add_argument("--dry-run", action="store_true", help="only print what would be zeroed")
    args = ap.parse_args(argv)
    for f in args.files:
        if not f.is_file():
            print(f"prune_fatbin: {f}: no such file", file=sys.stderr)
            return 1
        try:
            prune(f, args.keep, args.dry_run, drop_ptx=not args.keep_ptx)
        except ValueError as exc:
            print(f"prune_fatbin: {f}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
