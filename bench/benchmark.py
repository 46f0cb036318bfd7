"""Benchmark: this pipeline's defaults against the usual fine-tuning recipe, measured side by side.

    python -m bench.benchmark                # CPU: the embedded MiniLM, about 5 minutes on 2 cores
    python -m bench.benchmark --gpu          # one GPU: a randomly initialised bert-base-sized model, bf16
    python -m bench.benchmark --repo PATH    # time the no-op `dvc repro` in an existing, reproduced repo
    python -m bench.benchmark --gpu --training-only --compile   # rows 3-5 and 7 only: a lent GPU's minutes

Prints six measurements (seven with --compile), each as a ratio against a baseline measured in
the same run, so a busy machine slows both sides alike (the load average is printed too):
1. tokenization of the embedded corpus: the tokenize stage's function vs one tokenizer call per
   row with padding="max_length", return_tensors="pt";
2. the tokenize stage's peak memory on the corpus copied 10 times vs on the corpus;
3. training throughput in real (non-pad) tokens/s over a fixed number of steps: the train stage's
   defaults vs padding to 128 in fp32 with random batches, the model's dropout and every weight
   trained; and, where train.dropout or train.freeze_embeddings change the model, the defaults vs
   the same with the model as it comes;
4. training throughput of the defaults in the mixed precision the train stage trains in here (bf16 on
   a GPU, and on a CPU with bf16 instructions with the attention in fp32) vs the same in fp32 (not
   timed where the CPU has no bf16 instructions: the defaults train in fp32 there);
5. useful training FLOP/s (6 x non-embedding parameters x real tokens/s) as a share of this
   machine's matmul peak in the precision the defaults train in (bf16 where the hardware has it),
   measured with large square matmuls in short bursts between the defaults' training steps;
6. wall time of a no-op `dvc repro` over a reproduced pipeline (built here with a tiny model
   unless --repo names one);
7. with --compile only: training the embedded MiniLM at the train stage's settings compiled
   (train.compile: torch.compile) vs eager.
Needs no network: the corpus and the tokenizer are embedded; the GPU model is built from a BertConfig.
"""
import argparse
import functools
import os
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer
from transformers import logging as hf_logging

from bench.common import (
    AS_LOADED,
    BASELINE_MAX_LENGTH,
    REPO,
    gpu_model,
    hardware_goals,
    load_average,
    load_corpus,
    minilm_model,
    recipe,
    tokenize_texts,
)
from bench.flops import matmul_peak, non_embedding_parameters, report_flops
from bench.noop_repro import report_dvc, require_reproduced
from bench.tokenization import report_tokenization, report_tokenize_memory
from bench.tokenize_memory import tokenize_memory
from bench.training import (
    bench_compile,
    bench_precision,
    bench_recipe,
    bench_training,
    precision_line,
    report_compile,
    report_recipe,
    report_training,
)
from modeling.models import resolve_model
from modeling.precision import autocast_dtype, cpu_isa, describe
from pipeline.settings import load_params
from reading.tokens import auto_max_length, model_limit
from stages.preprocess import PREPROCESS_PARAMS
from stages.tokenize import TOKENIZE_PARAMS
from training.settings import TRAIN_PARAMS
from training.speed import running_allocator


def _yes(flag):
    return "yes" if flag else "no"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="bert-base-sized model on one GPU, bf16")
    parser.add_argument("--repo", type=Path, help="time the no-op dvc repro in this reproduced pipeline repo")
    parser.add_argument("--steps", type=int, default=50,
                        help="timed optimizer steps with the defaults (50: on CPU one whole group of "
                             "length-sorted batches, as LengthGroupedSampler makes them)")
    parser.add_argument("--baseline-steps", type=int, help="timed optimizer steps of the baseline")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads for training and the matmul peak (default: torch's choice); "
                             "1 keeps a shared, busy machine from stalling torch's threads at every operation")
    parser.add_argument("--tokenizer", type=Path,
                        help="folder of the tokenizer (and config.json) to use instead of the embedded MiniLM's, "
                             "e.g. on a machine where the 88 MB model package cannot be installed")
    parser.add_argument("--compile", action="store_true",
                        help="add row 7: train.compile vs eager, side by side, with the embedded MiniLM at "
                             "params.yaml's train settings (a minute or more of compiling on a CPU)")
    parser.add_argument("--training-only", action="store_true",
                        help="the training rows only (3, 4, 5, and 7 with --compile): "
                             "rows 1, 2 and 6 measure the CPU and dvc, and took 70 s of a lent H200's time")
    parser.add_argument("--effective-batch-size", type=int,
                        help="overrides train.effective_batch_size (GPU default 1024: at 32 a big GPU idles)")
    return parser.parse_args()


def main():
    opts = parse_args()
    hf_logging.disable_progress_bar()  # a bar per model loaded would bury the rows
    if opts.gpu and not torch.cuda.is_available():
        sys.exit("--gpu: no CUDA GPU visible to torch")
    if opts.gpu and torch.cuda.device_count() > 1:  # Trainer would split each batch over all of them
        sys.exit("--gpu measures one GPU: run it as CUDA_VISIBLE_DEVICES=0 python -m bench.benchmark --gpu")
    if opts.repo:
        require_reproduced(opts.repo.resolve())  # before minutes of measuring, not after
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = "cuda" if opts.gpu else "cpu"
    os.chdir(REPO)  # params.yaml is read from the repository root
    preprocess = load_params("preprocess", PREPROCESS_PARAMS)
    tokenize = load_params("tokenize", TOKENIZE_PARAMS)
    params = load_params("train", TRAIN_PARAMS)
    stage_params = dict(params)  # as the train stage has them, for row 7
    if opts.effective_batch_size or opts.gpu:
        params["effective_batch_size"] = opts.effective_batch_size or 1024
    baseline_steps = opts.baseline_steps or (100 if opts.gpu else 8)
    warmup = 5 if opts.gpu else 1
    isa = cpu_isa()  # the host's, also with --gpu
    where = torch.cuda.get_device_name() if opts.gpu else f"cpu, {torch.get_num_threads()} torch threads"
    goals = hardware_goals(device, isa)
    print(f"benchmark on {where} ({os.cpu_count()} cores, {isa}: torch's CPU kernels use "
          f"{torch.backends.cpu.get_cpu_capability()}, AMX {_yes(torch.cpu._is_amx_tile_supported())}, "
          f"AVX512-BF16 {_yes(torch.cpu._is_avx512_bf16_supported())}; memory allocator {running_allocator()}; "
          f"load average {load_average()}); "
          f"torch {torch.__version__}; rows 4 and 5 hold the goals of {goals['why']}")

    model_source = str(opts.tokenizer) if opts.tokenizer else resolve_model("minilm")
    tokenizer = AutoTokenizer.from_pretrained(model_source)
    train_texts, labels, test_texts = load_corpus(preprocess)
    baseline_sequences, lengths = tokenize_texts(tokenizer, train_texts, BASELINE_MAX_LENGTH)
    max_length = tokenize["max_length"]
    if max_length == "auto":
        limit = model_limit(tokenizer, AutoConfig.from_pretrained(model_source))
        max_length = auto_max_length(lengths, tokenize["length_percentile"], limit)
    if not opts.training_only:
        report_tokenization(tokenizer, train_texts + test_texts, max_length)
        if opts.tokenizer is None:  # the stage tokenizes with model.name's tokenizer, the embedded one
            corpus_labels = [str(y) for y in labels] + ["0"] * len(test_texts)
            report_tokenize_memory(tokenize_memory(train_texts + test_texts, corpus_labels))

    dtype = autocast_dtype(params["mixed_precision"], device)
    peak_dtype = dtype or torch.float32
    precision = str(peak_dtype).removeprefix("torch.")
    sizes = [8192] if opts.gpu else [1024, 2048]
    measure_peak = functools.partial(matmul_peak, device, peak_dtype, sizes, seconds=0.5)
    sequences, _ = tokenize_texts(tokenizer, train_texts, max_length)
    make_model = functools.partial(gpu_model, len(tokenizer)) if opts.gpu else minilm_model
    ours, baseline, run = bench_training(make_model, tokenizer, (sequences, baseline_sequences, labels), params,
                                         device, opts.steps, baseline_steps, warmup, measure_peak)
    report_training(ours, baseline, run, max_length, precision, opts.steps, baseline_steps, params)
    if recipe(params) != AS_LOADED:
        report_recipe(*bench_recipe(make_model, tokenizer, sequences, labels, params, device, opts.steps, warmup),
                      opts.steps, params)
    trained_in = describe(True, device) if autocast_dtype(True, device) else None  # None: fp32, bf16 not timed
    fp32, mixed = (bench_precision(make_model, tokenizer, sequences, labels, params, device, opts.steps, warmup)
                   if trained_in else (None, None))
    print(precision_line(fp32, mixed, opts.steps, trained_in, goals))
    if opts.gpu:
        print(f"   train.batch_size {params['batch_size']} chose {run['batch']} per step for an effective "
              f"batch of {params['effective_batch_size']}, probed at {run['seq_len']} tokens; peak GPU memory "
              f"{run['peak_gpu_gb']:.1f} GiB ({run['peak_gpu_fraction']:.0%} of the GPU)")
    report_flops(non_embedding_parameters(make_model()), ours, baseline, run["peaks"], precision, goals)
    if not opts.training_only:
        report_dvc(opts.repo, tokenizer)
    if opts.compile:
        report_compile(*bench_compile(tokenizer, sequences, labels, stage_params, device, opts.steps, warmup),
                       opts.steps, stage_params)
    print(f"load average at the end: {load_average()}")


if __name__ == "__main__":
    main()
