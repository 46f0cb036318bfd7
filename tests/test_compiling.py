"""train.compile (training/compiling.py): auto compiles where a gain was measured on this kind of hardware and
the run repays the compiling, one graph traces every batch shape, a CPU run is not told that compiling needs an
Ampere GPU, and compiled bf16 training reaches the eager weights within bf16's own rounding."""
import dataclasses
import logging
import logging.handlers
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, TrainingArguments

from predicting.inference import make_collator
from tests.test_speed import MACHINE, WORDS, train_params
from training import compiling
from training.arguments import AMPERE_WARNING, replace_arguments, training_arguments
from training.speed import CountingTrainer, Throughput


@pytest.mark.parametrize("setting, key, steps, compiled, says", [
    # forced either way, whatever was measured
    (True, ("cpu", "AVX2", "float32"), 10, True, "train.compile: torch.compile;"),
    (False, ("cpu", "AMX", "bfloat16"), 10**6, False, None),
    # auto, measured 2x with a cost of 300 eager steps: a compiled step saves half a step, so 600 steps
    # save exactly the cost (not enough) and 601 half a step more
    ("auto", ("cpu", "AMX", "bfloat16"), 600, False, "would not repay"),
    ("auto", ("cpu", "AMX", "bfloat16"), 601, True, "repay the compiling"),
    ("auto", ("cpu", "AVX512-BF16", "float32"), 10**6, False, "measured 1.00x"),  # no gain: never
    ("auto", ("cpu", "AVX2", "float32"), 10**6, False, "was not measured on cpu (AVX2), float32"),
    ("auto", ("cuda", "NVIDIA H200", "bfloat16"), 10**6, False, "was not measured"),
])
def test_compile_auto_compiles_where_measured_faster_and_the_run_repays_it(setting, key, steps, compiled, says):
    measured = {("cpu", "AMX", "bfloat16"): (2.0, 300), ("cpu", "AVX512-BF16", "float32"): (1.0, 150)}
    chosen, line = compiling.choose(setting, *key, steps, measured)
    assert chosen is compiled
    assert (says is None and line == "") or (says in line), line


@pytest.mark.parametrize("isa, precision, steps, compiled", [
    # what bench/README.md records of MEASURED's own rows: the default run (917 steps)
    # stays eager on every CPU measured; on the EPYC compiling gained nothing, so never; with AMX in bf16
    # it repays the compiling from about 4,900 steps on
    ("AMX", "bfloat16", 917, False),
    ("AMX", "bfloat16", 4_500, False),
    ("AMX", "bfloat16", 5_300, True),
    ("AVX512-BF16", "bfloat16", 917, False),
    ("AVX512-BF16", "bfloat16", 10**6, False),
    ("AVX512-BF16", "float32", 10**6, False),
])
def test_the_measured_cpus_compile_where_the_docs_say(isa, precision, steps, compiled):
    assert compiling.choose("auto", "cpu", isa, precision, steps)[0] is compiled


@pytest.mark.parametrize("gpu, steps, compiled", [
    # what bench/README.md records of the H100's row: measured 1.13x with a cost of about 1,900 eager steps,
    # so the default run (917 steps) and a 40k-row contest's five epochs (6,250 steps) stay eager; it pays from
    # 1,900 / (1 - 1/1.13) = 16,515 steps on. The H200 was never measured side by side: eager, whatever the run
    ("NVIDIA H100 80GB HBM3", 917, False),
    ("NVIDIA H100 80GB HBM3", 6_250, False),
    ("NVIDIA H100 80GB HBM3", 16_500, False),
    ("NVIDIA H100 80GB HBM3", 16_600, True),
    ("NVIDIA H200", 10**6, False),
])
def test_the_measured_gpus_compile_where_the_docs_say(gpu, steps, compiled):
    assert compiling.choose("auto", "cuda", gpu, "bfloat16", steps)[0] is compiled


@pytest.mark.parametrize("setting, steps, compiled, says", [
    ("auto", 601, False, "and none works here (apt-get install g++, or set CXX)"),
    ("auto", 600, False, "would not repay"),  # as with a compiler: no need for one
    (True, 10, True, "train.compile: torch.compile;"),  # forced: Inductor's own error says what is missing
])
def test_compile_auto_stays_eager_on_a_cpu_without_a_cpp_compiler(setting, steps, compiled, says):
    measured = {("cpu", "AMX", "bfloat16"): (2.0, 300)}
    chosen, line = compiling.choose(setting, "cpu", "AMX", "bfloat16", steps, measured, compiler=False)
    assert chosen is compiled
    assert says in line, line


def test_a_compiled_cpu_run_is_not_told_that_compiling_needs_an_ampere_gpu(tmp_path):
    """transformers warns that torch.compile gains little without an Ampere GPU whenever it is on without TF32;
    on a CPU the stage's own line says what was measured there, so the stage's settings drop that warning,
    and so do the bench tools' changes to them (replace_arguments: dataclasses.replace builds them again).
    Built directly afterwards, or replaced with dataclasses.replace, they still warn: the filter is gone,
    and the warning is transformers' own (were it reworded, this would fail here rather than pass silently)."""
    logger = logging.getLogger("transformers.training_args")  # a handler there sees what its filters let through
    seen = logging.handlers.BufferingHandler(capacity=1000)
    logger.addHandler(seen)
    try:
        args = training_arguments(train_params(compile=True), MACHINE, str(tmp_path), "cpu", 8, 1)
        assert args.torch_compile
        changed = replace_arguments(args, max_steps=3)
        assert changed.torch_compile and changed.max_steps == 3
        assert not [r for r in seen.buffer if "Ampere" in r.getMessage()]
        dataclasses.replace(args, max_steps=3)
        assert len([r for r in seen.buffer if r.getMessage().startswith(AMPERE_WARNING)]) == 1
        TrainingArguments(output_dir=str(tmp_path), use_cpu=True, torch_compile=True, report_to="none")
        assert len([r for r in seen.buffer if r.getMessage().startswith(AMPERE_WARNING)]) == 2
    finally:
        logger.removeHandler(seen)


@pytest.mark.parametrize("cxx", [None, "/nonexistent/g++"])
def test_the_cpp_compiler_found_is_the_one_inductor_finds(cxx):
    """cpp_compiler looks where Inductor does, without importing it; Inductor's own search, in a process whose
    CXX is set before torch reads it, is the second opinion."""
    env = {k: v for k, v in os.environ.items() if k != "CXX"} | ({"CXX": cxx} if cxx else {}) | \
        {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    script = ("from training.compiling import cpp_compiler\n"
              "from torch._inductor.cpp_builder import get_cpp_compiler\n"
              "try:\n    inductor = get_cpp_compiler()\nexcept Exception:\n    inductor = None\n"
              "print(repr(cpp_compiler()), repr(inductor))")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ours, inductor = done.stdout.split()
    assert (ours == "None") == (inductor == "None"), (ours, inductor)
    assert (ours == "None") == (cxx is not None), ours


def test_the_run_steps_are_trainers_count():
    assert compiling.run_steps(29_000, 32, 1) == 907   # 906.25 batches: the last one short
    assert compiling.run_steps(29_000, 32, 0.5) == 454
    assert compiling.run_steps(64, 16, 3) == 12


def weights_after(model_dir, tokenizer, folder, steps, bf16, compiled):
    """The weights of the tiny model after `steps` optimizer steps (batches of 16 texts padded to 24 tokens:
    one shape, so compiling makes one graph) in bf16 autocast or fp32, compiled (train.compile) or eager."""
    torch.manual_seed(0)  # the same new classifier head in every run
    # no dropout (train.dropout's default): compiled code draws its masks from another generator
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=3, hidden_dropout_prob=0.0,
                                                               attention_probs_dropout_prob=0.0)
    texts = [" ".join(WORDS[: 1 + (i * 7) % 16]) for i in range(64)]
    data = [{"input_ids": ids, "labels": i % 3} for i, ids in enumerate(tokenizer(texts)["input_ids"])]
    params = train_params(lr=2e-3, warmup_ratio=0.0, compile=compiled, mixed_precision=False)
    args = dataclasses.replace(training_arguments(params, MACHINE, str(folder), "cpu", 16, 1), bf16=bf16,
                               max_steps=steps, save_strategy="no", logging_strategy="no", eval_strategy="no")
    collator = DataCollatorWithPadding(tokenizer, padding="max_length", max_length=24)
    CountingTrainer(model=model, args=args, train_dataset=data, data_collator=collator, throughput=Throughput()).train()
    return {name: w.detach().float().clone() for name, w in model.state_dict().items()}


def update_distance(a, b, start):
    """How far apart two runs' updates (weights - start) are, relative to the size of b's: the L2 norm over
    all weights of their difference over that of b's update."""
    diff = sum(((a[k] - b[k]) ** 2).sum().item() for k in a) ** 0.5
    return diff / sum(((b[k] - start[k]) ** 2).sum().item() for k in b) ** 0.5


def test_compiled_bf16_training_reaches_the_eager_weights_within_bf16s_own_rounding(tiny_model_dir, tokenizer,
                                                                                   tmp_path, monkeypatch):
    """Compiled kernels fuse operations and round bf16 intermediates elsewhere than eager ones: after 8
    steps at lr 2e-3 their weights differ, as eager bf16 differs from eager fp32. The tolerance is that
    difference, measured here: compiling must change the training's update (weights - start, L2 over all
    weights) by no more than training in bf16 instead of fp32 changes it (docs/speed.md). Not the
    largest single weight: AdamW moves a weight whose gradient is nearly 0 by up to lr a step in the
    direction of its rounding noise, so single weights differ by as much as they move."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    steps = 8
    fp32 = weights_after(tiny_model_dir, tokenizer, tmp_path, steps, bf16=False, compiled=False)
    eager = weights_after(tiny_model_dir, tokenizer, tmp_path, steps, bf16=True, compiled=False)
    compiled = weights_after(tiny_model_dir, tokenizer, tmp_path, steps, bf16=True, compiled=True)
    torch._dynamo.reset()  # other tests' models are not compiled
    assert list((tmp_path / "inductor").rglob("*.py")), "Inductor generated no code: the model was not compiled"
    torch.manual_seed(0)  # the weights before training, the classifier head as every run draws it
    start = {name: w.float() for name, w in
             AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3).state_dict().items()}
    compiling, precision = update_distance(compiled, eager, start), update_distance(eager, fp32, start)
    print(f"after {steps} steps, relative to the eager bf16 update: compiled vs eager bf16 {compiling:.3f}, "
          f"eager bf16 vs fp32 {precision:.3f}")
    assert compiling <= precision  # measured: 0.001 against 0.081


@pytest.mark.parametrize("every_shape_at_once, compilings", [(False, 3), (True, 1)])
def test_compiled_training_traces_one_graph_for_every_batch_shape(tiny_model_dir, tokenizer, tmp_path,
                                                                   every_shape_at_once, compilings):
    """23 texts of 1 to 23 words in order, in batches of 8 (the last of 7) padded to 10, 18 and 25 tokens: by
    default torch.compile traces the first batch's exact shape, again for the second batch's length, and
    again for the short last batch: 3 tracings of the model. With compiling.EveryShapeAtOnce, as the train
    stage compiles, one. Counted by Dynamo's own count of the graphs it made, with its "eager" backend (no Inductor: the
    tracing is what is counted)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    # problem_type set, as the train stage loads a model: else the first forward sets it, which recompiles
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3,
                                                               problem_type="single_label_classification")
    texts = [" ".join((WORDS * 2)[: 1 + i]) for i in range(23)]
    data = [{"input_ids": ids, "labels": i % 3} for i, ids in enumerate(tokenizer(texts)["input_ids"])]
    assert [len(data[i]["input_ids"]) for i in (7, 15, 22)] == [10, 18, 25]  # each batch's longest
    args = dataclasses.replace(training_arguments(train_params(compile=True), MACHINE, str(tmp_path), "cpu", 8, 1),
                               torch_compile_backend="eager", num_train_epochs=1, max_steps=-1, save_strategy="no",
                               logging_strategy="no", eval_strategy="no", train_sampling_strategy="sequential")
    callbacks = [compiling.EveryShapeAtOnce()] if every_shape_at_once else []
    CountingTrainer(model=model, args=args, train_dataset=data, data_collator=make_collator(tokenizer, "cpu"),
                    throughput=Throughput(), callbacks=callbacks).train()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()  # other tests' models are not compiled
    assert graphs == compilings
    assert torch._dynamo.config.assume_static_by_default  # put back when training ends
