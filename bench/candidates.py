"""Each candidate change to the CPU training step against the train stage's defaults of today, side by
side in one run (defaults, candidate, candidate, defaults: each the same first batches), as a ratio of
real tokens/s. The embedded MiniLM on the embedded tweets at the train stage's settings.

    python -m bench.candidates --threads 1 --steps 16            # all candidates
    python -m bench.candidates --only fp32_attention compile      # some
    python -m bench.candidates --gpu --only compile cuda_graphs --model bert-base   # on one GPU

The defaults side trains as the train stage does on this machine (bench.training.as_the_stage): on a CPU
in bf16 its attention in fp32 (modeling/precision.py). Candidates (each alone, the defaults otherwise):
- fp32: train.mixed_precision false (below 1x by what mixed precision gains here);
- fp32_attention: the attention in fp32 inside mixed precision, wherever the stage would not put it (on a
  CPU in bf16 the defaults themselves: two runs of the defaults);
- bf16_attention: SDPA's kernel in the training precision, wherever the stage would put it in fp32;
- eager_attention: transformers' eager attention (matmuls and softmax in the autocast precision) instead
  of SDPA's CPU kernel;
- compile: train.compile true (torch.compile, Inductor), untimed warm-up steps include the compiling;
- compile_fp32_attention: compiled, the attention in fp32 (on a CPU in bf16 the same as compile);
- compiled_autograd: compiled, and each backward pass traced as it runs into one graph that Inductor
  compiles too (torch's compiled autograd), instead of the autograd engine walking the backward node by
  node (the compiled forward's backward, the loss's and any graph break's nodes);
- fp32_bf16_matmuls: fp32 training (no autocast) whose matmuls oneDNN computes in bf16 inside
  (torch.backends.mkldnn.matmul.fp32_precision "bf16", torch 2.9 on): the weights and every elementwise
  operation stay fp32, nothing is cast between the operations, the matmuls still use AMX; with
  transformers' eager attention, since SDPA's CPU kernel takes that setting for its own products and
  runs at its slow bf16 speed (with SDPA the candidate measured 0.28x-0.30x the defaults);
- foreach_adamw: train.fused_adamw false (transformers' adamw_torch) against the fused kernel;
- micro_batch_16: batches of 16, accumulated twice (the same effective batch of 32);
- effective_64: batches of 64 (a larger effective batch: changes the result, for its speed only);
- cuda_graphs: GPU only: torch.compile's "reduce-overhead" mode, which replays each batch shape's kernels
  as one CUDA graph instead of launching them one by one;
- no_cudnn_attention: GPU only: SDPA without cuDNN's kernel (FlashAttention's or the memory-efficient one
  instead), which torch 2.11 picked for bf16 on an H200. cuDNN builds a plan for each new shape (55-70 ms
  each in flashinfer#5245's measurements), and its host time per call was measured at about twice
  FlashAttention's (pytorch#191576): a default MiniLM step on the H200 is bound by its launches.
With --gpu the same on one GPU (in bf16 there, as the train stage trains), at train.effective_batch_size
unless --effective-batch-size says otherwise; --model bert-base trains a randomly initialised
bert-base-sized model instead of MiniLM. The defaults train once before the first candidate, outside
the ratios: the first run in a process is the slower, and the side that ran it would look slower too.
On the H200 on 2026-12-04 compile read 2.09x against defaults 1.8x slower than the same defaults later
(each batch shape's first step, most likely cuDNN's attention plans); on the AMX CPU a first run was
5-10% slower than the next ones. A candidate that fails prints its error in a line and the others run.
"""
import argparse
import contextlib
import functools
import tempfile
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import dataset, free_gpu, load_average, model_options, recipe, stage_inputs
from bench.training import side_by_side, train_as_the_stage
from modeling.precision import describe

# name: (train.* changes, fp32 attention (None: the train stage's choice here), attn_implementation,
# TrainingArguments changes)
CANDIDATES = {
    "fp32": ({"mixed_precision": False}, None, None, {}),
    "fp32_attention": ({}, True, None, {}),
    "bf16_attention": ({}, False, None, {}),
    "eager_attention": ({}, False, "eager", {}),
    "compile": ({"compile": True}, None, None, {}),
    "compile_fp32_attention": ({"compile": True}, True, None, {}),
    "compiled_autograd": ({"compile": True}, None, None, {}),
    "cuda_graphs": ({"compile": True}, None, None, {"torch_compile_mode": "reduce-overhead"}),
    # Inductor's autotuning of each matmul among ATen's and its own C++ GEMM templates (AMX micro-kernels on a CPU);
    # torch 2.13 offers those templates only for constant (frozen) weights, so in training it keeps ATen's (bench/README.md)
    "max_autotune": ({"compile": True}, None, None, {"torch_compile_mode": "max-autotune-no-cudagraphs"}),
    # eager attention: SDPA's CPU kernel computes its own products in bf16 under that setting too, at its slow bf16 speed
    "fp32_bf16_matmuls": ({"mixed_precision": False}, False, "eager", {}),
    "foreach_adamw": ({"fused_adamw": False}, None, None, {}),
    "micro_batch_16": ({"batch_size": 16}, None, None, {}),
    "effective_64": ({"batch_size": 64, "effective_batch_size": 64}, None, None, {}),
    "no_cudnn_attention": ({}, None, None, {}),
}
GPU_ONLY = {"cuda_graphs", "no_cudnn_attention"}

# every SDPA kernel except cuDNN's, for no_cudnn_attention (torch's sdpa_kernel puts the previous choice back after)
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def bf16_matmul_math():
    """oneDNN's fp32 matmuls computed in bf16 inside the block (fp32_bf16_matmuls), torch's setting back after."""
    matmul = torch.backends.mkldnn.matmul
    before, matmul.fp32_precision = matmul.fp32_precision, "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


@contextlib.contextmanager
def compiled_autograd():
    """Every backward pass inside the block traced at run time as one graph and compiled by Inductor
    (compiled_autograd), the autograd engine's node-by-node walk replaced by it. torch's own switch
    (torch._dynamo.config.compiled_autograd) covers a backward called inside a compiled function only,
    and Trainer calls it outside the compiled model, so the block enters what that switch would."""
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="inductor", dynamic=True)):
        yield


# the torch settings a candidate's side trains under (a context manager each), where train's arguments cannot say it
SETTINGS = {"no_cudnn_attention": functools.partial(sdpa_kernel, WITHOUT_CUDNN), "fp32_bf16_matmuls": bf16_matmul_math,
            "compiled_autograd": compiled_autograd}


def train(params, tokenizer, sequences, data, folder, steps, device, make_model, fp32_attention=None,
          implementation=None, arguments=None):
    """Throughput of `steps` steps of a model trained as the train stage trains it with the train section
    `params` (bench.training.train_as_the_stage); the attention in fp32 where fp32_attention is true, as the
    stage puts it where it is None; implementation: the model's attention instead of its own."""
    model = make_model(**recipe(params))
    if implementation:
        model.set_attn_implementation(implementation)
    return train_as_the_stage(model, params, tokenizer, sequences, data, folder, device, steps, 1, fp32_attention,
                              **(arguments or {}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="timed optimizer steps per side")
    parser.add_argument("--only", nargs="+", choices=sorted(CANDIDATES), help="these candidates only")
    model_options(parser)
    opts = parser.parse_args()
    inputs = stage_inputs(opts)
    params, tokenizer, sequences, device, make_model = (inputs.params, inputs.tokenizer, inputs.sequences,
                                                        inputs.device, inputs.make_model)
    where = torch.cuda.get_device_name() if opts.gpu else f"cpu, {torch.get_num_threads()} torch threads"
    print(f"candidates with {opts.model} on {where}, load average {load_average()}; torch {torch.__version__}; the "
          f"defaults train in {describe(params['mixed_precision'], device)}, effective batch "
          f"{params['effective_batch_size']}", flush=True)
    names = opts.only or [n for n in CANDIDATES if opts.gpu or n not in GPU_ONLY]
    with tempfile.TemporaryDirectory() as folder:
        data = dataset(folder, "train", sequences, inputs.labels)
        start = time.perf_counter()
        first = train(params, tokenizer, sequences, data, folder, opts.steps, device, make_model)
        print(f"the defaults' first run in this process, not in the ratios: {first.summary()['tokens_per_s']:.0f} "
              f"real tokens/s ({time.perf_counter() - start:.0f} s)", flush=True)
        for name in names:
            changes, fp32_attention, implementation, arguments = CANDIDATES[name]
            if name in GPU_ONLY and not opts.gpu:
                print(f"{name}: GPU only (--gpu)")
                continue
            start = time.perf_counter()

            def run(candidate, n):
                if not candidate:
                    return train(params, tokenizer, sequences, data, folder, n, device, make_model)
                if changes.get("compile") is True:
                    # each compiled side compiles afresh, as a stage's process does: past torch._dynamo's
                    # recompile_limit (8 compilings of the forward's code in a process) later sides would run it eager
                    torch._dynamo.reset()
                with SETTINGS.get(name, contextlib.nullcontext)():
                    return train({**params, **changes}, tokenizer, sequences, data, folder, n, device, make_model,
                                 fp32_attention, implementation, arguments)

            try:
                default, changed = side_by_side(run, opts.steps)
            except Exception as error:  # a measurement that fails says why in a line; the others still run
                print(f"{name}: failed after {time.perf_counter() - start:.0f} s: {type(error).__name__}: "
                      f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}", flush=True)
                free_gpu()
                continue
            ratio = changed["tokens_per_s"] / default["tokens_per_s"]
            print(f"{name}: {changed['tokens_per_s']:.0f} vs {default['tokens_per_s']:.0f} real tokens/s, "
                  f"{opts.steps} steps each: {ratio:.2f}x ({time.perf_counter() - start:.0f} s, load average "
                  f"{load_average()})", flush=True)


if __name__ == "__main__":
    main()
