"""The memory allocator a CPU training process runs with, and a line for the log where a faster one is there
to use.

A training step on a CPU allocates and frees hundreds of activation and gradient tensors. On a quiet 2-core
Xeon with AMX, the default `dvc repro` ran its train stage 1.12x faster under tcmalloc than under glibc's
malloc (7,386 and 7,370 vs 6,615 and 6,557 real tokens/s, whole runs alternated), with the same test
predictions byte for byte; jemalloc gained nothing measurable there (docs/speed.md, The memory allocator).
A process gets its allocator when it starts (LD_PRELOAD), so the stage cannot switch its own: it says how.
"""
import ctypes.util
import sys

KNOWN = ("tcmalloc", "jemalloc")
PACKAGE = "libtcmalloc-minimal4"  # Debian's and Ubuntu's (libtcmalloc-minimal4t64 from Ubuntu 24.04 and Debian 13 on)


def preloaded(maps):
    """The allocator among KNOWN whose library the text of a /proc/<pid>/maps file shows mapped, else None."""
    for line in maps.splitlines():
        name = line.rsplit("/", 1)[-1] if "/" in line else ""
        for allocator in KNOWN:
            if name.startswith(f"lib{allocator}"):
                return allocator
    return None


def running():
    """This process's allocator: "tcmalloc", "jemalloc", "glibc" (Linux, neither mapped), None where it
    cannot be told (no /proc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            return preloaded(maps.read()) or "glibc"
    except OSError:
        return None


def tcmalloc_library():
    """The name of the tcmalloc library installed here, for LD_PRELOAD (the loader finds a bare name in
    its usual places), None where there is none."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def note(device, allocator, library):
    """A line for the log where a CPU process runs on glibc's malloc ("" elsewhere): tcmalloc's measured
    gain and the command that uses it; library: tcmalloc_library()."""
    if device != "cpu" or allocator != "glibc":
        return ""
    how = (f"LD_PRELOAD={library} dvc repro" if library else
           f"apt-get install {PACKAGE}, then LD_PRELOAD=libtcmalloc_minimal.so.4 dvc repro")
    return ("memory allocator: glibc's malloc; under tcmalloc the default run trained 1.12x faster on a CPU "
            f"with AMX, with the same predictions (docs/speed.md): {how}")
