"""Correctness of the speed features: dynamic padding, length grouping, the batch-size finder,
max_length auto, the throughput counters and the memory allocator's line. Speed itself is measured by
bench/benchmark.py; the precision a step trains in has its own tests (test_precision.py), and the bench
tools' logic is in test_bench.py."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForSequenceClassification

from modeling.models import make_collator
from pipeline.settings import PipelineError, load_params
from reading.tokens import auto_max_length, model_limit, pack_sequences, unpack_sequences
from training.arguments import training_arguments
from training.batch_size import (
    choose_batch_size,
    cuda_fits,
    find_batch_size,
    memory_budget,
    pick_batch_size,
    use_expandable_segments,
)
from training.rows import TokenizedDataset
from training.settings import MACHINE_PARAMS, TRAIN_PARAMS
from training.speed import Throughput, allocator_in, allocator_note, running_allocator
from training.trainer import CountingTrainer

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
    """params.yaml's train section, with the rate train.lr auto gives models of this size (in the stage,
    train() picks it once the model is loaded)."""
    return {**load_params("train", TRAIN_PARAMS), "lr": 1e-4, **changes}


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


def test_a_cpu_takes_the_batch_asked_unprobed_and_a_gpu_allocator_setting_made_by_the_user_wins(monkeypatch):
    sequences = [[5] * 7, [5] * 13, [5] * 9]
    assert pick_batch_size(None, sequences, "auto", 32, "bf16", "cpu") == (32, 1, 13)  # no model needed
    assert pick_batch_size(None, sequences, 8, 32, "no", "cpu") == (8, 4, 13)
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    use_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")
    use_expandable_segments()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


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
    assert cuda_fits(model, 8, [1000] * 64, torch.bfloat16)
    assert not cuda_fits(model, 2**22, [1000] * 128, None)  # ~500M tokens: an out-of-memory error, caught
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

    from training.speed import Throughput
    from training.trainer import CountingTrainer

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


def test_the_allocator_is_read_from_the_libraries_a_process_maps_and_the_log_gives_the_command():
    maps = ("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.9\n"
            "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator_in(maps) == "tcmalloc"
    assert allocator_in(maps.replace("libtcmalloc_minimal", "libjemalloc")) == "jemalloc"
    assert allocator_in(maps.splitlines()[1]) == "glibc"
    assert running_allocator() in ("glibc", "tcmalloc", "jemalloc")  # this process: what LD_PRELOAD gave it
    line = allocator_note("cpu", "glibc", "libtcmalloc_minimal.so.4")
    assert line.startswith("memory allocator: glibc's malloc;") and line.endswith(
        ": LD_PRELOAD=libtcmalloc_minimal.so.4 dvc repro")
    assert "apt-get install libtcmalloc-minimal4, then LD_PRELOAD=" in allocator_note("cpu", "glibc", None)
    assert allocator_note("cuda", "glibc", None) == allocator_note("cpu", "tcmalloc", None) == ""
