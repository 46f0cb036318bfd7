"""What a run reports about its speed: examples and real tokens per second and the share of padding
(Throughput, counted by the Trainer), peak memory, values combined across processes, and the memory
allocator it ran under."""
import ctypes.util
import resource
import sys
import time

import torch
from transformers import TrainerCallback

TCMALLOC_PACKAGE = "libtcmalloc-minimal4"  # Debian's and Ubuntu's (libtcmalloc-minimal4t64 from Ubuntu 24.04 on)


class Throughput(TrainerCallback):
    """Examples, real (non-pad) and padded tokens of the training micro-batches, and the time
    spent in training epochs (evaluation excluded)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.samples = self.padded_tokens = 0
        self.real_tokens = 0  # becomes a tensor on the training device: summing there needs no sync
        self.seconds = 0.0
        self.start = None

    def count(self, inputs):
        self.samples += len(inputs["labels"])
        self.padded_tokens += inputs["input_ids"].numel()
        self.real_tokens = self.real_tokens + inputs["attention_mask"].sum()

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_epoch_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # queued GPU work belongs to this epoch's time
        self.seconds += time.perf_counter() - self.start

    def summary(self):
        """Rates over all processes of a multi-process run: their examples and tokens summed, over
        the time of the slowest (the processes wait for each other at every optimizer step)."""
        samples, padded, real = across_processes([self.samples, self.padded_tokens, int(self.real_tokens)], "sum")
        (seconds,) = across_processes([max(self.seconds, 1e-9)], "max")
        return {"samples_per_s": round(samples / seconds, 1), "tokens_per_s": round(real / seconds, 1),
                "padding_fraction": round(1 - real / max(padded, 1), 4)}


def across_processes(values, op):
    """values reduced over the processes of a multi-process run ("sum", "max" or "min"); as they are in a
    single process. Every process must call it, as with any collective operation."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"  # nccl reduces GPU tensors only
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
           "min": torch.distributed.ReduceOp.MIN}
    torch.distributed.all_reduce(tensor, op=ops[op])
    return [v.item() for v in tensor]


def peak_memory():
    """Peak memory of this process: CPU resident set, and GPU memory allocated when there is a GPU.
    In a multi-process run, the largest over the processes."""
    # ru_maxrss is in KiB on Linux
    peak = {"peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    if torch.cuda.is_available():
        allocated = torch.cuda.max_memory_allocated()
        peak["peak_gpu_gb"] = round(allocated / 2**30, 3)
        peak["peak_gpu_fraction"] = round(allocated / torch.cuda.get_device_properties(
            torch.cuda.current_device()).total_memory, 4)
    return dict(zip(peak, across_processes(list(peak.values()), "max")))


def speed_line(speed):
    """The speed metrics in words, for the log."""
    memory = (f"peak GPU memory {speed['peak_gpu_gb']:.2f} GB ({speed['peak_gpu_fraction']:.0%})"
              if "peak_gpu_gb" in speed else f"peak memory {speed['peak_rss_gb']:.2f} GB")
    return (f"speed: {speed['tokens_per_s']:,.0f} real tokens/s, {speed['samples_per_s']:,.1f} examples/s, "
            f"padding {speed['padding_fraction']:.1%}, {memory}")


def allocator_in(maps):
    """The allocator whose library the text of a /proc/<pid>/maps file shows mapped: "tcmalloc", "jemalloc",
    else "glibc"."""
    for line in maps.splitlines():
        name = line.rsplit("/", 1)[-1] if "/" in line else ""
        for allocator in ("tcmalloc", "jemalloc"):
            if name.startswith(f"lib{allocator}"):
                return allocator
    return "glibc"


def running_allocator():
    """This process's memory allocator (allocator_in), None where it cannot be told (no /proc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            return allocator_in(maps.read())
    except OSError:
        return None


def allocator_note(device, allocator, library):
    """A line for the log where a CPU run uses glibc's malloc ("" elsewhere): a process gets its allocator
    when it starts, and a CPU training step allocates and frees hundreds of tensors, which tcmalloc does
    faster (the default run trained 1.1x faster under it on a Xeon with AMX, the same predictions byte for
    byte). library: the tcmalloc installed here (tcmalloc_library()), or None."""
    if device != "cpu" or allocator != "glibc":
        return ""
    how = (f"LD_PRELOAD={library} dvc repro" if library else
           f"apt-get install {TCMALLOC_PACKAGE}, then LD_PRELOAD=libtcmalloc_minimal.so.4 dvc repro")
    return ("memory allocator: glibc's malloc; under tcmalloc a CPU trains about 1.1x faster, with the same "
            f"results: {how}")


def tcmalloc_library():
    """The name of the tcmalloc library installed here, for LD_PRELOAD, None where there is none."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
