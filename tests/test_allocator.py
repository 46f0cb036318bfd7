"""The memory allocator a CPU training process runs under (training/allocator.py): read off the libraries
mapped into the process, the log's line on glibc's malloc saying how to train under tcmalloc, and the train
stage starting again under tcmalloc (machine.allocator), which trains exactly as under glibc's malloc."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.settings import PipelineError
from tests.test_cv import logged_repro
from tests.test_pipeline import TINY_PARAMS, init_pipeline_repo, set_params
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


LIBRARY = "libtcmalloc_minimal.so.4"


@pytest.mark.parametrize("setting, device, isa, running, library, steps, restarted, starts, says", [
    # measured 2x with a start costing 300 steps: a step under it saves half a step, so 600 steps save
    # exactly the cost (not enough) and 601 half a step more
    ("auto", "cpu", "AMX", "glibc", LIBRARY, 601, None, True, "measured 2.00x on a CPU with AMX, so 601 steps repay"),
    ("auto", "cpu", "AMX", "glibc", LIBRARY, 600, None, False, ""),
    ("auto", "cpu", "AVX2", "glibc", LIBRARY, 10**6, None, False, ""),   # not measured on this kind of CPU
    ("auto", "cpu", "AMX", "glibc", None, 10**6, None, False, ""),       # not installed: the fold's note says how
    ("auto", "cuda", None, "glibc", LIBRARY, 10**6, None, False, ""),    # measured on a CPU only
    ("auto", "cpu", "AMX", "tcmalloc", LIBRARY, 10**6, None, False, ""),  # already under it
    ("auto", "cpu", "AMX", "jemalloc", LIBRARY, 10**6, None, False, ""),  # the user's own choice
    ("auto", "cpu", "AMX", None, LIBRARY, 10**6, None, False, ""),        # not Linux: cannot tell
    ("system", "cpu", "AMX", "glibc", LIBRARY, 10**6, None, False, ""),
    ("tcmalloc", "cpu", "AVX2", "glibc", LIBRARY, 1, None, True, "as machine.allocator says"),  # whatever was measured
    # started again, and the loader did not preload it: never a second time
    ("auto", "cpu", "AMX", "glibc", LIBRARY, 10**6, LIBRARY, False, f"LD_PRELOAD={LIBRARY}, which the loader did not"),
    ("tcmalloc", "cpu", "AMX", "glibc", LIBRARY, 10**6, LIBRARY, False, "which the loader did not load"),
])
def test_the_train_stage_starts_again_under_tcmalloc_where_measured_faster_and_the_run_repays_it(
        setting, device, isa, running, library, steps, restarted, starts, says):
    measured = {("cpu", "AMX"): (2.0, 300)}
    chosen, line = allocator.choose_restart(setting, device, isa, running, library, steps, restarted, measured)
    assert chosen == (library if starts else None)
    assert (says == "" and line == "") or (says in line), line


@pytest.mark.parametrize("isa, steps, starts", [
    # what docs/speed.md (the memory allocator) tells users of MEASURED's own row: with AMX the
    # default run (917 steps) starts again under tcmalloc, which pays from about 440 steps on; measured
    # on no other kind of CPU
    ("AMX", 917, True),
    ("AMX", 400, False),
    ("AMX", 480, True),
    ("AVX512-BF16", 10**6, False),
    ("AVX2", 10**6, False),
])
def test_the_measured_cpu_starts_again_where_the_docs_say(isa, steps, starts):
    chosen, _ = allocator.choose_restart("auto", "cpu", isa, "glibc", LIBRARY, steps)
    assert chosen == (LIBRARY if starts else None)


def test_a_forced_tcmalloc_that_is_not_installed_stops_with_how_to_install_it():
    with pytest.raises(PipelineError, match=r"^params.yaml: machine.allocator tcmalloc, but no tcmalloc library is "
                                            r"installed here: apt-get install libtcmalloc-minimal4, or set it to auto or system$"):
        allocator.choose_restart("tcmalloc", "cpu", "AMX", "glibc", None, 10**6)


def test_the_stage_starts_again_with_tcmalloc_ahead_of_the_users_preloads_and_runs_once():
    environ = {"HOME": "/root", "LD_PRELOAD": "libmine.so", "PIPELINE_STAGE_LOG": "/tmp/stages.log"}
    assert allocator.restart_environment(environ, LIBRARY) == {
        "HOME": "/root", "LD_PRELOAD": f"{LIBRARY} libmine.so", allocator.RESTARTED: LIBRARY}
    assert environ["LD_PRELOAD"] == "libmine.so" and "PIPELINE_STAGE_LOG" in environ  # the caller's own left as it was
    assert allocator.restart_environment({}, LIBRARY) == {"LD_PRELOAD": LIBRARY, allocator.RESTARTED: LIBRARY}


@pytest.fixture(scope="module")
def allocator_repo(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    """The tiny pipeline run once with machine.allocator tcmalloc: (the repo, the stages that ran, dvc's output)."""
    repo = init_pipeline_repo(tmp_path_factory.mktemp("allocator") / "repo", tiny_data_dir, tiny_model_dir,
                              **TINY_PARAMS, machine__allocator="tcmalloc")
    ran, log = logged_repro(repo)
    return repo, ran, log


def test_a_train_stage_started_again_under_tcmalloc_runs_once_and_trains_as_under_glibc(allocator_repo):
    """The real loader and the real stage: train@0 starts again under tcmalloc (its summary names the allocator
    the training ran under), dvc and the stage log see it run once, and trained again under glibc's malloc
    (machine.allocator system) it writes the same weights and out-of-fold predictions, byte for byte."""
    repo, ran, log = allocator_repo
    assert ran.count("train@0") == 1, ran
    assert log.count("memory allocator: starting again under tcmalloc") == 1, log
    assert "memory allocator: glibc's malloc" not in log  # the fold's note: it trained under tcmalloc
    summary = json.loads((repo / "reports/train/fold-0/metrics.json").read_text())
    assert summary["allocator"] == "tcmalloc"
    trained = {path: (repo / path).read_bytes() for path in ("models/fold-0/model.safetensors", "predictions/fold-0/oof.csv")}
    set_params(repo, machine__allocator="system")
    ran, log = logged_repro(repo, "--force", "--single-item", "train@0", log_name="system.log")
    assert ran == ["train@0"] and "starting again" not in log, log
    assert json.loads((repo / "reports/train/fold-0/metrics.json").read_text())["allocator"] == "glibc"
    assert {path: (repo / path).read_bytes() for path in trained} == trained
