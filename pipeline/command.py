"""How a stage or tool runs as a command: run_main turns a PipelineError into one line on stderr with
credentials masked (redact), and says what the stage wrote and how long it took; whether a person
watches (interactive)."""
import logging
import os
import re
import sys
import time
from pathlib import Path

from pipeline.outputs import size_of
from pipeline.settings import PipelineError

# bitsandbytes (train.load_in_4bit), which transformers' Trainer imports wherever it is installed, warns at
# import on a CPU with AVX512-BF16 that it cannot download an optional hub kernel, in every stage that trains;
# it falls back to its own kernels. Every command imports this module before anything imports bitsandbytes.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

URL_USERINFO_RE = re.compile(r"(?<=://)[^/\s@]+@")


SECRET_QUERY_RE = re.compile(
    r"(?<=[?&])((?:access_)?token|key|api_?key|sig|signature|secret|password|auth|"
    r"x-amz-credential|x-amz-signature|x-amz-security-token)=[^&\s#:'\"]+", re.IGNORECASE)


def redact(text):
    """`text` with credentials in URLs masked: user:password@ and token-like query values."""
    text = URL_USERINFO_RE.sub("***@", text)
    return SECRET_QUERY_RE.sub(lambda m: f"{m[1]}=***", text)


def stage_name(argv):
    """The stage a command line runs, as dvc.yaml names it: `python -m stages.train --fold 2` is train@2,
    `python -m stages.distill --student small` distill@small."""
    name = Path(argv[0]).stem
    for option in ("--fold", "--student"):  # foreach stages: train@2, pseudo@2, distill@small
        if option in argv[1:-1]:
            name += "@" + argv[argv.index(option) + 1]
    return name


def interactive():
    """Whether a person watches this process in a terminal (both output streams are one). Progress
    bars redraw one line with carriage returns: in a log file (`dvc queue logs`, `dvc repro > log`,
    CI) each would become one endless line, so stages print plain lines there instead."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def seconds_since_start():
    """Wall time since this process started, imports included (Linux: from /proc), else since
    this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - IMPORTED


IMPORTED = time.perf_counter()


def run_main(main, tool=None):
    """Run a stage's main(); a PipelineError becomes one line on stderr and exit code 1. When main
    returns the paths it wrote, a last line says what they hold and how long the stage took. A tool
    that drives the pipeline from outside (tool: its name, e.g. "tune") is not a stage run."""
    name = tool or stage_name(sys.argv)
    log = os.environ.get("PIPELINE_STAGE_LOG")
    if log and not tool:  # tests set this to see which stage commands really executed
        with open(log, "a", encoding="utf-8") as f:
            f.write(name + "\n")
    try:
        written = main()
    except PipelineError as e:
        print(f"error: {redact(str(e))}", file=sys.stderr)
        sys.exit(1)
    except FileNotFoundError as e:  # an input of an earlier stage: this one was run on its own
        print(f"error: {e.filename} does not exist: run the stages before {name} first (`dvc repro {name}` "
              "runs them)", file=sys.stderr)
        sys.exit(1)
    if written:
        outputs = "; ".join(f"{path} ({size_of(path)})" for path in written)
        print(f"{name}: wrote {outputs} in {seconds_since_start():.1f} s", flush=True)
