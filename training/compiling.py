"""train.compile: whether to hand the model to torch.compile, chosen from what was measured on hardware of
this kind (true and false force it).

Compiling pays for itself when the steps it speeds up save more time than the compiling costs. Both
were measured side by side by `python -m bench.benchmark --compile` (row 7) and `python -m bench.candidates`
on the embedded MiniLM, per kind of hardware and training precision: MEASURED holds the compiled/eager
throughput and the compiling's cost counted in eager steps (its seconds / an eager step's seconds, from
the same run, so that the cost scales with the machine's speed and load). Hardware not in the table has
not been measured: auto leaves it eager and says how to measure it. A result that differs between the
two choices (fused kernels round differently) is still a setting of the result: the choice is made from
the hardware, as train.mixed_precision's is, and the log and the saved run (pipeline.json) say which.
"""
import math
import os
import shutil

import torch
from transformers import TrainerCallback

# (device, ISA, precision) -> (compiled / eager real tokens/s, compiling's cost in eager steps), measured
# on the embedded MiniLM at the train stage's defaults (docs/speed.md, Compiling)
MEASURED = {
    ("cpu", "AVX512-BF16", "float32"): (1.0, 150),  # 0.85x-1.12x in six runs on a 2-core EPYC: no gain
    # 1.00x and 0.97x in two runs on a quiet 2-core EPYC (Zen 4), its attention in fp32 as the stage trains
    # there; the compiling took 72 s, about 320 eager steps: no gain
    ("cpu", "AVX512-BF16", "bfloat16"): (1.0, 320),
    # 1.05x, 1.16x and 1.09x in three runs on a quiet 2-core Xeon with AMX (row 7 of the benchmark, then
    # bench.candidates at 24 and 50 steps), the attention in fp32 as the stage trains there; the first
    # compiling, Inductor's cache empty, took 49 s, about 440 eager steps: it pays from about 4,900 steps on
    ("cpu", "AMX", "bfloat16"): (1.10, 440),
    # 1.13x side by side against warm eager steps (bench.candidates --gpu, 2026-12-05; a bert-base-sized model at
    # an effective batch of 256 gained 1.22x); its two compilings took 30 s more than a row without, 9 s for one
    # with Inductor's cache filled (row 7), so about 21 s for the first, about 1,900 eager steps of 11 ms: it pays
    # from about 16,500 steps on
    ("cuda", "NVIDIA H100 80GB HBM3", "bfloat16"): (1.13, 1900),
}


def run_steps(examples, examples_per_step, epochs):
    """Optimizer steps of a run: Trainer's count for `epochs` passes over `examples` (a fraction stops mid-epoch)."""
    return math.ceil(math.ceil(examples / examples_per_step) * epochs)


def pays_off(speedup, cost_steps, steps):
    """Whether compiling saves more eager-step time over `steps` steps than it costs: a step compiled takes
    1 / speedup of an eager one, so it saves (1 - 1/speedup) of a step, each, against cost_steps."""
    return speedup > 1 and steps * (1 - 1 / speedup) > cost_steps


def cpp_compiler():
    """The C++ compiler torch.compile would build its CPU kernels with, where Inductor looks for one
    (torch._inductor.config.cpp.cxx: $CXX, else g++), None where there is none. Not Inductor's own search,
    which imports Inductor: 1.8 s on every CPU run."""
    return shutil.which(os.environ.get("CXX") or "g++")


def choose(setting, device, isa, precision, steps, measured=None, compiler=True):
    """(compile or not, the log line saying why) for train.compile `setting` (True, False or "auto") on
    `device` with instruction set `isa` ("AMX", "AVX512-BF16", ...; a GPU: its name) training in
    `precision` ("bfloat16", "float32", "float16") for `steps` optimizer steps; measured: MEASURED;
    compiler: whether a CPU's kernels can be built here (cpp_compiler), else auto stays eager."""
    if isinstance(setting, bool):
        return setting, ("train.compile: torch.compile; the first batch is slow while the model is compiled, "
                         "one graph for every batch shape") if setting else ""
    facts = (measured if measured is not None else MEASURED).get((device, isa, precision))
    where = f"{device} ({isa}), {precision}"
    if facts is None:
        return False, (f"train.compile auto: eager, torch.compile was not measured on {where} "
                       "(python -m bench.benchmark --compile measures it; train.compile: true uses it)")
    speedup, cost = facts
    if not pays_off(speedup, cost, steps):
        return False, (f"train.compile auto: eager, torch.compile measured {speedup:.2f}x eager on {where}; "
                       f"{steps} steps would not repay the compiling (about {cost} steps' time)")
    if not compiler:
        return False, (f"train.compile auto: eager: torch.compile (measured {speedup:.2f}x eager on {where}) would "
                       f"repay its compiling in {steps} steps, but on a CPU it builds its kernels with a C++ "
                       "compiler, and none works here (apt-get install g++, or set CXX)")
    return True, (f"train.compile auto: torch.compile, measured {speedup:.2f}x eager on {where}, so "
                  f"{steps} steps repay the compiling (about {cost} steps' time)")


class EveryShapeAtOnce(TrainerCallback):
    """While training, torch.compile traces a batch's size and length as variables from the first batch on
    (torch.compile(dynamic=True), which Trainer does not pass), so that one graph serves every batch. By
    default it would compile the first batch's exact shape, then compile again for the second length
    (each length-grouped batch has its own), and again for the epoch's last, short batch: three compilings
    of the whole model, 25-35 s each on a CPU for the tests' tiny model, 13-45 s on a GPU for MiniLM."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.patch = torch._dynamo.config.patch(assume_static_by_default=False)
        self.patch.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        self.patch.__exit__(None, None, None)
