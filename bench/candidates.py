"""Each candidate change to the CPU training step against the train stage's defaults of today, side by
side in one run (defaults, candidate, candidate, defaults: each the same first batches), as a ratio of
real tokens/s. The embedded MiniLM on the embedded tweets at the train stage's settings.

    python -m bench.candidates --threads 1 --steps 16            # all candidates
    python -m bench.candidates --only fp32_attention compile      # some
    python -m bench.candidates --gpu --only compile cuda_graphs unpadded --model bert-base   # on one GPU

The defaults side trains as the train stage does on this machine, its attention in fp32 where this CPU's
bf16 attention is the slower (modeling/attention.py). Candidates (each alone, the defaults otherwise):
- fp32: train.mixed_precision false (below 1x by what mixed precision gains here);
- fp32_attention: the attention in fp32 inside bf16 autocast, wherever the stage would put it;
- bf16_attention: SDPA's kernel in the training precision, wherever the stage would put it in fp32;
- eager_attention: transformers' eager attention (matmuls and softmax in the autocast precision) instead
  of SDPA's CPU kernel;
- compile: train.compile true (torch.compile, Inductor), untimed warm-up steps include the compiling;
- compile_fp32_attention: compiled, the attention in fp32;
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
- unpadded: train.unpadded true (padding-free batches; on a CPU the per-text attention path);
- full_last_layer: the last layer computes every token, not the first only (training/first_token.py):
  below 1x by what the defaults gain from it;
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
import os
import sys
import tempfile
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoTokenizer
from transformers import logging as hf_logging

from bench.common import (
    NO_CHECKPOINTS,
    QUIET,
    REPO,
    dataset,
    free_gpu,
    gpu_model,
    load_average,
    load_corpus,
    minilm_model,
    recipe,
    stage_max_length,
    tokenize_texts,
)
from bench.training import COMPILE_WARMUP, run_steps, side_by_side
from pipeline.settings import load_params
from modeling.models import make_collator
from stages.preprocess import PREPROCESS_PARAMS
from stages.tokenize import TOKENIZE_PARAMS
from training.settings import TRAIN_PARAMS
from training import attention, compiling, first_token, unpadded
from training.arguments import replace_arguments, training_arguments
from training.batch_size import pick_batch_size
from modeling.models import resolve_model
from modeling.precision import autocast_dtype, cpu_isa

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
    "unpadded": ({"unpadded": True}, None, None, {}),
    "full_last_layer": ({}, None, None, {}),
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


def train(params, tokenizer, sequences, data, folder, steps, warmup, fp32_attention=None, implementation=None,
          full_last_layer=False, device="cpu", make_model=minilm_model, arguments=None):
    """Throughput of `steps` steps of the train stage's settings `params` (no checkpoints); the attention
    in fp32 where fp32_attention is true, as the train stage chooses where it is None."""
    model = make_model(**recipe(params))
    if implementation:
        model.set_attn_implementation(implementation)
    packed = params["unpadded"] and unpadded.supports(model)
    if not full_last_layer:
        first_token.choose(model, first_token.check_batch(make_collator(tokenizer, device), sequences), packed)
    batch, accumulation, _ = pick_batch_size(model, sequences, params["batch_size"], params["effective_batch_size"],
                                             params["mixed_precision"], device)
    if fp32_attention is None:
        fp32_attention, _ = attention.choose(model, device, autocast_dtype(params["mixed_precision"], device), packed,
                                             sequences)
    args = replace_arguments(training_arguments(params, NO_CHECKPOINTS, folder, device, batch, accumulation),
                             **QUIET, save_strategy="no", **(arguments or {}))
    if fp32_attention:
        model.set_attn_implementation(attention.NAME)
    callbacks = [compiling.EveryShapeAtOnce()] if params["compile"] is True else []  # as the stage compiles
    meter = run_steps(unpadded.UnpaddedClassifier(model) if packed else model, args, data,
                      unpadded.collate if packed else make_collator(tokenizer, device), steps,
                      COMPILE_WARMUP if params["compile"] is True else warmup, callbacks=callbacks)[0]
    del model
    free_gpu()
    return meter


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="timed optimizer steps per side")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--only", nargs="+", choices=sorted(CANDIDATES), help="these candidates only")
    parser.add_argument("--gpu", action="store_true", help="on one GPU")
    parser.add_argument("--model", choices=["minilm", "bert-base"], default="minilm",
                        help="the embedded MiniLM, or a randomly initialised bert-base-sized model")
    parser.add_argument("--effective-batch-size", type=int, help="overrides train.effective_batch_size")
    opts = parser.parse_args()
    if opts.gpu and not torch.cuda.is_available():
        sys.exit("--gpu: no CUDA GPU visible to torch")
    hf_logging.disable_progress_bar()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = "cuda" if opts.gpu else "cpu"
    os.chdir(REPO)
    params = load_params("train", TRAIN_PARAMS)
    if opts.effective_batch_size:
        params["effective_batch_size"] = opts.effective_batch_size
    tokenize = load_params("tokenize", TOKENIZE_PARAMS)
    source = resolve_model("minilm")
    tokenizer = AutoTokenizer.from_pretrained(source)
    make_model = functools.partial(gpu_model, len(tokenizer)) if opts.model == "bert-base" else minilm_model
    texts, labels, _ = load_corpus(load_params("preprocess", PREPROCESS_PARAMS))
    max_length = stage_max_length(tokenizer, source, texts, tokenize)
    sequences, _ = tokenize_texts(tokenizer, texts, max_length)
    dtype = autocast_dtype(params["mixed_precision"], device)
    where = torch.cuda.get_device_name() if opts.gpu else f"cpu ({cpu_isa()}), {torch.get_num_threads()} torch threads"
    in_fp32 = attention.choose(make_model(**recipe(params)), device, dtype, False, sequences)[0]
    print(f"candidates with {opts.model} on {where}, load average {load_average()}; torch {torch.__version__}; the "
          f"defaults train in {dtype or torch.float32}{', attention in fp32' if in_fp32 else ''}, effective batch "
          f"{params['effective_batch_size']}", flush=True)
    names = opts.only or [n for n in CANDIDATES if opts.gpu or n not in GPU_ONLY]
    with tempfile.TemporaryDirectory() as folder:
        data = dataset(folder, "train", sequences, labels)
        start = time.perf_counter()
        first = train(params, tokenizer, sequences, data, folder, opts.steps, 1, device=device, make_model=make_model)
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
                    return train(params, tokenizer, sequences, data, folder, n, 1, device=device, make_model=make_model)
                if changes.get("compile") is True:
                    # each compiled side compiles afresh, as a stage's process does: past torch._dynamo's
                    # recompile_limit (8 compilings of the forward's code in a process) later sides would run it eager
                    torch._dynamo.reset()
                with SETTINGS.get(name, contextlib.nullcontext)():
                    return train({**params, **changes}, tokenizer, sequences, data, folder, n, 1, fp32_attention,
                                 implementation, name == "full_last_layer", device, make_model, arguments)

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
