"""The memory allocator a CPU training process runs under (training/allocator.py): read off the libraries
mapped into the process, and the log's line on glibc's malloc saying how to train under tcmalloc."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training import allocator


MAPS = """55d0c8a00000-55d0c8a01000 r--p 00000000 00:2e 123 /usr/bin/python3.11
7f1a2c000000-7f1a2c021000 rw-p 00000000 00:00 0
7f1a2d1e0000-7f1a2d1e9000 r-xp 00000000 00:2e 456 /usr/lib/x86_64-linux-gnu/{lib}
7f1a2d400000-7f1a2d428000 r--p 00000000 00:2e 789 /usr/lib/x86_64-linux-gnu/libc.so.6
7ffd5b1f2000-7ffd5b213000 rw-p 00000000 00:00 0 [stack]"""


@pytest.mark.parametrize("library, found", [
    ("libtcmalloc_minimal.so.4.5.10", "tcmalloc"),
    ("libtcmalloc.so.4", "tcmalloc"),
    ("libjemalloc.so.2", "jemalloc"),
    ("libm.so.6", None),                      # glibc's malloc: none of them mapped
    ("libtorch_cpu_tcmalloc_stub.so", None),  # a name that only contains one
])
def test_the_allocator_is_read_off_the_libraries_mapped(library, found):
    assert allocator.preloaded(MAPS.format(lib=library)) == found


@pytest.mark.parametrize("device, running, library, says", [
    ("cpu", "glibc", "libtcmalloc_minimal.so.4", "LD_PRELOAD=libtcmalloc_minimal.so.4 dvc repro"),
    ("cpu", "glibc", None, "apt-get install libtcmalloc-minimal4, then LD_PRELOAD=libtcmalloc_minimal.so.4 dvc repro"),
    ("cpu", "tcmalloc", "libtcmalloc_minimal.so.4", ""),  # already under it
    ("cpu", "jemalloc", "libtcmalloc_minimal.so.4", ""),  # the user's own choice
    ("cpu", None, None, ""),                              # not Linux: cannot tell
    ("cuda", "glibc", "libtcmalloc_minimal.so.4", ""),    # measured on a CPU only
])
def test_a_cpu_run_on_glibc_malloc_is_told_how_to_train_under_tcmalloc(device, running, library, says):
    line = allocator.note(device, running, library)
    assert (says == "" and line == "") or (says in line and "1.12x" in line), line


def test_a_process_started_under_tcmalloc_says_so_and_one_without_says_glibc():
    """The real loader: the test's process, and a child started with LD_PRELOAD set to the library found here
    (scripts/install-system-packages.sh installs it)."""
    library = allocator.tcmalloc_library()
    assert library, "no tcmalloc installed: bash scripts/install-system-packages.sh"
    script = "from training.allocator import running\nprint(running())"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | \
        {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = {preload: subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                    env=env | ({"LD_PRELOAD": library} if preload else {}))
            for preload in (False, True)}
    assert all(done.returncode == 0 for done in runs.values()), [done.stderr for done in runs.values()]
    assert [runs[False].stdout.strip(), runs[True].stdout.strip()] == ["glibc", "tcmalloc"]
