"""The memory allocator a CPU training process runs with (machine.allocator): a training stage (train, pseudo,
distill) starts itself again under tcmalloc where that was measured faster on this kind of CPU, tcmalloc is
installed here and the run is long enough to repay starting again; elsewhere a line for the log says how to use it.

A training step on a CPU allocates and frees hundreds of activation and gradient tensors. On a quiet 2-core
Xeon with AMX, the default `dvc repro` ran its train stage 1.12x faster under tcmalloc than under glibc's
malloc (7,386 and 7,370 vs 6,615 and 6,557 real tokens/s, whole runs alternated), with the same test
predictions byte for byte; jemalloc gained nothing measurable there (docs/speed.md, The memory allocator).
A process gets its allocator when it starts (LD_PRELOAD), so the stage starts again under it, as PyTorch's
own CPU launcher (torch.backends.xeon.run_cpu) preloads tcmalloc where it finds it: os.execve replaces the
process by the same command (the same pid, so dvc, torchrun and signals still see one stage), which then
imports torch and transformers again. machine.allocator: system keeps the process's own.
"""
import ctypes.util
import os
import sys

import torch

from pipeline.settings import PipelineError
from training.compiling import pays_off
from modeling.precision import cpu_isa
from training.processes import become, relaunch_environment, running_module

KNOWN = ("tcmalloc", "jemalloc")
PACKAGE = "libtcmalloc-minimal4"  # Debian's and Ubuntu's (libtcmalloc-minimal4t64 from Ubuntu 24.04 and Debian 13 on)
RESTARTED = "PIPELINE_RESTARTED_UNDER"  # in the restarted process's environment: the library; it never restarts twice

# (device, ISA) -> (the train stage's speed under tcmalloc / under glibc's malloc, starting again's cost in its
# steps), measured on the embedded MiniLM at the train stage's defaults (docs/speed.md, The memory allocator)
MEASURED = {
    # 1.12x in whole runs (2026-12-04), then 1.13x, 1.02x, 1.13x and 1.11x in train stages' times, alternated,
    # on a quiet 2-core Xeon with AMX (2026-12-05), the same predictions byte for byte; starting again (python,
    # torch and transformers imported again) took about 3.5 s, some 40 of its steps: it pays from about 440 on
    ("cpu", "AMX"): (1.10, 40),
}


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


def choose_restart(setting, device, isa, allocator, library, steps, restarted=None, measured=None):
    """(the library to start again under, or None; a line for the log, "" where the stage has nothing to
    add to the fold's note) for machine.allocator `setting` (auto, tcmalloc, system) on `device` with the
    CPU's `isa`: allocator is this process's (running()), library tcmalloc_library(), steps the run's
    optimizer steps, restarted the library this process was started again under (RESTARTED), measured
    MEASURED's kind. auto starts again where tcmalloc was measured faster on this kind of CPU and `steps`
    repay the start; elsewhere the fold's note (note()) says what tcmalloc gained and how to use it."""
    measured = MEASURED if measured is None else measured
    if device != "cpu" or setting == "system" or allocator != "glibc":
        return None, ""  # a GPU: not measured; already tcmalloc or the user's own; not Linux: cannot tell
    if restarted:
        return None, (f"memory allocator: started again with LD_PRELOAD={restarted}, which the loader did not "
                      "load (its message above says why)")
    if setting == "tcmalloc":
        if not library:
            raise PipelineError(f"params.yaml: machine.allocator tcmalloc, but no tcmalloc library is installed "
                                f"here: apt-get install {PACKAGE}, or set it to auto or system")
        return library, f"memory allocator: starting again under tcmalloc ({library}), as machine.allocator says"
    if (device, isa) not in measured or not library:
        return None, ""
    speedup, cost = measured[(device, isa)]
    if not pays_off(speedup, cost, steps):  # the same sum as compiling's: the steps' time saved against the start's
        return None, ""
    return library, (f"memory allocator: starting again under tcmalloc ({library}): measured {speedup:.2f}x on a "
                     f"CPU with {isa}, so {steps} steps repay the start (about {cost} steps' time)")


def restart_environment(environ, library):
    """The environment of the stage started again: `library` preloaded ahead of what the user preloads, the
    restart marked (RESTARTED), and the tests' stage log left out (the stage ran once, not twice)."""
    env = relaunch_environment(environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [library, environ.get("LD_PRELOAD", "").strip()]))
    env[RESTARTED] = library
    return env


def restart_where_it_pays(setting, steps):
    """A training stage, before it loads a model: on a CPU under glibc's malloc where choose_restart says so,
    replaces this process by the same stage under tcmalloc (does not return); prints what it has to say."""
    if "LOCAL_RANK" in os.environ:  # a process of a torchrun, which started it under what the stage chose
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    library, line = choose_restart(setting, device, cpu_isa() if device == "cpu" else None, running(),
                                   tcmalloc_library(), steps, os.environ.get(RESTARTED))
    if line:
        print(line, flush=True)
    if library:
        try:
            become([sys.executable, "-m", running_module(), *sys.argv[1:]], restart_environment(os.environ, library))
        except OSError as error:  # the interpreter could not be started again: this process trains instead
            print(f"memory allocator: glibc's malloc: could not start {sys.executable} again ({error.strerror})")
