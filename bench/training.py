"""Rows 3, 4 and 7, and the GPU's padded against padding-free batches: training throughput of the train
stage's settings against the usual recipe, in bf16 against fp32, compiled against eager, each side by
side in one run so that the machine's load affects both alike."""
import tempfile
import time

import torch
from transformers import DataCollatorWithPadding, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from bench.common import (
    BASELINE_BATCH,
    BASELINE_MAX_LENGTH,
    GOALS,
    NO_CHECKPOINTS,
    QUIET,
    combined,
    dataset,
    free_gpu,
    minilm_model,
    recipe,
    sync,
    verdict,
)
from bench.flops import PeakSampler
from modeling.models import make_collator
from training import attention, compiling, first_token, unpadded
from training.arguments import replace_arguments, training_arguments
from training.batch_size import pick_batch_size
from modeling.precision import autocast_dtype, cpu_bf16_speedup
from training.speed import Throughput, peak_memory
from training.trainer import CountingTrainer

COMPILE_WARMUP = 10  # steps: the row for torch.compile times what follows its compiling


def stage_callbacks(model, args, tokenizer, sequences):
    """What the train stage does to the model for these settings that changes its speed: its last layer
    computes the first token only where that gives its own logits (training/first_token.py, checked on a
    few of `sequences`); its attention in fp32 inside bf16 autocast where this CPU's bf16 attention is
    slower (modeling/attention.py); and the callbacks it adds: one compiled graph for every batch shape
    (training/compiling.py)."""
    device = "cpu" if args.use_cpu else "cuda"
    first_token.choose(model, first_token.check_batch(make_collator(tokenizer, device), sequences))
    if attention.choose(model, device, torch.bfloat16 if args.bf16 else None, False, sequences)[0]:
        model.set_attn_implementation(attention.NAME)  # for the whole of the bench's runs
    return [compiling.EveryShapeAtOnce()] if args.torch_compile else []


def run_steps(model, args, train_set, collator, steps, warmup, measure_peak=None, callbacks=()):
    """(throughput over `steps` optimizer steps after `warmup` untimed ones (allocator, kernels),
    matmul peaks measured during those steps when measure_peak is given)."""
    meter = Throughput()
    trainer = CountingTrainer(model=model, args=replace_arguments(args, max_steps=warmup),
                              train_dataset=train_set, data_collator=collator, throughput=meter,
                              callbacks=list(callbacks))
    trainer.remove_callback(PrinterCallback)  # it prints each run's summary: noise here
    trainer.train()
    meter.reset()
    sampler = PeakSampler(meter, measure_peak)
    if measure_peak:
        trainer.add_callback(sampler)
    trainer.args.max_steps = steps
    trainer.train()  # a fresh shuffle: with length grouping, the first batch holds the longest text
    return meter, sampler.peaks


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
        args = replace_arguments(training_arguments(params, NO_CHECKPOINTS, folder, device, batch, accumulation), **QUIET,
                                 save_strategy="no")
        ours, peaks = run_steps(model, args, dataset(folder, "ours", sequences, labels),
                                make_collator(tokenizer, device), steps, warmup, measure_peak,
                                stage_callbacks(model, args, tokenizer, sequences))
        memory = peak_memory()
        del model
        free_gpu()

        rest = baseline_steps - baseline_steps // 2
        baseline.append(run_steps(make_model(), usual, padded, pad_128, rest, warmup)[0])
    run = {"batch": batch, "accumulation": accumulation, "seq_len": seq_len, "peaks": peaks, **memory}
    return ours.summary(), combined(baseline).summary(), run


def side_by_side(run, steps):
    """(throughput summary of run(False, ...), of run(True, ...)) over `steps` optimizer steps each, in the
    order False, True, True, False: a change in load affects both sides alike. Each run is a fresh Trainer
    of the same seed, so each times the same first batches: both sides time the same texts (with one run
    of `steps` on one side, that side would time later batches, of other lengths, than the other)."""
    halves = (steps // 2, steps - steps // 2)
    reference, changed = [run(False, halves[0])], [run(True, halves[0])]
    changed.append(run(True, halves[1]))
    reference.append(run(False, halves[1]))
    return combined(reference).summary(), combined(changed).summary()


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
            args = replace_arguments(training_arguments({**params, "mixed_precision": False}, NO_CHECKPOINTS, folder, device,
                                                        batch, accumulation), **QUIET, save_strategy="no", bf16=bf16)
            meter = run_steps(model, args, data, make_collator(tokenizer, device), n, warmup,
                              callbacks=stage_callbacks(model, args, tokenizer, sequences))[0]
            free_gpu()
            return meter

        return side_by_side(run, steps)


def train_as_the_stage(model, params, tokenizer, sequences, data, folder, device, steps, warmup):
    """Throughput of `steps` optimizer steps of `model` with the train stage's settings from `params`
    (its batch size picked as the stage picks it), without checkpoints, which would be timed."""
    batch, accumulation, _ = pick_batch_size(model, sequences, params["batch_size"], params["effective_batch_size"],
                                             params["mixed_precision"], device)
    args = replace_arguments(training_arguments(params, NO_CHECKPOINTS, folder, device, batch, accumulation), **QUIET,
                             save_strategy="no")
    meter = run_steps(model, args, data, make_collator(tokenizer, device), steps, warmup,
                      callbacks=stage_callbacks(model, args, tokenizer, sequences))[0]
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
    steps, compiling included) of the embedded MiniLM at the train stage's settings, side by side, after
    the eager side trained once untimed over the same batches: each batch shape's first steps in a process
    are slow (on an H100 the eager side read 54,736 real tokens/s cold, against 77,053 warm in
    bench.candidates), and the compiled side's warm-up would hide that cost from it alone."""
    compile_seconds = []
    with tempfile.TemporaryDirectory() as folder:
        data = dataset(folder, "train", sequences, labels)

        def run(compiled, n):
            model = minilm_model(**recipe(params))
            start = time.perf_counter()
            # compiled: enough warm-up steps for the first batch shape and the recompile a second one brings
            meter = train_as_the_stage(model, {**params, "compile": compiled}, tokenizer, sequences, data, folder,
                                       device, n, COMPILE_WARMUP if compiled else warmup)
            if compiled:
                compile_seconds.append(time.perf_counter() - start - meter.seconds)
            return meter

        run(False, steps - steps // 2)  # the longer of side_by_side's halves: every shape either times
        eager, compiled = side_by_side(run, steps)
    return eager, compiled, compile_seconds[0]


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


def times_bf16(device, has_bf16, matmul_speedup):
    """Whether row 4 trains in bf16 to time it: on a GPU, and on a CPU with bf16 instructions whose bf16
    matmuls are at least as fast as fp32's (modeling.precision.cpu_bf16_speedup). Where they are slower the
    train stage trains in fp32 and bf16 training would only say how much slower; where bf16 is emulated
    (matmuls at 0.01x fp32 with oneDNN held to AVX2) its 50 steps take longer than the rest of the benchmark."""
    return device == "cuda" or (has_bf16 and matmul_speedup >= 1.0)


def defaults_vs_fp32(bf16_ratio, defaults_in_bf16):
    """What row 4's goal judges: how much faster the defaults train than fp32. That is bf16's ratio where
    they train in bf16, and 1.0 where the train stage chose fp32 (this CPU's bf16 is not faster): on a
    CPU without fast bf16 the goal is that the defaults are no slower than fp32, and an unused bf16 slows
    nothing. On AMX the goal (1.6x) still fails if the stage chose fp32."""
    return bf16_ratio if defaults_in_bf16 else 1.0


def report_precision(fp32, bf16, steps, device, goals, has_bf16=True):
    defaults_in_bf16 = autocast_dtype(True, device) == torch.bfloat16
    if bf16 is None and not has_bf16:
        print("4. bf16 vs fp32 training: not supported: this CPU has no bf16 instructions (AVX512-BF16 or AMX), "
              "so the defaults train in fp32")
        return
    if bf16 is None:
        print(f"4. bf16 vs fp32 training: bf16 not timed: this CPU has bf16 instructions, but multiplies bf16 "
              f"matrices {cpu_bf16_speedup():.2f}x as fast as fp32, so the defaults train in fp32 here, as fast as "
              f"fp32 (goal >= {goals['bf16']}x on {goals['why']}: {verdict(defaults_vs_fp32(None, False), goals['bf16'])})")
        return
    ratio = bf16["tokens_per_s"] / fp32["tokens_per_s"]
    used = "the defaults train in bf16" if defaults_in_bf16 else (
        f"so the defaults train in fp32 here: bf16 matmuls run {cpu_bf16_speedup():.2f}x fp32 on this CPU")
    judged = defaults_vs_fp32(ratio, defaults_in_bf16)
    print(f"4. training in bf16 autocast vs fp32, the defaults otherwise: {bf16['tokens_per_s']:.0f} vs "
          f"{fp32['tokens_per_s']:.0f} real tokens/s over {steps} steps each: {ratio:.2f}x; {used} (goal: the "
          f"defaults >= {goals['bf16']}x fp32 on {goals['why']}: {judged:.2f}x, {verdict(judged, goals['bf16'])})")


def report_compile(eager, compiled, compile_s, steps, params):
    ratio = compiled["tokens_per_s"] / eager["tokens_per_s"]
    print(f"7. train.compile (torch.compile) vs eager, the embedded MiniLM at the train stage's settings (effective "
          f"batch {params['effective_batch_size']}): {compiled['tokens_per_s']:.0f} vs {eager['tokens_per_s']:.0f} "
          f"real tokens/s over {steps} steps each: {ratio:.2f}x (the compiled side's {COMPILE_WARMUP} untimed "
          f"warm-up steps, compiling included: {compile_s:.0f} s)")


def time_training_steps(model, examples, batch_size, steps, padded_collator, dtype=None, warmup=2):
    """Real tokens per second of `steps` training steps (forward, backward, AdamW) of `model`
    on padded batches (padded_collator, e.g. the train stage's) and on packed ones (training.unpadded),
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
    """GPU only: padded vs padding-free (training.unpadded) training steps on the same batches, with
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
