"""Where a default training step's time goes: torch.profiler over a few optimizer steps of the embedded
MiniLM at the train stage's settings (length-grouped batches of the embedded tweets, train.dropout,
train.freeze_embeddings, the fused AdamW), in fp32 and in the mixed precision the stage trains in here (bf16
on a GPU of compute capability 8.0 on and on a CPU with bf16 instructions), each operation's own time sorted
into a few kinds of work; on a CPU in bf16, also with the attention in fp32, as the train stage trains there
(modeling/precision.py).

    python -m bench.profile_step                 # each column 10 profiled steps after 20 untimed (150 on a GPU)
    python -m bench.profile_step --steps 20 --threads 1 --compile   # compiled (train.compile) as a third column
    python -m bench.profile_step --gpu --model bert-base            # one GPU: kernel time, and GPU idle time
    python -m bench.profile_step --casts         # the casts' row split: weights and their gradients, the rest

Prints a table: milliseconds per optimizer step and share of the step for matrix products, attention,
LayerNorm, GELU, softmax, dropout, dtype casts (autocast's, forward and backward), the embeddings,
other elementwise operations and reductions, the optimizer (AdamW, gradient clipping, zero_grad), the
autograd engine's own time, and the rest of the wall time: Python (Trainer, the model's modules,
collating batches) and the dispatch of every operation before its kernel starts. The profiler adds a
few microseconds to each operation, counted in that last row; the "wall" row is the step time with
the profiler on, "unprofiled" the same steps timed without it.

With --gpu each row is the GPU time of the kernels that row's operations launched (fp32 and bf16
columns, at train.effective_batch_size unless --effective-batch-size says otherwise), the casts' row
includes moving each batch to the GPU, and the last row is the time the GPU ran no kernel: where it
is most of the step, the step is bound by Python and the launching of kernels, not by the GPU's
arithmetic (what CUDA graphs and torch.compile remove). --model bert-base profiles a randomly
initialised bert-base-sized model (12 layers, hidden 768) instead of the embedded MiniLM.

--casts records each operation's input shapes and splits the casts' row by what is cast: a tensor shaped
as one of the model's weights (autocast's cast of each weight for the forward pass, and its gradient cast
back to fp32: what keeping the weights in bf16 with fp32 master copies would change), or anything else
(activations and their gradients, as the fp32 attention's q, k, v cast up and its output cast down).
"""
import argparse
import tempfile
import time

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from bench.common import dataset, free_gpu, load_average, minilm_model, model_options, recipe, stage_inputs, sync
from bench.training import COMPILE_WARMUP, as_the_stage
from modeling.models import make_collator
from modeling.precision import attention_in_fp32, autocast_dtype, cpu_isa, in_fp32
from training.speed import Throughput
from training.trainer import CountingTrainer

CASTS = "dtype casts (autocast)"
# (row, operations whose own time is that row's), in the table's order; the first match wins
KINDS = [
    ("matrix products (mm, addmm, bmm)", {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                                          "aten::_addmm_activation", "aten::matmul", "aten::linear"}),
    ("attention (SDPA kernels)", {"aten::_scaled_dot_product_flash_attention_for_cpu",
                                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                                  "aten::_scaled_dot_product_attention_math",
                                  "aten::scaled_dot_product_attention",
                                  # a GPU's kernels: flash, memory-efficient, cuDNN
                                  "aten::_scaled_dot_product_flash_attention",
                                  "aten::_scaled_dot_product_flash_attention_backward",
                                  "aten::_flash_attention_forward", "aten::_flash_attention_backward",
                                  "aten::_scaled_dot_product_efficient_attention",
                                  "aten::_scaled_dot_product_efficient_attention_backward",
                                  "aten::_efficient_attention_forward", "aten::_efficient_attention_backward",
                                  "aten::_scaled_dot_product_cudnn_attention",
                                  "aten::_scaled_dot_product_cudnn_attention_backward",
                                  "aten::_cudnn_attention_forward", "aten::_cudnn_attention_backward"}),
    ("LayerNorm", {"aten::native_layer_norm", "aten::native_layer_norm_backward", "aten::layer_norm"}),
    ("GELU", {"aten::gelu", "aten::gelu_backward"}),
    ("softmax", {"aten::_softmax", "aten::_softmax_backward_data", "aten::softmax"}),
    ("dropout (masks, scaling)", {"aten::bernoulli_", "aten::native_dropout", "aten::native_dropout_backward",
                                  "aten::dropout"}),
    (CASTS, {"aten::to", "aten::_to_copy", "aten::copy_"}),
    ("embeddings", {"aten::embedding", "aten::embedding_backward", "aten::embedding_dense_backward"}),
]
CAST_OPS = {"aten::to", "aten::_to_copy"}  # what they allocate and copy into is the cast's time too
WEIGHTS, OTHERS = "tensors shaped as a weight", "other tensors"  # --casts
OPTIMIZER = "optimizer (AdamW, clipping, zero_grad)"
ELEMENTWISE = "other elementwise and reductions"
AUTOGRAD = "autograd engine"
REST = "Python, Trainer, dispatch (wall - ops)"
GPU_IDLE = "GPU idle: no kernel running (wall - kernels)"  # REST's row on a GPU
ROWS = [name for name, _ in KINDS] + [ELEMENTWISE, OPTIMIZER, AUTOGRAD, REST]


def kind_of(event):
    """The table row of one profiled event's own time, from its name and those of its callers."""
    chain, parent = [], event.cpu_parent
    while parent is not None:
        chain.append(parent.name)
        parent = parent.cpu_parent
    if any(n.startswith(("Optimizer.step", "Optimizer.zero_grad")) for n in [event.name, *chain]) or \
            event.name.startswith("aten::_foreach") or any(n.startswith("aten::_foreach") for n in chain):
        return OPTIMIZER  # clip_grad_norm_ is foreach norms and multiplies
    if any(n in CAST_OPS for n in chain):
        return CASTS
    for name, ops in KINDS:
        if event.name in ops:
            return name
    if event.name.startswith("autograd::engine") or event.name.endswith("Backward0") or \
            event.name.endswith("Backward1"):
        return AUTOGRAD
    return ELEMENTWISE


def own_ms(event, gpu):
    """One CPU-side operation's own time in ms: its CPU time; on a GPU, that of the kernels it launched itself."""
    return (event.self_device_time_total if gpu else event.self_cpu_time_total) / 1e3  # microseconds -> ms


def operations(events):
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]


def top_operations(events, steps, n, gpu=False):
    """Lines naming the n operations of most own time per step, with the row each counts in."""
    own = {}
    for event in operations(events):
        key = (event.name, kind_of(event))
        own[key] = own.get(key, 0.0) + own_ms(event, gpu) / steps
    return [f"  {ms:8.1f} ms  {name}  [{kind}]" for (name, kind), ms in sorted(own.items(), key=lambda x: -x[1])[:n]]


def breakdown(events, wall_s, steps, gpu=False):
    """{row: milliseconds per optimizer step} from the profiler's events over `steps` steps of wall_s. On a
    GPU the rows are kernel time and REST the time no kernel ran (kernels run one at a time, on one stream)."""
    totals = dict.fromkeys(ROWS, 0.0)
    for event in operations(events):
        totals[kind_of(event)] += own_ms(event, gpu)
    totals[REST] = max(0.0, wall_s * 1e3 - sum(totals.values()))
    return {row: ms / steps for row, ms in totals.items()}


def cast_shape(event):
    """The shape of the tensor a cast casts: the first input of the nearest cast operation, the event or
    one of its callers, that records one (aten::empty_strided, which allocates the result, records none)."""
    while event is not None:
        shapes = getattr(event, "input_shapes", None)
        if (event.name in CAST_OPS or event.name == "aten::copy_") and shapes and shapes[0]:
            return tuple(shapes[0])
        event = event.cpu_parent
    return None


def cast_split(events, steps, weight_shapes, gpu=False):
    """{WEIGHTS: ms, OTHERS: ms} per step: the casts' row by the shape of what each cast casts, a weight's
    (the weight cast for the forward pass, or its gradient cast back) or another. An activation that has a
    weight's shape (a batch of 1,536 tokens x 384 against a 1,536 x 384 weight) counts as a weight: the
    profiler records shapes, not which tensor it was."""
    split = {WEIGHTS: 0.0, OTHERS: 0.0}
    for event in operations(events):
        if kind_of(event) == CASTS:
            split[WEIGHTS if cast_shape(event) in weight_shapes else OTHERS] += own_ms(event, gpu) / steps
    return split


def launches(events, steps):
    """(CPU ms per step of the operations themselves, GPU kernels and copies launched per step)."""
    ops = operations(events)
    return (sum(e.self_cpu_time_total for e in ops) / 1e3 / steps,
            sum(len(e.kernels) for e in ops) / steps)


class ProfileSteps(TrainerCallback):
    """Profiles optimizer steps warmup+1 .. warmup+steps; times the same number of steps unprofiled
    before them (after the warm-up), so both clocks see the same kind of batches. On a GPU the clock
    waits for the GPU's queued kernels at each end, and the profiler records the kernels too."""

    def __init__(self, warmup, steps, gpu=False, shapes=False):
        self.warmup, self.steps, self.shapes = warmup, steps, shapes
        kinds = torch.profiler.ProfilerActivity
        self.activities = [kinds.CPU] + ([kinds.CUDA] if gpu else [])
        self.profiler = self.start = None
        self.unprofiled_s = self.wall_s = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            sync()
            self.start = time.perf_counter()
        elif state.global_step == self.warmup + self.steps:
            sync()
            self.unprofiled_s = time.perf_counter() - self.start
            self.profiler = torch.profiler.profile(activities=self.activities, record_shapes=self.shapes)
            self.profiler.__enter__()
            self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.warmup + 2 * self.steps:
            sync()
            self.wall_s = time.perf_counter() - self.start
            self.profiler.__exit__(None, None, None)
            control.should_training_stop = True


def profile(params, sequences, labels, tokenizer, folder, warmup, steps, top=0, fp32_attention=None, device="cpu",
            make_model=minilm_model, casts=False):
    """(ms per step by row, unprofiled ms per step, batch, top operations, (CPU ms of the operations per step,
    kernels per step), the casts' row split (cast_split; None unless casts)) of a model trained as the train
    stage trains it with the train section `params` (bench.training.as_the_stage); the attention in fp32
    where fp32_attention is true, as the stage puts it where it is None."""
    gpu = device == "cuda"
    model = make_model(**recipe(params))
    stage = as_the_stage(model, params, sequences, folder, device, fp32_attention, max_steps=warmup + 2 * steps + 1)
    callback = ProfileSteps(warmup, steps, gpu, shapes=casts)
    trainer = CountingTrainer(model=model, args=stage.args, train_dataset=dataset(folder, "train", sequences, labels),
                              data_collator=make_collator(tokenizer, device), throughput=Throughput(),
                              callbacks=[*stage.callbacks, callback])
    trainer.remove_callback(PrinterCallback)
    with in_fp32(model, stage.fp32_attention):
        trainer.train()
    events = callback.profiler.events()
    result = (breakdown(events, callback.wall_s, steps, gpu), callback.unprofiled_s * 1e3 / steps,
              (stage.batch, stage.accumulation), top_operations(events, steps, top, gpu), launches(events, steps),
              cast_split(events, steps, {tuple(w.shape) for w in model.parameters()}, gpu) if casts else None)
    del trainer, model
    free_gpu()
    return result


def table(columns, gpu=False):
    """Markdown table: a row per kind of work, per column its ms per step and share of the step."""
    names = list(columns)
    lines = ["| work | " + " | ".join(f"{n} ms/step | {n} share" for n in names) + " |",
             "|---|" + "---:|---:|" * len(names)]
    for row in ROWS:
        cells = []
        for n in names:
            ms, total = columns[n][0][row], sum(columns[n][0].values())
            cells += [f"{ms:.1f}", f"{ms / total:.0%}"]
        label = GPU_IDLE if gpu and row == REST else row
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| wall, profiled | " + " | ".join(f"{sum(columns[n][0].values()):.1f} | 100%" for n in names) + " |")
    lines.append("| wall, unprofiled | " + " | ".join(f"{columns[n][1]:.1f} | " for n in names) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="profiled optimizer steps (and as many timed unprofiled)")
    parser.add_argument("--warmup", type=int,
                        help="untimed steps first (default 20, on a GPU 150): on a CPU each new batch length's first "
                             "bf16 step sets up oneDNN's kernels (with 2, bf16 looked 1.2x fp32 where 20 showed 1.7x); "
                             "on an H200 with 5, bf16 read 78 ms per step where the train stage's later steps take "
                             "about 24 (most likely cuDNN's attention building a plan for each new batch shape)")
    parser.add_argument("--top", type=int, default=0, help="also list each run's N operations of most own time")
    parser.add_argument("--compile", action="store_true",
                        help="add a column: the mixed precision compiled (train.compile), as the stage trains it")
    parser.add_argument("--casts", action="store_true",
                        help="split the casts' row: tensors shaped as a weight (weights, their gradients), others")
    model_options(parser)
    opts = parser.parse_args()
    inputs = stage_inputs(opts)
    params, device = inputs.params, inputs.device
    if opts.warmup is None:
        opts.warmup = 150 if opts.gpu else 20
    where = (f"{torch.cuda.get_device_name()} (train.tf32 {params['tf32']})" if opts.gpu else
             f"cpu ({cpu_isa()}), {torch.get_num_threads()} torch threads")
    print(f"profile of {opts.model} on {where}, load average {load_average()}; torch {torch.__version__}; "
          f"max_length {inputs.max_length}, effective batch {params['effective_batch_size']}")
    mixed = autocast_dtype(True, device)  # None: a CPU without bf16 instructions, which trains fp32
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(mixed, "fp32")
    # (column, train.* changes, attention in fp32: None as the stage puts it); the mixed precision's own
    # attention, and on a CPU in bf16 the attention in fp32 as the stage trains there
    runs = [("fp32", {"mixed_precision": False}, None)]
    runs += [(name, {"mixed_precision": True}, False)] if mixed else []
    if attention_in_fp32(device, mixed, "sdpa"):
        runs.append((f"{name} fp32-attention", {"mixed_precision": True}, True))
    runs += [(f"{name} compiled", {"mixed_precision": True, "compile": True}, None)] if opts.compile else []
    columns = {}
    with tempfile.TemporaryDirectory() as folder:
        for column, changes, fp32_attention in runs:
            warmup = max(opts.warmup, COMPILE_WARMUP) if changes.get("compile") else opts.warmup
            by_row, unprofiled, batch, top, (cpu_ms, kernels), split = profile(
                {**params, **changes}, inputs.sequences, inputs.labels, inputs.tokenizer, folder, warmup, opts.steps,
                opts.top, fp32_attention, device, inputs.make_model, opts.casts)
            columns[column] = (by_row, unprofiled)
            launched = (f"; the operations' own CPU time {cpu_ms:.1f} ms, {kernels:.0f} kernels per step"
                        if opts.gpu else "")
            casts = (f"; casts {split[WEIGHTS]:.1f} ms per step of {WEIGHTS} (weights, their gradients), "
                     f"{split[OTHERS]:.1f} of {OTHERS}" if split else "")
            print(f"{column}: batch {batch[0]} x {batch[1]}, {unprofiled:.1f} ms per step unprofiled{launched}{casts}",
                  *top, sep="\n", flush=True)
    print(table(columns, opts.gpu))
    print(f"load average at the end: {load_average()}")


if __name__ == "__main__":
    main()
