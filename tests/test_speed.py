"""Correctness of the speed features: dynamic padding, length grouping, the batch-size finder,
max_length auto and the throughput counters. Speed itself is measured by bench/benchmark.py."""
import dataclasses
import logging
import logging.handlers
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    BertConfig,
    DataCollatorWithPadding,
    PretrainedConfig,
    TrainerCallback,
    TrainingArguments,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bench.training import defaults_vs_fp32, times_bf16
from pipeline.settings import PipelineError, load_params
from predicting.inference import make_collator
from reading.tokens import auto_max_length, model_limit, pack_sequences, unpack_sequences
from stages.train import MACHINE_PARAMS, TRAIN_PARAMS
from training import allocator, attention, compiling, precision
from training.arguments import AMPERE_WARNING, replace_arguments, training_arguments
from training.batch_size import choose_batch_size, cuda_fits, find_batch_size, memory_budget
from training.data import TokenizedDataset
from training.precision import BF16_MIN_SPEEDUP, gpu_autocast_dtype, precision_note
from training.speed import CountingTrainer, Throughput

WORDS = "the flight was awful and late again but the crew were great and the food was fine".split()


@pytest.fixture(scope="module")
def tiny_classifier(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3).eval()


def dataset_file(tmp_path, tokenizer, n):
    """A tokenized split of n texts of 1 to 16 words whose label is its own index, loaded as the
    train stage loads one (all rows of data/tokenized/train.safetensors)."""
    texts = [" ".join(WORDS[: 1 + (i * 7) % 16]) for i in range(n)]
    path = tmp_path / "train.safetensors"
    save_file(pack_sequences(tokenizer(texts)["input_ids"], list(range(n))), path)
    sequences, labels = unpack_sequences(load_file(path))
    return TokenizedDataset.rows(sequences, labels, range(n))


def train_params(**changes):
    return {**load_params("train", TRAIN_PARAMS), **changes}


MACHINE = load_params("machine", MACHINE_PARAMS)


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # the collator's settings for each; the model runs on CPU
def test_dynamic_padding_gives_the_logits_of_max_length_padding(tiny_classifier, tokenizer, device):
    texts = [" ".join(WORDS[:k]) for k in (1, 16, 3, 9, 2, 12, 5)]
    sequences = tokenizer(texts)["input_ids"]
    collator = make_collator(tokenizer, device)
    with torch.no_grad():
        dynamic = torch.cat([tiny_classifier(**collator([{"input_ids": s} for s in sequences[i:i + 3]])).logits
                             for i in range(0, len(texts), 3)])
        reference = tiny_classifier(**tokenizer(texts, padding="max_length", max_length=128,
                                                return_tensors="pt")).logits
    assert collator([{"input_ids": sequences[0]}])["input_ids"].shape[1] == (8 if device == "cuda" else 3)
    assert torch.allclose(dynamic, reference, atol=1e-5)


def epoch_batches(trainer):
    """The label (= example index) batches of one pass over the trainer's train dataloader."""
    return [batch["labels"].tolist() for batch in trainer.get_train_dataloader()]


def padding_fraction(batches, lengths):
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / padded


def test_length_grouping_yields_every_example_once_per_epoch(tmp_path, tokenizer, tiny_classifier):
    dataset = dataset_file(tmp_path, tokenizer, 203)  # not a multiple of the batch size
    lengths = [len(s) for s in dataset.sequences]

    def trainer(group_by_length):
        args = training_arguments(train_params(group_by_length=group_by_length), MACHINE, str(tmp_path), "cpu", 8, 2)
        return CountingTrainer(model=tiny_classifier, args=args, train_dataset=dataset, eval_dataset=dataset,
                               data_collator=make_collator(tokenizer, "cpu"), throughput=Throughput())

    torch.manual_seed(0)
    grouped = trainer(True)
    first, second = epoch_batches(grouped), epoch_batches(grouped)
    for epoch in (first, second):
        assert sorted(i for batch in epoch for i in batch) == list(range(203))
    assert first != second  # reshuffled every epoch
    random_order = epoch_batches(trainer(False))
    assert padding_fraction(first, lengths) < padding_fraction(random_order, lengths) / 2


@pytest.mark.parametrize("has_bf16, speedup, bf16", [
    (True, 3.0, True),    # an EPYC with AVX512-BF16 measured 3.7x: bf16
    (True, 0.5, False),   # a virtual Xeon that reports AVX512-BF16 measured 0.47x: fp32
    (False, 3.0, False),  # no bf16 instructions (an AVX2-only CPU): fp32 whatever a timing says
])
def test_cpu_trains_in_bf16_only_where_bf16_is_faster_and_in_the_main_process(tmp_path, monkeypatch, has_bf16,
                                                                               speedup, bf16):
    # the machine's own measurement would test one row of this table only, and the same one on every run
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: has_bf16)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: speedup)
    args = training_arguments(train_params(mixed_precision=True), {**MACHINE, "loader_workers": 2}, str(tmp_path),
                              "cpu", 8, 4)
    assert args.bf16 == bf16 and not args.fp16
    note = precision_note(True, "cpu")
    if has_bf16 and not bf16:  # the log says why this CPU's bf16 instructions go unused
        assert note == (f" (this CPU has bf16 instructions, but multiplies bf16 matrices {speedup:.2f}x as fast "
                        f"as fp32, below the {BF16_MIN_SPEEDUP}x it takes to use them)"), note
    else:
        assert note == "", note
    off = training_arguments(train_params(mixed_precision=False), MACHINE, str(tmp_path), "cpu", 8, 4)
    assert not off.bf16 and not off.fp16
    assert args.dataloader_num_workers == 0 and not args.dataloader_pin_memory
    assert args.gradient_accumulation_steps == 4 and args.optim == "adamw_torch_fused"


def test_processes_of_one_run_agree_on_the_bf16_speedup(tmp_path):
    """Each process times its own matmuls; unagreed, two processes near the 1.3x margin could train
    in different precisions. Two gloo processes under torchrun must return the same ratio."""
    script = tmp_path / "measure.py"
    script.write_text("import os, pathlib, sys, torch\n"
                      "from training.precision import cpu_bf16_speedup\n"
                      "torch.distributed.init_process_group('gloo')\n"
                      "ratio = cpu_bf16_speedup(size=256, burst_seconds=0.02)\n"
                      "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text(repr(ratio))\n"
                      "torch.distributed.destroy_process_group()\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = tmp_path / "ratios"
    out.mkdir()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ratios = {path.name: path.read_text() for path in out.iterdir()}
    assert set(ratios) == {"0", "1"}, done.stdout
    assert ratios["0"] == ratios["1"] and float(ratios["0"]) > 0, ratios


def test_a_cpu_whose_bf16_matmuls_are_emulated_measures_them_slower_than_fp32():
    """A CPU whose bf16 is slow, made on this one: oneDNN and torch's kernels held to AVX2, where bf16 has
    no instructions (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY). The real measurement must find bf16 slower
    (0.02x here), so that the train stage trains in fp32 and the benchmark's row 4 does not time bf16."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", "from training.precision import cpu_bf16_speedup\n"
                           "print(cpu_bf16_speedup(size=256, burst_seconds=0.02))"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    speedup = float(done.stdout)
    assert speedup < 1.0 < BF16_MIN_SPEEDUP, speedup
    assert not times_bf16("cpu", True, speedup)


@pytest.mark.parametrize("device, has_bf16, matmul_speedup, timed", [
    ("cuda", True, None, True),    # a GPU: always
    ("cpu", True, 3.7, True),      # an EPYC with AVX512-BF16: bf16 training timed, the defaults use it
    ("cpu", True, 1.2, True),      # faster matmuls, below the stage's 1.3x: timed, to show what the margin costs
    ("cpu", True, 0.47, False),    # a virtual Xeon whose bf16 is slow: the stage trains fp32
    ("cpu", False, None, False),   # no bf16 instructions
])
def test_row_4_times_bf16_where_this_cpu_multiplies_it_no_slower_than_fp32(device, has_bf16, matmul_speedup, timed):
    assert times_bf16(device, has_bf16, matmul_speedup) is timed


@pytest.mark.parametrize("bf16_ratio, defaults_in_bf16, judged", [
    (1.86, True, 1.86),   # the defaults train in bf16: its ratio is theirs
    (0.45, True, 0.45),   # bf16 chosen and slower: the goal sees it
    (0.45, False, 1.0),   # bf16 slower, the stage trains fp32: as fast as fp32
    (None, False, 1.0),   # bf16 not timed
])
def test_row_4s_goal_judges_the_precision_the_defaults_train_in(bf16_ratio, defaults_in_bf16, judged):
    assert defaults_vs_fp32(bf16_ratio, defaults_in_bf16) == judged


def fake_memory(limit, fixed=2.0, per_example=0.5):
    """fits(b) for a device of `limit` GB where a step takes fixed + per_example * b GB; records probes."""
    probes = []

    def fits(b):
        probes.append(b)
        return fixed + per_example * b <= limit
    return fits, probes


@pytest.mark.parametrize("limit, effective, expected", [
    (100, 32, (32, 1)),   # everything fits: no accumulation
    (12, 32, (16, 2)),    # 20 would fit, but 16 is the largest size that keeps 32 exact
    (9.9, 32, (8, 4)),
    (9.0, 48, (12, 4)),   # 14 fits; 12 is the largest divisor of 48 below it
    (2.5, 32, (1, 32)),
])
def test_batch_finder_picks_the_largest_fitting_size_and_keeps_the_effective_batch(limit, effective, expected):
    fits, probes = fake_memory(limit)
    assert choose_batch_size("auto", effective, fits, seq_len=64) == expected
    assert len(probes) <= 4  # a binary search over the divisors, not one probe per size


def test_batch_finder_reports_what_fits_when_nothing_or_too_much_is_asked():
    fits, _ = fake_memory(limit=2.2)
    assert find_batch_size(fits, 32) is None
    with pytest.raises(PipelineError, match=r"batch_size 1 with texts of 64 tokens.*lower tokenize.max_length"):
        choose_batch_size("auto", 32, fits, seq_len=64)
    fits, _ = fake_memory(limit=12)
    with pytest.raises(PipelineError, match=r"batch_size 32 with texts of 64 .*the largest batch that fits is 16"):
        choose_batch_size(32, 32, fits, seq_len=64)
    assert choose_batch_size(8, 32, fits, seq_len=64) == (8, 4)
    with pytest.raises(PipelineError, match=r"train.batch_size 12 does not divide the 32 examples .* use auto or "
                                            r"one of 1, 2, 4, 8, 16, 32$"):
        choose_batch_size(12, 32, fits, seq_len=64)


@pytest.mark.parametrize("capability, dtype", [((7, 5), torch.float16), ((7, 0), torch.float16), ((6, 1), torch.float16),
                                               ((8, 0), torch.bfloat16), ((8, 9), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_gpus_without_native_bf16_train_in_fp16(capability, dtype):
    # a T4 (7.5) says torch.cuda.is_bf16_supported(), but emulates bf16: it must get fp16 with loss scaling
    assert gpu_autocast_dtype(capability) == dtype


def test_a_gpu_shared_with_other_processes_gives_this_one_its_share():
    gb = 2**30
    # alone on an 80 GB GPU, holding 2 GB of weights: 85% of all of it
    assert memory_budget(free=78 * gb, total=80 * gb, reserved_here=2 * gb) == pytest.approx(0.85 * 80 * gb)
    # another worker holds 30 GB: 85% of the 50 GB left to this one, not of 80
    assert memory_budget(free=48 * gb, total=80 * gb, reserved_here=2 * gb) == pytest.approx(0.85 * 50 * gb)
    # the driver may report a little more free than total - reserved: never more than the whole GPU
    assert memory_budget(free=80 * gb, total=80 * gb, reserved_here=2 * gb) == pytest.approx(0.85 * 80 * gb)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="probes real GPU memory")
def test_cuda_probe_fits_small_refuses_huge_and_frees_its_memory(tiny_model_dir):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3).cuda()
    before = torch.cuda.memory_allocated()
    assert cuda_fits(model, 8, 64, torch.bfloat16)
    assert not cuda_fits(model, 2**22, 128, None)  # ~500M tokens: an out-of-memory error, caught
    assert torch.cuda.memory_allocated() == before
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("lengths, percentile, limit, expected", [
    (list(range(1, 101)), 99.9, 512, 104),  # p99.9 = 99.9 -> next multiple of 8
    (list(range(1, 101)), 50, 512, 56),     # p50 = 50.5 -> 56
    ([48] * 10, 99.9, 512, 48),             # already a multiple of 8: kept
    (list(range(1, 1001)), 99.9, 512, 512),  # capped at the model's limit
])
def test_max_length_auto_is_the_percentile_rounded_up_to_8_and_capped(lengths, percentile, limit, expected):
    assert auto_max_length(lengths, percentile, limit) == expected


def test_model_limit_is_the_smaller_of_tokenizer_and_positions(tokenizer, tiny_model_dir):
    assert tokenizer.model_max_length == 512
    # the tiny BERT has 128 positions, its tokenizer says 512
    assert model_limit(tokenizer, AutoConfig.from_pretrained(tiny_model_dir)) == 128


def test_throughput_counts_every_example_and_real_token(tmp_path, tokenizer, tiny_model_dir):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3)
    dataset = dataset_file(tmp_path, tokenizer, 40)
    dataset.labels = [i % 3 for i in range(40)]
    throughput = Throughput()
    args = training_arguments(train_params(epochs=2, warmup_ratio=0.0), MACHINE, str(tmp_path), "cpu", 8, 1)
    CountingTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset,
                    data_collator=make_collator(tokenizer, "cpu"), throughput=throughput).train()
    real = 2 * sum(len(s) for s in dataset.sequences)
    assert (throughput.samples, int(throughput.real_tokens)) == (80, real)
    summary = throughput.summary()
    assert 0 < summary["padding_fraction"] < 0.5
    assert summary["tokens_per_s"] == pytest.approx(real / throughput.seconds, rel=1e-3)


def test_accumulated_loss_is_the_mean_over_micro_batches(tiny_model_dir, tokenizer, tmp_path):
    """With accumulation 2 the logged loss must match accumulation 1 on the same examples,
    not be twice as large (transformers 5 sums it for models whose forward takes **kwargs)."""
    import torch
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, TrainingArguments

    from training.speed import CountingTrainer, Throughput

    texts = ["great love", "awful hate", "meeting tuesday", "best happy"] * 4
    data = [{"input_ids": ids, "labels": i % 3} for i, ids in enumerate(tokenizer(texts)["input_ids"])]
    losses = {}
    for accumulation in (1, 2):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3)
        args = TrainingArguments(output_dir=str(tmp_path / str(accumulation)), max_steps=1, learning_rate=0.0,
                                 per_device_train_batch_size=16 // accumulation,
                                 gradient_accumulation_steps=accumulation, logging_steps=1,
                                 report_to="none", save_strategy="no", use_cpu=True)
        trainer = CountingTrainer(model=model, args=args, train_dataset=data, throughput=Throughput(),
                                  data_collator=DataCollatorWithPadding(tokenizer))
        trainer.train()
        losses[accumulation] = trainer.state.log_history[0]["loss"]
    assert losses[2] == pytest.approx(losses[1], rel=0.05)


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


@pytest.mark.parametrize("device, dtype, implementation, speedup, fp32", [
    ("cpu", torch.bfloat16, "sdpa", 0.2, True),    # the EPYC's bf16 flash attention: 0.14x-0.21x fp32
    ("cpu", torch.bfloat16, "sdpa", 0.9, False),   # within the margin: bf16 stays
    ("cpu", torch.bfloat16, "sdpa", None, False),  # not measured
    ("cpu", None, "sdpa", 0.2, False),             # fp32 training: nothing to change
    ("cpu", torch.bfloat16, "eager", 0.2, False),  # the model does not use sdpa
    ("cuda", torch.bfloat16, "sdpa", 0.2, False),  # GPUs' bf16 attention kernels are their fast ones
])
def test_attention_runs_in_fp32_only_on_a_cpu_whose_bf16_attention_is_slower(device, dtype, implementation, speedup,
                                                                           fp32):
    assert attention.attention_in_fp32(device, dtype, implementation, speedup) is fp32


@pytest.mark.parametrize("lengths, expected", [
    ([10] * 100, 10),
    ([30, 10, 10, 10], 30),      # the median text is 10 tokens, but 30's attention is 9 of the 12 parts of the work
    ([10] * 9 + [100], 100),     # one long text: 10,000 of 10,900
    ([64] * 90 + [512] * 10, 512),
    ([64] * 99 + [512], 64),     # 262,144 of 667,648: the short ones are most of the work
])
def test_the_attention_probes_length_is_where_the_attention_work_is(lengths, expected):
    assert attention.attention_length(lengths) == expected


def test_the_attention_probe_takes_the_models_heads_and_head_size():
    lengths = [12] * 3 + [40] * 5
    assert attention.probe_shape(BertConfig(hidden_size=768, num_attention_heads=12), lengths) == (12, 64, 40)
    assert attention.probe_shape(BertConfig(hidden_size=64, num_attention_heads=4), lengths) == (4, 16, 40)
    named = PretrainedConfig(hidden_size=512, num_attention_heads=8, head_dim=80)  # a head size of its own
    assert attention.probe_shape(named, lengths) == (8, 80, 40)
    assert attention.probe_shape(PretrainedConfig(), lengths) == (12, 32, 40)  # names neither: MiniLM's


def test_the_stage_measures_the_attention_at_the_runs_shapes_and_says_which(tiny_model_dir):
    """On a CPU in bf16 the probe times the run's shapes, computed here by hand from the tiny model's config and
    the lengths (its answer is then cached for exactly those), and the log names them; where nothing could
    change (fp32, a GPU, padding-free batches) nothing is timed."""
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    model.set_attn_implementation("sdpa")
    heads = model.config.num_attention_heads
    size = model.config.hidden_size // heads
    attention.bf16_attention_speedup.cache_clear()
    in_fp32, note = attention.choose(model, "cpu", torch.bfloat16, False, [[0] * 5, [0] * 7, [0] * 24, [0] * 24])
    assert note.endswith(f"as fast as fp32 here, {heads} heads of {size} at 24 tokens)"), note
    assert note.startswith("; attention in fp32 (bf16 attention measured " if in_fp32 else "; attention in bf16 (measured ")
    attention.bf16_attention_speedup(heads, size, 24)  # what the probe timed: these shapes, so a cached answer
    assert attention.bf16_attention_speedup.cache_info()[:2] == (1, 1)  # (hits, misses)
    attention.bf16_attention_speedup.cache_clear()
    assert attention.choose(model, "cpu", None, False, [[0] * 24]) == (False, "")
    assert attention.choose(model, "cuda", torch.bfloat16, False, [[0] * 24]) == (False, "")
    assert attention.choose(model, "cpu", torch.bfloat16, True, [[0] * 24]) == (False, "")  # padding-free batches
    assert attention.bf16_attention_speedup.cache_info().misses == 0


def test_fp32_attention_computes_softmax_attention_in_fp32_and_trains_with_it(tiny_model_dir, tokenizer, tmp_path):
    """Inside bf16 autocast, the registered attention returns (in bf16) softmax(q k^T / sqrt(d) + mask) v
    computed in fp64 from the same inputs, far closer than bf16 attention; Trainer trains with it and
    the model saved afterwards is back on sdpa."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8).bfloat16() for _ in range(3))
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[0, :, :, 4:] = False  # the first text is 4 tokens long
    scores = q.double() @ k.double().transpose(-1, -2) / 8**0.5
    expected = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v.double()
    module = torch.nn.Module()
    module.is_causal = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.fp32_sdpa(module, q, k, v, keep)
        bf16, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, keep)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 6, 4, 8)  # (batch, tokens, heads, head dim)
    reference = expected.transpose(1, 2)
    assert (out.double() - reference).abs().max() <= 2**-8 * reference.abs().max()  # one bf16 rounding
    assert (out.double() - reference).abs().max() <= (bf16.double() - reference).abs().max()

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3)
    seen = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(model.config._attn_implementation)

    data = [{"input_ids": ids, "labels": i % 3} for i, ids in enumerate(tokenizer(WORDS)["input_ids"])]
    args = dataclasses.replace(training_arguments(train_params(), MACHINE, str(tmp_path), "cpu", 8, 1), bf16=True,
                               max_steps=2, save_strategy="no", logging_strategy="no", eval_strategy="no")
    with attention.in_fp32(model):
        CountingTrainer(model=model, args=args, train_dataset=data, data_collator=make_collator(tokenizer, "cpu"),
                        throughput=Throughput(), callbacks=[Record()]).train()
    assert seen == [attention.NAME] * 2
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(KeyboardInterrupt), attention.in_fp32(model):  # back to sdpa however the block ends
        raise KeyboardInterrupt
    assert model.config._attn_implementation == "sdpa"
    with attention.in_fp32(model, on=False):
        assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("trained_in_fp32, device, dtype, fp32", [
    (True, "cpu", torch.bfloat16, True),      # predicted as it trained
    (True, "cpu", None, False),               # this CPU predicts in fp32: all of it is fp32 already
    (True, "cuda", torch.bfloat16, False),    # a GPU's bf16 attention kernels are its fast ones
    (False, "cpu", torch.bfloat16, False),    # trained with bf16 attention
    (None, "cpu", torch.bfloat16, False),     # a model saved before pipeline.json said
])
def test_rows_are_predicted_with_fp32_attention_where_the_run_trained_so(trained_in_fp32, device, dtype, fp32):
    assert attention.predicted_in_fp32(trained_in_fp32, device, dtype) is fp32


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


def test_the_gpu_profile_counts_each_operations_kernels_in_its_row_and_the_rest_as_idle():
    """bench.profile_step --gpu on hand-made profiler events of 2 steps: each row holds the GPU time of the
    kernels its operations launched themselves (not their callers' or their own CPU time), the last row the
    wall time no kernel ran."""
    from types import SimpleNamespace

    from bench import profile_step as ps

    def op(name, parent=None, cpu_us=50.0, gpu_us=0.0, kernels=0):
        return SimpleNamespace(name=name, cpu_parent=parent, device_type=torch.autograd.DeviceType.CPU,
                               self_cpu_time_total=cpu_us, self_device_time_total=gpu_us, kernels=[None] * kernels)

    backward = op("autograd::engine::evaluate_function: MmBackward0")
    step = op("Optimizer.step#AdamW.step")
    to = op("aten::to")
    events = [
        op("aten::addmm", gpu_us=3000.0, kernels=2),
        op("aten::mm", backward, gpu_us=5000.0, kernels=2),
        backward,
        op("aten::_flash_attention_backward", gpu_us=400.0, kernels=1),
        op("aten::_cudnn_attention_forward", gpu_us=600.0, kernels=1),  # the kernel torch 2.11 picks on an H200 in bf16
        op("aten::_fused_adamw_", step, gpu_us=400.0, kernels=1),
        step,
        op("aten::copy_", to, gpu_us=200.0, kernels=1),  # a batch moved to the GPU, or an autocast cast
        to,
        op("aten::add_", gpu_us=400.0, kernels=1),
        SimpleNamespace(name="sm90_xmma_gemm", cpu_parent=None, device_type=torch.autograd.DeviceType.CUDA,
                        self_cpu_time_total=0.0, self_device_time_total=3000.0, kernels=[]),  # counted by its op
    ]
    rows = ps.breakdown(events, wall_s=0.020, steps=2, gpu=True)  # 20 ms for 2 steps, 10 ms of kernels
    assert rows["matrix products (mm, addmm, bmm)"] == pytest.approx(4.0)
    assert rows["attention (SDPA kernels)"] == pytest.approx(0.5)
    assert rows["optimizer (AdamW, clipping, zero_grad)"] == pytest.approx(0.2)
    assert rows["dtype casts (autocast)"] == pytest.approx(0.1)
    assert rows["other elementwise and reductions"] == pytest.approx(0.2)
    assert rows[ps.REST] == pytest.approx(5.0)  # 10 ms per step of wall, 5 of kernels
    assert sum(rows.values()) == pytest.approx(10.0)
    assert ps.launches(events, steps=2) == (pytest.approx(0.25), 4.5)  # 10 ops x 50 us; 9 kernels
    cpu_rows = ps.breakdown(events, wall_s=0.020, steps=2)  # the same events on a CPU: their own CPU time
    assert cpu_rows["matrix products (mm, addmm, bmm)"] == pytest.approx(0.05)
    assert cpu_rows[ps.REST] == pytest.approx(10.0 - 0.25)
    assert ps.GPU_IDLE in ps.table({"bf16": (rows, 11.0)}, gpu=True)


def test_the_profiles_casts_split_by_whether_a_weight_is_cast():
    """bench.profile_step --casts on hand-made events of 2 steps: a cast's own time (the allocation and the
    copy under it included) counts as a weight's when the tensor it casts has a weight's shape, whichever
    operation of the cast records the shape; the optimizer's copies are the optimizer's, not casts."""
    from types import SimpleNamespace

    from bench import profile_step as ps

    def op(name, parent=None, shapes=(), us=0.0):
        return SimpleNamespace(name=name, cpu_parent=parent, device_type=torch.autograd.DeviceType.CPU,
                               self_cpu_time_total=us, input_shapes=[list(s) for s in shapes])

    forward = op("aten::_to_copy", op("aten::linear"), [(384, 1536), (), ()], us=100.0)  # a weight, to bf16
    backward = op("aten::_to_copy", op("ToCopyBackward0"), [(384, 1536)], us=100.0)  # its gradient, to fp32
    activation = op("aten::_to_copy", op("sdpa_fp32"), [(32, 12, 33, 32)], us=300.0)  # q to fp32
    step = op("Optimizer.step#AdamW.step")
    events = [forward, op("aten::empty_strided", forward, [(), ()], us=200.0),
              op("aten::copy_", forward, [(384, 1536), (384, 1536), ()], us=700.0),
              backward, op("aten::copy_", backward, [(384, 1536), (384, 1536), ()], us=900.0),
              activation, op("aten::empty_strided", activation, [()], us=100.0),
              op("aten::copy_", activation, [(32, 12, 33, 32), (32, 12, 33, 32), ()], us=1600.0),
              step, op("aten::copy_", step, [(384, 1536), (384, 1536), ()], us=5000.0)]
    split = ps.cast_split(events, steps=2, weight_shapes={(384, 1536), (1536, 384), (384,)})
    assert split == {ps.WEIGHTS: pytest.approx(1.0), ps.OTHERS: pytest.approx(1.0)}  # (100+200+700+100+900) us / 2
    assert ps.breakdown(events, wall_s=0.01, steps=2)[ps.CASTS] == pytest.approx(2.0)  # the same row, whole


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


MAPS = """55d0c8a00000-55d0c8a01000 r--p 00000000 00:2e 123 /usr/bin/python3.11
7f1a2c000000-7f1a2c021000 rw-p 00000000 00:00 0
7f1a2d1e0000-7f1a2d1e9000 r-xp 00000000 00:2e 456 /usr/lib/x86_64-linux-gnu/{lib}
7f1a2d400000-7f1a2d428000 r--p 00000000 00:2e 789 /usr/lib/x86_64-linux-gnu/libc.so.6
7ffd5b1f2000-7ffd5b213000 rw-p 00000000 00:00 0 [stack]"""


@pytest.mark.parametrize("library, found", [
    ("libtcmalloc_minimal.so.4.5.10", "tcmalloc"),
    ("libtcmalloc.so.4", "tcmalloc"),
    ("libjemalloc.so.2", "jemalloc"),
    ("libm.so.6", None),                      # glibc's malloc: none of them mapped
    ("libtorch_cpu_tcmalloc_stub.so", None),  # a name that only contains one
])
def test_the_allocator_is_read_off_the_libraries_mapped(library, found):
    assert allocator.preloaded(MAPS.format(lib=library)) == found


@pytest.mark.parametrize("device, running, library, says", [
    ("cpu", "glibc", "libtcmalloc_minimal.so.4", "LD_PRELOAD=libtcmalloc_minimal.so.4 dvc repro"),
    ("cpu", "glibc", None, "apt-get install libtcmalloc-minimal4, then LD_PRELOAD=libtcmalloc_minimal.so.4 dvc repro"),
    ("cpu", "tcmalloc", "libtcmalloc_minimal.so.4", ""),  # already under it
    ("cpu", "jemalloc", "libtcmalloc_minimal.so.4", ""),  # the user's own choice
    ("cpu", None, None, ""),                              # not Linux: cannot tell
    ("cuda", "glibc", "libtcmalloc_minimal.so.4", ""),    # measured on a CPU only
])
def test_a_cpu_run_on_glibc_malloc_is_told_how_to_train_under_tcmalloc(device, running, library, says):
    line = allocator.note(device, running, library)
    assert (says == "" and line == "") or (says in line and "1.12x" in line), line


def test_a_process_started_under_tcmalloc_says_so_and_one_without_says_glibc():
    """The real loader: the test's process, and a child started with LD_PRELOAD set to the library found here
    (scripts/install-system-packages.sh installs it)."""
    library = allocator.tcmalloc_library()
    assert library, "no tcmalloc installed: bash scripts/install-system-packages.sh"
    script = "from training.allocator import running\nprint(running())"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | \
        {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = {preload: subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                    env=env | ({"LD_PRELOAD": library} if preload else {}))
            for preload in (False, True)}
    assert all(done.returncode == 0 for done in runs.values()), [done.stderr for done in runs.values()]
    assert [runs[False].stdout.strip(), runs[True].stdout.strip()] == ["glibc", "tcmalloc"]


@pytest.mark.parametrize("pythonpath, expected", [
    (None, "{repo}"),
    ("", "{repo}"),
    ("/tmp/site", "{repo}" + os.pathsep + "/tmp/site"),  # the GPU machine's packages, kept after the repo
])
def test_the_benchmarks_tokenize_stage_keeps_the_pythonpath_it_was_given(pythonpath, expected):
    from bench.common import REPO
    from bench.tokenize_memory import stage_environment

    environ = {"HOME": "/root"} if pythonpath is None else {"HOME": "/root", "PYTHONPATH": pythonpath}
    assert stage_environment(environ) == {"HOME": "/root", "PYTHONPATH": expected.format(repo=REPO)}
    assert environ.get("PYTHONPATH") == pythonpath  # the caller's own left as it was
