"""The pages behind bulk memory: huge pages asked for where the kernel allows them, and the
page size a mapping actually got.

A 2 MiB block on 4 KiB pages is 512 TLB entries and 512 page walks per copy, and the
hardware prefetchers stop at every 4 KiB boundary; on one 2 MiB page it is one. Whether a
mapping gets huge pages is the kernel's call (/sys/kernel/mm/transparent_hugepage:
`enabled` for anonymous memory, `shmem_enabled` for memfds), so the staging area and the
pool ask (MADV_HUGEPAGE before the first touch, MADV_COLLAPSE after it, Linux 6.1+), never
insist, and what they got is read back from /proc/<pid>/smaps (bench_agent reports it).
"""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass

# Linux values, for Pythons built against headers older than the constant.
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)

_RANGE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")
_HUGE_FIELDS = ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped")


def ask_huge_pages(mm: mmap.mmap, collapse: bool) -> None:
    """Ask for transparent huge pages on `mm` (best effort: a kernel that refuses, EINVAL
    where THP is off for this kind of memory, leaves it on small pages). `collapse`: its
    pages are already there (touched or populated), so also ask the kernel to move them
    onto huge pages now (MADV_COLLAPSE; on failure, ENOMEM or EAGAIN, they stay small)."""
    for advice in (MADV_HUGEPAGE, MADV_COLLAPSE) if collapse else (MADV_HUGEPAGE,):
        try:
            mm.madvise(advice)
        except (OSError, ValueError):
            pass  # not allowed here: small pages, which bench_agent reports


@dataclass(frozen=True, slots=True)
class PageReport:
    """What backs one mapping (from /proc/<pid>/smaps)."""

    start: int  # address range [start, end)
    end: int
    name: str  # the mapping's path ("" when anonymous)
    rss_kib: int
    huge_kib: int  # resident bytes mapped by 2 MiB page-table entries (THP)
    kernel_page_kib: int  # the base page size (KernelPageSize)

    @property
    def page_kib(self) -> int:
        """The page size that maps most of the resident bytes: 2048 when most are on
        transparent huge pages, else the base page size."""
        if self.rss_kib and self.huge_kib * 2 > self.rss_kib:
            return 2048
        return self.kernel_page_kib

    @property
    def size_kib(self) -> int:
        return (self.end - self.start) >> 10

    @property
    def huge_share(self) -> float:
        return self.huge_kib / self.rss_kib if self.rss_kib else 0.0


def _kib(value: str) -> int:
    return int(value.split()[0])


def mappings(pid: int | str = "self") -> list[PageReport]:
    """Every mapping of process `pid`, from /proc/<pid>/smaps."""
    out: list[PageReport] = []
    cur: dict[str, str] = {}
    name, start, end = "", 0, 0

    def flush() -> None:
        if cur:
            out.append(
                PageReport(
                    start,
                    end,
                    name,
                    _kib(cur.get("Rss", "0 kB")),
                    sum(_kib(cur.get(f, "0 kB")) for f in _HUGE_FIELDS),
                    _kib(cur.get("KernelPageSize", "4 kB")),
                )
            )

    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = _RANGE.match(line)
            if m:
                flush()
                cur = {"Rss": "0 kB"}
                fields = line.split(maxsplit=5)
                name = fields[5].strip() if len(fields) > 5 else ""
                start, end = int(m.group(1), 16), int(m.group(2), 16)
            elif ":" in line:
                key, value = line.split(":", 1)
                if value.strip().endswith("kB"):
                    cur[key] = value.strip()
        flush()
    return out


def mapping_of(address: int, pid: int | str = "self") -> PageReport | None:
    """The mapping of process `pid` that holds `address`, or None."""
    return next((m for m in mappings(pid) if m.start <= address < m.end), None)
