"""Benchmark: this pipeline's defaults against the usual fine-tuning recipe, measured side by side.

    python -m bench.benchmark                # CPU: the embedded MiniLM, about 5 minutes on 2 cores
    python -m bench.benchmark --gpu          # one GPU: a randomly initialised bert-base-sized model, bf16
    python -m bench.benchmark --repo PATH    # time the no-op `dvc repro` in an existing, reproduced repo

Prints six measurements (seven with --compile), each as a ratio against a baseline measured in
the same run, so a busy machine slows both sides alike (the load average is printed too):
1. tokenization of the embedded corpus: the tokenize stage's function vs one tokenizer call per
   row with padding="max_length", return_tensors="pt";
2. the tokenize stage's peak memory on the corpus copied 10 times vs on the corpus;
3. training throughput in real (non-pad) tokens/s over a fixed number of steps: the train stage's
   defaults vs padding to 128 in fp32 with random batches, the model's dropout and every weight
   trained; and, where train.dropout or train.freeze_embeddings change the model, the defaults vs
   the same with the model as it comes;
4. training throughput of the defaults in bf16 autocast vs the same in fp32 ("not supported"
   where the CPU has no native bf16);
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
import dataclasses
import functools
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import (AutoConfig, AutoTokenizer, BertConfig,
                          BertForSequenceClassification, BertModel, DataCollatorWithPadding,
                          TrainerCallback, TrainingArguments, set_seed)
from transformers import logging as hf_logging
from transformers.trainer_callback import PrinterCallback

from bench.tokenize_memory import tokenize_memory
from stages import unpadded
from stages.common import load_params, pack_sequences, unpack_sequences
from stages.csvfiles import read_csv
from stages.models import resolve_model, set_dropout
from stages.fetch import write_builtin
from stages.preprocess import CLEANING_SWITCHES, PREPROCESS_PARAMS, clean_frame
from stages.speed import (CountingTrainer, Throughput, autocast_dtype, cpu_bf16_speedup, cpu_has_bf16, peak_memory,
                          pick_batch_size)
from stages.tokenize import TOKENIZE_PARAMS, auto_max_length, model_limit, tokenize_texts
from stages.train import TRAIN_PARAMS, TokenizedDataset, load_model, make_collator, training_arguments

REPO = Path(__file__).resolve().parents[1]
BASELINE_MAX_LENGTH = 128  # the usual recipe pads every text to this
BASELINE_BATCH = 32
GOALS = {"tokenize": 3.0, "memory": 1.3, "train": 3.0, "bf16": 1.6, "mfu": 0.5, "dvc_s": 3.0}
COMPILE_WARMUP = 10  # steps: the row for torch.compile times what follows its compiling
QUIET = {"disable_tqdm": True, "logging_strategy": "no", "eval_strategy": "no", "report_to": "none"}
# the machine section as the stage would have it, but no checkpoints: writing them would be timed as training
NO_CHECKPOINTS = {"checkpoint_dir": "unused", "checkpoint_minutes": float("inf"), "checkpoint_steps": None,
                  "loader_workers": 2, "pin_memory": True}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def load_corpus(preprocess):
    """(train texts, train labels, test texts) of the embedded tweets, cleaned as preprocess cleans them."""
    options = {k: preprocess[k] for k in CLEANING_SWITCHES}
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "raw"  # write_builtin makes the folder itself
        write_builtin(raw)
        frames = [clean_frame(read_csv(raw / f"{s}.csv"), preprocess["text_column"],
                              preprocess["label_column"], options) for s in ("train", "test")]
    train, test = frames
    names = sorted(set(train["label"]))
    return train["text"].tolist(), [names.index(x) for x in train["label"]], test["text"].tolist()


def per_row_seconds(tokenizer, texts):
    start = time.perf_counter()
    for text in texts:
        tokenizer(text, padding="max_length", truncation=True, max_length=BASELINE_MAX_LENGTH,
                  return_tensors="pt")
    return time.perf_counter() - start


def bench_tokenization(tokenizer, texts, max_length):
    """(seconds of the tokenize stage's function, seconds of one padded call per row) over all
    texts. The per-row baseline runs half before the stage's function and half after, so a change
    in the machine's load affects both alike."""
    half = len(texts) // 2
    per_row = per_row_seconds(tokenizer, texts[:half])
    start = time.perf_counter()
    tokenize_texts(tokenizer, texts, max_length)
    stage = time.perf_counter() - start
    return stage, per_row + per_row_seconds(tokenizer, texts[half:])


def matmul_peak(device, dtype, sizes, seconds):
    """Best FLOP/s of square matmuls of the given sizes, each run for about `seconds`."""
    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        a @ b
        sync()
        queued = 10 if device == "cuda" else 1  # the GPU gets several before each wait
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(queued):
                a @ b
            sync()
            count += queued
        best = max(best, 2 * n**3 * count / (time.perf_counter() - start))
    return best


def non_embedding_parameters(model):
    return sum(p.numel() for name, p in model.named_parameters() if "embeddings" not in name)


def dataset(folder, name, sequences, labels):
    """A TokenizedDataset, loaded the way the train stage loads one (a file's rows)."""
    path = Path(folder) / f"{name}.safetensors"
    save_file(pack_sequences(sequences, labels), path)
    sequences, labels = unpack_sequences(load_file(path))
    return TokenizedDataset.rows(sequences, labels, range(len(sequences)))


class PeakSampler(TrainerCallback):
    """Every `every` optimizer steps and after the last, stops the throughput clock and measures the
    matmul peak for a moment: on a shared machine the peak is then sampled under the same load as
    the training."""

    def __init__(self, meter, measure, every=10):
        self.meter, self.measure, self.every = meter, measure, every
        self.peaks = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            start = time.perf_counter()
            self.peaks.append(self.measure())
            self.meter.start += time.perf_counter() - start  # the pause is not training time


def run_steps(model, args, train_set, collator, steps, warmup, measure_peak=None):
    """(throughput over `steps` optimizer steps after `warmup` untimed ones (allocator, kernels),
    matmul peaks measured during those steps when measure_peak is given)."""
    meter = Throughput()
    trainer = CountingTrainer(model=model, args=dataclasses.replace(args, max_steps=warmup),
                              train_dataset=train_set, data_collator=collator, throughput=meter)
    trainer.remove_callback(PrinterCallback)  # it prints each run's summary: noise here
    trainer.train()
    meter.reset()
    sampler = PeakSampler(meter, measure_peak)
    if measure_peak:
        trainer.add_callback(sampler)
    trainer.args.max_steps = steps
    trainer.train()  # a fresh shuffle: with length grouping, the first batch holds the longest text
    return meter, sampler.peaks


def combined(meters):
    """One Throughput summing several measured runs."""
    total = Throughput()
    for m in meters:
        total.samples += m.samples
        total.padded_tokens += m.padded_tokens
        total.real_tokens += int(m.real_tokens)
        total.seconds += m.seconds
    return total


def free_gpu():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def bench_training(make_model, tokenizer, data, params, device, steps, baseline_steps, warmup, measure_peak):
    """(summary of the defaults' throughput, of the baseline's, {batch size, accumulation, longest
    batch, peak memory, matmul peaks measured during the defaults' run}). data: (sequences cut to
    max_length, cut to 128, labels). The baseline runs half its steps before the defaults and half
    after, so a change in the machine's load affects both sides alike."""
    sequences, baseline_sequences, labels = data
    with tempfile.TemporaryDirectory() as folder:
        padded = dataset(folder, "baseline", baseline_sequences, labels)
        pad_128 = DataCollatorWithPadding(tokenizer, padding="max_length", max_length=BASELINE_MAX_LENGTH)
        usual = TrainingArguments(folder, per_device_train_batch_size=BASELINE_BATCH, learning_rate=params["lr"],
                                  save_strategy="no", seed=0, tf32=False if device == "cuda" else None,
                                  dataloader_pin_memory=device == "cuda", **QUIET)
        baseline = [run_steps(make_model(), usual, padded, pad_128, baseline_steps // 2, warmup)[0]]
        free_gpu()

        model = make_model(**recipe(params))
        batch, accumulation, seq_len = pick_batch_size(model, sequences, params["batch_size"],
                                                       params["effective_batch_size"],
                                                       params["mixed_precision"], device)
        # no checkpoints: writing them would be timed as training
        args = dataclasses.replace(training_arguments(params, NO_CHECKPOINTS, folder, device, batch, accumulation), **QUIET,
                                   save_strategy="no")
        ours, peaks = run_steps(model, args, dataset(folder, "ours", sequences, labels),
                                make_collator(tokenizer, device), steps, warmup, measure_peak)
        memory = peak_memory()
        del model
        free_gpu()

        rest = baseline_steps - baseline_steps // 2
        baseline.append(run_steps(make_model(), usual, padded, pad_128, rest, warmup)[0])
    run = {"batch": batch, "accumulation": accumulation, "seq_len": seq_len, "peaks": peaks, **memory}
    return ours.summary(), combined(baseline).summary(), run


def side_by_side(run, steps):
    """(throughput summary of run(False, ...), of run(True, ...)) over `steps` optimizer steps each; the
    False side runs half its steps before the True side and half after, so a change in load affects both."""
    reference = [run(False, steps // 2)]
    changed = run(True, steps)
    reference.append(run(False, steps - steps // 2))
    return combined(reference).summary(), changed.summary()


def bench_precision(make_model, tokenizer, sequences, labels, params, device, steps, warmup):
    """(throughput summary in fp32, in bf16 autocast) of the defaults, side by side."""
    with tempfile.TemporaryDirectory() as folder:
        data = dataset(folder, "train", sequences, labels)

        def run(bf16, n):
            model = make_model(**recipe(params))
            batch, accumulation, _ = pick_batch_size(model, sequences, params["batch_size"],
                                                     params["effective_batch_size"], bf16, device)
            # bf16 set here, not through train.mixed_precision: the train stage uses it on a CPU only
            # where it measured bf16 faster, and this row is that measurement for training as a whole
            args = dataclasses.replace(training_arguments({**params, "mixed_precision": False}, NO_CHECKPOINTS, folder, device,
                                                          batch, accumulation), **QUIET, save_strategy="no", bf16=bf16)
            meter = run_steps(model, args, data, make_collator(tokenizer, device), n, warmup)[0]
            free_gpu()
            return meter

        return side_by_side(run, steps)


def train_as_the_stage(model, params, tokenizer, sequences, data, folder, device, steps, warmup):
    """Throughput of `steps` optimizer steps of `model` with the train stage's settings from `params`
    (its batch size picked as the stage picks it), without checkpoints, which would be timed."""
    batch, accumulation, _ = pick_batch_size(model, sequences, params["batch_size"], params["effective_batch_size"],
                                             params["mixed_precision"], device)
    args = dataclasses.replace(training_arguments(params, NO_CHECKPOINTS, folder, device, batch, accumulation), **QUIET,
                               save_strategy="no")
    meter = run_steps(model, args, data, make_collator(tokenizer, device), steps, warmup)[0]
    free_gpu()
    return meter


def bench_recipe(make_model, tokenizer, sequences, labels, params, device, steps, warmup):
    """(throughput summary with the model's own dropout and every weight trained, with train.dropout and
    train.freeze_embeddings as set) of the defaults otherwise, side by side."""
    with tempfile.TemporaryDirectory() as folder:
        data = dataset(folder, "train", sequences, labels)

        def run(as_set, n):
            model = make_model(**recipe(params)) if as_set else make_model()
            return train_as_the_stage(model, params, tokenizer, sequences, data, folder, device, n, warmup)

        return side_by_side(run, steps)


def bench_compile(tokenizer, sequences, labels, params, device, steps, warmup):
    """(throughput summary eager, compiled (train.compile), seconds of the compiled side's warm-up
    steps, compiling included) of the embedded MiniLM at the train stage's settings, side by side."""
    compiling = []
    with tempfile.TemporaryDirectory() as folder:
        data = dataset(folder, "train", sequences, labels)

        def run(compiled, n):
            model = minilm_model(**recipe(params))
            start = time.perf_counter()
            # compiled: enough warm-up steps for the first batch shape and the recompile a second one brings
            meter = train_as_the_stage(model, {**params, "compile": compiled}, tokenizer, sequences, data, folder,
                                       device, n, COMPILE_WARMUP if compiled else warmup)
            if compiled:
                compiling.append(time.perf_counter() - start - meter.seconds)
            return meter

        eager, compiled = side_by_side(run, steps)
    return eager, compiled, compiling[0]


def command(args, cwd):
    """Run a command with this interpreter's folder first on PATH (dvc.yaml says `python`)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"{' '.join(map(str, args))} failed in {cwd}:\n"
                 f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return result.stdout


def dvc(*args, cwd):
    return command([sys.executable, "-m", "dvc", *args], cwd)


def build_pipeline_repo(root, tokenizer):
    """This pipeline with its default data and params in a fresh git + DVC repo, reproduced. Two
    changes make the full `dvc repro` take about a minute, and leave the no-op as it is: the model
    is a tiny randomly initialised BERT, and the effective batch is 512 (70 optimizer steps)."""
    model_dir = root / "tiny_model"
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertModel(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    repo = root / "pipeline"
    repo.mkdir()
    for name in ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(REPO / name, repo / name)
    shutil.copytree(REPO / "stages", repo / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["model"]["name"] = str(model_dir)
    params["train"]["effective_batch_size"] = 512
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    command(["git", "init", "-q"], repo)
    dvc("init", "-q", cwd=repo)
    dvc("config", "core.analytics", "false", cwd=repo)  # as this repository's .dvc/config has it
    command(["git", "add", "-A"], repo)
    command(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "pipeline"],
            repo)
    start = time.perf_counter()
    dvc("repro", cwd=repo)
    print(f"   (built {repo} with a tiny model: full dvc repro {time.perf_counter() - start:.0f} s)")
    return repo


def require_reproduced(repo):
    if dvc("status", "--json", cwd=repo).strip() not in ("{}", ""):
        sys.exit(f"{repo}: dvc status shows changes; run `dvc repro` there first, then time the no-op")


def noop_repro_seconds(repo, runs=3):
    """Median wall time of `dvc repro` in a repo where nothing changed; exits if a stage runs."""
    require_reproduced(repo)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = dvc("repro", cwd=repo)
        times.append(time.perf_counter() - start)
        if re.search(r"Running stage", out):
            sys.exit(f"{repo}: `dvc repro` ran a stage, so it was not a no-op:\n{out}")
    return statistics.median(times)


def verdict(value, goal, at_least=True):
    ok = value >= goal if at_least else value <= goal
    return "meets the goal" if ok else "BELOW THE GOAL"


def recipe(params):
    """The train.* keys that change the model being trained, as make_model takes them."""
    return {"dropout": params["dropout"], "freeze_embeddings": params["freeze_embeddings"]}


AS_LOADED = {"dropout": "model", "freeze_embeddings": False}  # the model trained as it comes


def minilm_model(dropout="model", freeze_embeddings=False):
    """The embedded MiniLM with a 3-class head, loaded as the train stage loads it (seed first)."""
    set_seed(0)
    return load_model(resolve_model("minilm"), ["0", "1", "2"], dropout=dropout,
                      freeze_embeddings=freeze_embeddings)[1]


def gpu_model(vocab_size, dropout="model", freeze_embeddings=False):
    """A bert-base-sized classifier (12 layers, hidden 768), randomly initialised: no download."""
    set_seed(0)
    config = BertConfig(vocab_size=vocab_size, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=512, num_labels=3)
    set_dropout(config, dropout)
    model = BertForSequenceClassification(config)
    model.get_input_embeddings().weight.requires_grad_(not freeze_embeddings)
    return model


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
    parser.add_argument("--effective-batch-size", type=int,
                        help="overrides train.effective_batch_size (GPU default 1024: at 32 a big GPU idles)")
    return parser.parse_args()


def report_tokenization(tokenizer, texts, max_length):
    stage_s, per_row_s = bench_tokenization(tokenizer, texts, max_length)
    ratio = per_row_s / stage_s
    print(f"1. tokenization of {len(texts)} texts: tokenize stage {stage_s:.2f} s vs one padded call per "
          f"row {per_row_s:.2f} s: {ratio:.1f}x (goal >= {GOALS['tokenize']:.0f}x: "
          f"{verdict(ratio, GOALS['tokenize'])})")


def report_tokenize_memory(found):
    (n1, gb1, s1), (n10, gb10, s10) = found[1], found[10]
    ratio = gb10 / gb1
    print(f"2. tokenize stage peak memory: {gb10:.2f} GB for {n10:,} texts (the corpus x10, {s10:.0f} s) vs "
          f"{gb1:.2f} GB for {n1:,} ({s1:.0f} s): {ratio:.2f}x (goal <= {GOALS['memory']}x: "
          f"{verdict(ratio, GOALS['memory'], at_least=False)})")


def report_precision(fp32, bf16, steps, device):
    if bf16 is None:
        print("4. bf16 vs fp32 training: not supported: this CPU has no bf16 instructions (AVX512-BF16 or AMX), "
              "so the defaults train in fp32")
        return
    ratio = bf16["tokens_per_s"] / fp32["tokens_per_s"]
    used = "the defaults train in bf16" if autocast_dtype(True, device) == torch.bfloat16 else (
        f"so the defaults train in fp32 here: bf16 matmuls run {cpu_bf16_speedup():.2f}x fp32 on this CPU")
    print(f"4. training in bf16 autocast vs fp32, the defaults otherwise: {bf16['tokens_per_s']:.0f} vs "
          f"{fp32['tokens_per_s']:.0f} real tokens/s over {steps} steps each: {ratio:.2f}x (goal >= "
          f"{GOALS['bf16']}x where the hardware has bf16: {verdict(ratio, GOALS['bf16'])}); {used}")


def report_training(ours, baseline, run, max_length, precision, steps, baseline_steps, params):
    ratio = ours["tokens_per_s"] / baseline["tokens_per_s"]
    frozen = ", token embeddings frozen" if params["freeze_embeddings"] else ""
    print(f"3. training, real tokens/s: defaults {ours['tokens_per_s']:.0f} over {steps} steps (batch "
          f"{run['batch']} x {run['accumulation']} accumulated, max_length {max_length}, longest batch "
          f"{run['seq_len']}, {precision}, padding {ours['padding_fraction']:.0%}, dropout "
          f"{params['dropout']}{frozen}) vs padded to "
          f"{BASELINE_MAX_LENGTH}, fp32, batch {BASELINE_BATCH}, the model's dropout: {baseline['tokens_per_s']:.0f} over "
          f"{baseline_steps} steps (padding "
          f"{baseline['padding_fraction']:.0%}): {ratio:.1f}x (goal >= {GOALS['train']:.0f}x: "
          f"{verdict(ratio, GOALS['train'])})")


def report_recipe(as_model, as_set, steps, params):
    ratio = as_set["tokens_per_s"] / as_model["tokens_per_s"]
    frozen = "token embeddings frozen" if params["freeze_embeddings"] else "every weight trained"
    print(f"   of which train.dropout {params['dropout']}, {frozen}: {as_set['tokens_per_s']:.0f} vs "
          f"{as_model['tokens_per_s']:.0f} real tokens/s with the model's dropout and every weight trained, "
          f"{steps} steps each: {ratio:.2f}x")


def report_flops(n_params, ours, baseline, peaks, precision):
    peak = statistics.mean(peaks)  # sampled during training: under the same load
    useful = 6 * n_params * ours["tokens_per_s"]
    share = useful / peak
    print(f"5. useful training FLOP/s: 6 x {n_params / 1e6:.1f}M non-embedding params x "
          f"{ours['tokens_per_s']:.0f} tokens/s = {useful / 1e9:.1f} GFLOP/s = {share:.0%} of the {precision} "
          f"matmul peak measured here, {peak / 1e9:.1f} GFLOP/s (mean of {len(peaks)} samples taken during "
          f"training, {min(peaks) / 1e9:.1f} to {max(peaks) / 1e9:.1f}) "
          f"(goal >= {GOALS['mfu']:.0%}: {verdict(share, GOALS['mfu'])}); the baseline: "
          f"{6 * n_params * baseline['tokens_per_s'] / peak:.0%}")


def report_dvc(repo_option, tokenizer):
    if importlib.util.find_spec("dvc") is None:
        print("6. no-op dvc repro: skipped, dvc is not installed in this Python")
        return
    with tempfile.TemporaryDirectory() as root:
        repo = repo_option.resolve() if repo_option else build_pipeline_repo(Path(root), tokenizer)
        seconds = noop_repro_seconds(repo)
    where = repo_option or "the default pipeline (tiny model)"
    print(f"6. no-op dvc repro in {where}: {seconds:.2f} s, median of 3 (goal <= {GOALS['dvc_s']:.0f} s: "
          f"{verdict(seconds, GOALS['dvc_s'], at_least=False)})")


def report_compile(eager, compiled, compile_s, steps, params):
    ratio = compiled["tokens_per_s"] / eager["tokens_per_s"]
    print(f"7. train.compile (torch.compile) vs eager, the embedded MiniLM at the train stage's settings (effective "
          f"batch {params['effective_batch_size']}): {compiled['tokens_per_s']:.0f} vs {eager['tokens_per_s']:.0f} "
          f"real tokens/s over {steps} steps each: {ratio:.2f}x (the compiled side's {COMPILE_WARMUP} untimed "
          f"warm-up steps, compiling included: {compile_s:.0f} s)")


def time_training_steps(model, examples, batch_size, steps, padded_collator, dtype=None, warmup=2):
    """Real tokens per second of `steps` training steps (forward, backward, AdamW) of `model`
    on padded batches (padded_collator, e.g. the train stage's) and on packed ones (stages.unpadded),
    over the same batches: examples in order, batch_size at a time, cycled. AdamW runs with lr 0, so
    both modes do the same work and the weights are left as they were (gradients are not).
    dtype: autocast dtype (bf16/fp16), None for fp32. Returns {"padded": ..., "unpadded": ...} and
    "attention", the packed path timed: with attention dropout (BERT's default 0.1) training takes
    the per-text SDPA path; load the model with attention_probs_dropout_prob=0 to time varlen_attn."""
    device = next(model.parameters()).device
    chunks = [examples[i:i + batch_size] for i in range(0, len(examples), batch_size)]
    tokens = [sum(len(e["input_ids"]) for e in chunk) for chunk in chunks]
    packed_model = unpadded.UnpaddedClassifier(model)  # padded batches too now run SDPA, as the model did
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    model.train()
    rates = {}  # real tokens per second
    for name, module, collator in (("padded", model, padded_collator), ("unpadded", packed_model, unpadded.collate)):
        # collated and moved up front: only the model's steps are timed
        batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in collator(chunk).items()}
                   for chunk in chunks]
        seen = 0
        for step in range(warmup + steps):
            if step == warmup:  # the first steps pay for kernel selection and allocator growth
                sync()
                start, seen = time.perf_counter(), 0
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = module(**batches[step % len(batches)]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seen += tokens[step % len(batches)]
        sync()
        rates[name] = seen / (time.perf_counter() - start)
    probe = torch.empty(1, 1, device=device, dtype=dtype or torch.float32)  # what q looks like under autocast
    varlen = unpadded.uses_varlen(probe, model.bert.encoder.layer[0].attention.self.dropout.p, None)
    return {**rates, "attention": "varlen_attn" if varlen else "per-text SDPA"}


def report_unpadded(make_model, tokenizer, sequences, labels, batch, dtype, params, steps=30):
    """GPU only: padded vs padding-free (stages.unpadded) training steps on the same batches, with
    the model as loaded (attention dropout: per-text SDPA) and without attention dropout (varlen_attn)."""
    examples = [{"input_ids": s, "labels": y} for s, y in zip(sequences, labels)]
    for attention_dropout in (None, 0.0):
        model = make_model(freeze_embeddings=params["freeze_embeddings"])
        if attention_dropout is not None:
            for layer in model.bert.encoder.layer:
                layer.attention.self.dropout.p = attention_dropout
        rates = time_training_steps(model.cuda(), examples[:batch * steps], batch, steps,
                                    make_collator(tokenizer, "cuda"), dtype=dtype)
        print(f"   padding-free batches ({rates['attention']}): {rates['unpadded']:.0f} vs padded "
              f"{rates['padded']:.0f} real tokens/s: {rates['unpadded'] / rates['padded']:.2f}x")
        del model
        free_gpu()


def load_average():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


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
    where = torch.cuda.get_device_name() if opts.gpu else f"cpu, {torch.get_num_threads()} torch threads"
    print(f"benchmark on {where} ({os.cpu_count()} cores, load average {load_average()}); "
          f"torch {torch.__version__}")

    model_source = str(opts.tokenizer) if opts.tokenizer else resolve_model("minilm")
    tokenizer = AutoTokenizer.from_pretrained(model_source)
    train_texts, labels, test_texts = load_corpus(preprocess)
    baseline_sequences, lengths = tokenize_texts(tokenizer, train_texts, BASELINE_MAX_LENGTH)
    max_length = tokenize["max_length"]
    if max_length == "auto":
        limit = model_limit(tokenizer, AutoConfig.from_pretrained(model_source))
        max_length = auto_max_length(lengths, tokenize["length_percentile"], limit)
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
    if opts.gpu or cpu_has_bf16():
        report_precision(*bench_precision(make_model, tokenizer, sequences, labels, params, device, opts.steps,
                                          warmup), opts.steps, device)
    else:
        report_precision(None, None, opts.steps, device)
    if opts.gpu:
        print(f"   train.batch_size {params['batch_size']} chose {run['batch']} per step for an effective "
              f"batch of {params['effective_batch_size']}, probed at {run['seq_len']} tokens; peak GPU memory "
              f"{run['peak_gpu_gb']:.1f} GiB ({run['peak_gpu_fraction']:.0%} of the GPU)")
    report_flops(non_embedding_parameters(make_model()), ours, baseline, run["peaks"], precision)
    if opts.gpu:
        report_unpadded(make_model, tokenizer, sequences, labels, run["batch"], dtype, params)
    report_dvc(opts.repo, tokenizer)
    if opts.compile:
        report_compile(*bench_compile(tokenizer, sequences, labels, stage_params, device, opts.steps, warmup),
                       opts.steps, stage_params)
    print(f"load average at the end: {load_average()}")


if __name__ == "__main__":
    main()
