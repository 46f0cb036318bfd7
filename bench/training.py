"""Rows 3, 4 and 7: training throughput of the train stage's settings against the usual recipe, in its
mixed precision against fp32, compiled against eager, each side by side in one run so that the machine's
load affects both alike; and a model trained as the stage trains it (as_the_stage), which bench.candidates,
bench.profile_step and bench.big_models train too."""
import dataclasses
import tempfile
import time

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
    verdict,
)
from bench.flops import PeakSampler
from modeling.models import make_collator
from modeling.precision import attention_in_fp32, autocast_dtype, in_fp32
from training.arguments import training_arguments
from training.batch_size import pick_batch_size
from training.learning_rate import learning_rate
from training.speed import Throughput, peak_memory
from training.trainer import CountingTrainer, EveryShapeAtOnce

COMPILE_WARMUP = 10  # steps: a compiled run times what follows its compiling


@dataclasses.dataclass
class Stage:
    """What the train stage does with a model that changes its speed (training/run.py): Trainer's arguments,
    its callbacks, whether the attention runs in fp32, and the batch it picked."""
    args: TrainingArguments
    callbacks: list
    fp32_attention: bool
    batch: int
    accumulation: int
    seq_len: int


def as_the_stage(model, params, sequences, folder, device, fp32_attention=None, **arguments):
    """The Stage of `model` trained with the train section `params` as training/run.py trains it: the batch
    picked as it picks it, the precision and compile of training_arguments, one compiled graph for every batch
    shape with train.compile (EveryShapeAtOnce), the attention in fp32 where the stage puts it (a CPU in bf16:
    modeling/precision.py; fp32_attention True or False chooses instead). No checkpoints (their writing would
    be timed as training), no logging, no evaluation; `arguments`: TrainingArguments settings changed on top."""
    params = {**params, "lr": learning_rate(params["lr"], model, params["lora_rank"], say=lambda *_: None)}
    batch, accumulation, seq_len = pick_batch_size(model, sequences, params["batch_size"],
                                                   params["effective_batch_size"], params["mixed_precision"], device,
                                                   params["adamw_8bit"])
    args = dataclasses.replace(training_arguments(params, NO_CHECKPOINTS, folder, device, batch, accumulation),
                               **QUIET, **arguments)
    if fp32_attention is None:
        fp32_attention = attention_in_fp32(device, autocast_dtype(params["mixed_precision"], device),
                                           model.config._attn_implementation)
    return Stage(args, [EveryShapeAtOnce()] if params["compile"] else [], fp32_attention, batch, accumulation, seq_len)


def run_steps(model, args, train_set, collator, steps, warmup, measure_peak=None, callbacks=(), fp32_attention=False):
    """(throughput over `steps` optimizer steps after `warmup` untimed ones (allocator, kernels),
    matmul peaks measured during those steps when measure_peak is given); the attention in fp32 with
    fp32_attention (modeling.precision.in_fp32)."""
    meter = Throughput()
    trainer = CountingTrainer(model=model, args=dataclasses.replace(args, max_steps=warmup),
                              train_dataset=train_set, data_collator=collator, throughput=meter,
                              callbacks=list(callbacks))
    trainer.remove_callback(PrinterCallback)  # it prints each run's summary: noise here
    sampler = PeakSampler(meter, measure_peak)
    with in_fp32(model, fp32_attention):
        trainer.train()
        meter.reset()
        if measure_peak:
            trainer.add_callback(sampler)
        trainer.args.max_steps = steps
        trainer.train()  # a fresh shuffle: with length grouping, the first batch holds the longest text
    return meter, sampler.peaks


def train_as_the_stage(model, params, tokenizer, sequences, data, folder, device, steps, warmup, fp32_attention=None,
                       **arguments):
    """Throughput of `steps` optimizer steps of `model` trained as the train stage trains it with the train
    section `params` (as_the_stage), after `warmup` untimed steps (COMPILE_WARMUP at least when compiled:
    the compiling and the recompile a second batch shape brings)."""
    stage = as_the_stage(model, params, sequences, folder, device, fp32_attention, **arguments)
    warmup = max(warmup, COMPILE_WARMUP) if params["compile"] else warmup
    meter = run_steps(model, stage.args, data, make_collator(tokenizer, device), steps, warmup,
                      callbacks=stage.callbacks, fp32_attention=stage.fp32_attention)[0]
    free_gpu()
    return meter


def bench_training(make_model, tokenizer, data, params, device, steps, baseline_steps, warmup, measure_peak):
    """(summary of the defaults' throughput, of the baseline's, {batch size, accumulation, longest
    batch, peak memory, matmul peaks measured during the defaults' run}). data: (sequences cut to
    max_length, cut to 128, labels). The baseline runs half its steps before the defaults and half
    after, so a change in the machine's load affects both sides alike."""
    sequences, baseline_sequences, labels = data
    with tempfile.TemporaryDirectory() as folder:
        padded = dataset(folder, "baseline", baseline_sequences, labels)
        pad_128 = DataCollatorWithPadding(tokenizer, padding="max_length", max_length=BASELINE_MAX_LENGTH)
        lr = learning_rate(params["lr"], make_model(), params["lora_rank"], say=lambda *_: None)
        usual = TrainingArguments(folder, per_device_train_batch_size=BASELINE_BATCH, learning_rate=lr,
                                  save_strategy="no", seed=0, tf32=False if device == "cuda" else None,
                                  dataloader_pin_memory=device == "cuda", **QUIET)
        baseline = [run_steps(make_model(), usual, padded, pad_128, baseline_steps // 2, warmup)[0]]
        free_gpu()

        model = make_model(**recipe(params))
        stage = as_the_stage(model, params, sequences, folder, device)
        ours, peaks = run_steps(model, stage.args, dataset(folder, "ours", sequences, labels),
                                make_collator(tokenizer, device), steps, warmup, measure_peak, stage.callbacks,
                                stage.fp32_attention)
        memory = peak_memory()
        del model
        free_gpu()

        rest = baseline_steps - baseline_steps // 2
        baseline.append(run_steps(make_model(), usual, padded, pad_128, rest, warmup)[0])
    run = {"batch": stage.batch, "accumulation": stage.accumulation, "seq_len": stage.seq_len, "peaks": peaks, **memory}
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


def stage_side_by_side(sides, tokenizer, sequences, labels, device, steps, warmup):
    """side_by_side of two ways of training as the train stage: sides(changed) gives a side's (model, train
    section), trained with train_as_the_stage on the same rows."""
    with tempfile.TemporaryDirectory() as folder:
        data = dataset(folder, "train", sequences, labels)
        return side_by_side(lambda changed, n: train_as_the_stage(*sides(changed), tokenizer, sequences, data, folder,
                                                                  device, n, warmup), steps)


def bench_precision(make_model, tokenizer, sequences, labels, params, device, steps, warmup):
    """(throughput summary in fp32, in the mixed precision the train stage trains in here) of the defaults,
    side by side: train.mixed_precision false against true, whatever params.yaml says."""
    return stage_side_by_side(lambda mixed: (make_model(**recipe(params)), {**params, "mixed_precision": mixed}),
                              tokenizer, sequences, labels, device, steps, warmup)


def bench_recipe(make_model, tokenizer, sequences, labels, params, device, steps, warmup):
    """(throughput summary with the model's own dropout and every weight trained, with train.dropout and
    train.freeze_embeddings as set) of the defaults otherwise, side by side."""
    return stage_side_by_side(lambda as_set: (make_model(**recipe(params)) if as_set else make_model(), params),
                              tokenizer, sequences, labels, device, steps, warmup)


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
            meter = train_as_the_stage(model, {**params, "compile": compiled}, tokenizer, sequences, data, folder,
                                       device, n, warmup)
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


def precision_line(fp32, mixed, steps, precision, goals):
    """Row 4: the mixed precision the train stage trains in here (precision: modeling.precision.describe's
    words, None where it trains fp32) against fp32, judged against goals["bf16"] (bench.common.hardware_goals).
    Where the stage trains fp32 (a CPU without bf16 instructions) bf16 is not timed, emulated there at a
    hundredth of fp32's speed, and the defaults are as fast as fp32: 1.0x, the goal on such a CPU."""
    goal = f"goal >= {goals['bf16']}x on {goals['why']}"
    if precision is None:
        return (f"4. bf16 vs fp32 training: not timed: torch's CPU kernels here have no bf16 instructions (AMX or "
                f"AVX512-BF16), so the defaults train in fp32, 1.0x ({goal}: {verdict(1.0, goals['bf16'])})")
    ratio = mixed["tokens_per_s"] / fp32["tokens_per_s"]
    return (f"4. training in {precision}, as the defaults train here, vs fp32, the defaults otherwise: "
            f"{mixed['tokens_per_s']:.0f} vs {fp32['tokens_per_s']:.0f} real tokens/s over {steps} steps each: "
            f"{ratio:.2f}x ({goal}: {verdict(ratio, goals['bf16'])})")


def report_compile(eager, compiled, compile_s, steps, params):
    ratio = compiled["tokens_per_s"] / eager["tokens_per_s"]
    print(f"7. train.compile (torch.compile) vs eager, the embedded MiniLM at the train stage's settings (effective "
          f"batch {params['effective_batch_size']}): {compiled['tokens_per_s']:.0f} vs {eager['tokens_per_s']:.0f} "
          f"real tokens/s over {steps} steps each: {ratio:.2f}x (the compiled side's {COMPILE_WARMUP} untimed "
          f"warm-up steps, compiling included: {compile_s:.0f} s)")
