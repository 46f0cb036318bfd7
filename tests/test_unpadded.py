"""Padding-free batches (training/unpadded.py) compute what padded batches compute: the same logits,
loss and gradients, on a tiny random BERT and on the embedded MiniLM, with texts of 1 token to
the longest. The GPU kernel (PyTorch's varlen_attn) runs only on a GPU: there the real kernel is
compared with the padded model; on a CPU its call is checked against its real signature."""
import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    DataCollatorWithPadding,
    RobertaConfig,
    RobertaForSequenceClassification,
    Trainer,
    TrainingArguments,
)

from bench.benchmark import time_training_steps
from training import first_token, unpadded
from modeling.models import resolve_model

LONG = " ".join(["the flight was awful and late again but the crew were great"] * 12)


def examples(tokenizer, max_length=120):
    """Texts of 1, 2, 3, a few and max_length tokens, in mixed order, with labels 0-2."""
    texts = ["great", "", "the flight was late", LONG, "really happy with my new phone today"]
    ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    ids[0] = ids[0][:1]  # [CLS] alone: 1 token; "" is [CLS] [SEP]: 2; "great" would be 3
    ids.append(tokenizer("great")["input_ids"])
    return [{"input_ids": x, "labels": i % 3} for i, x in enumerate(ids)]


def tiny_classifier(tiny_model_dir, dropout=0.1):
    torch.manual_seed(0)  # the classifier head is new: the same one every time
    return BertForSequenceClassification.from_pretrained(
        tiny_model_dir, num_labels=3, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)


def padded_output(model, tokenizer, batch):
    return model(**DataCollatorWithPadding(tokenizer)(batch))


def per_text_sdpa(q, k, v, lengths):
    """The reference: each text's (heads, n, head_dim) slice through SDPA on its own."""
    out, start = [], 0
    for n in lengths:
        out.append(F.scaled_dot_product_attention(*(x[:, start:start + n] for x in (q, k, v))))
        start += n
    return torch.cat(out, dim=1)  # (heads, T, head_dim)


def test_collate_packs_texts_into_one_row():
    batch = unpadded.collate([{"input_ids": [101, 7, 102], "labels": 2}, {"input_ids": [101], "labels": 0},
                              {"input_ids": [101, 5, 6, 9, 102], "labels": 1}])
    assert batch["input_ids"].tolist() == [[101, 7, 102, 101, 101, 5, 6, 9, 102]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 4, 9] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["cu_seq_lens_k"] is batch["cu_seq_lens_q"]
    assert batch["max_length_q"] == batch["max_length_k"] == 5 and isinstance(batch["max_length_q"], int)
    assert batch["labels"].tolist() == [2, 0, 1]
    assert "labels" not in unpadded.collate([{"input_ids": [101]}])
    with pytest.raises(ValueError, match="at least one token"):
        unpadded.collate([{"input_ids": [101]}, {"input_ids": []}])


def test_attention_stays_inside_each_text():
    torch.manual_seed(0)
    lengths = [1, 2, 3, 17, 40]
    q, k, v = torch.randn(3, 1, 4, sum(lengths), 16).unbind(0)  # (batch 1, heads, T, head_dim)
    cu_seqlens = unpadded.collate([{"input_ids": [0] * n} for n in lengths])["cu_seq_lens_q"]
    out, weights = unpadded.packed_attention(None, q, k, v, None, cu_seq_lens_q=cu_seqlens, max_length_q=40)
    expected = per_text_sdpa(q[0], k[0], v[0], lengths).transpose(0, 1)[None]  # (1, T, heads, head_dim)
    assert out.shape == expected.shape and weights is None
    assert (out - expected).abs().max() < 1e-6
    assert not unpadded.uses_varlen(q[0].transpose(0, 1), 0.0, 16 ** -0.5)  # CPU, fp32: the exact path


@pytest.mark.skipif(unpadded.varlen_attn is None, reason="this torch has no varlen_attn (torch < 2.10)")
def test_varlen_path_calls_varlen_attn_as_its_signature_says(monkeypatch):
    """The GPU path's call, on a CPU: the arguments packed_attention passes must bind to the real
    varlen_attn's parameters as their names say ((T, heads, head_dim) tensors, int32 cumulative
    lengths for queries and keys, the longest text), and its output must become the attention's.
    A stand-in with the real signature computes varlen_attn's result with SDPA per text."""
    real = inspect.signature(unpadded.varlen_attn)
    calls = []

    def stand_in(*args, **kwargs):
        bound = real.bind(*args, **kwargs).arguments  # TypeError if the call does not fit the real one
        calls.append(bound)
        heads_first = (bound[name].transpose(0, 1) for name in ("query", "key", "value"))
        return per_text_sdpa(*heads_first, bound["cu_seq_q"].diff().tolist()).transpose(0, 1)

    monkeypatch.setattr(unpadded, "varlen_attn", stand_in)
    monkeypatch.setattr(unpadded, "uses_varlen", lambda q, dropout, scale: True)  # the GPU's choice, on a CPU
    torch.manual_seed(1)
    lengths = [5, 1, 9]
    q, k, v = torch.randn(3, 1, 2, 15, 8).unbind(0)
    cu_seqlens = unpadded.collate([{"input_ids": [0] * n} for n in lengths])["cu_seq_lens_q"]
    out, _ = unpadded.packed_attention(None, q, k, v, None, cu_seq_lens_q=cu_seqlens, max_length_q=9)
    (call,) = calls
    assert [call[name].shape for name in ("query", "key", "value")] == [torch.Size([15, 2, 8])] * 3
    assert torch.equal(call["key"], k[0].transpose(0, 1)) and torch.equal(call["value"], v[0].transpose(0, 1))
    assert call["cu_seq_q"].dtype == torch.int32 and call["cu_seq_q"].tolist() == [0, 5, 6, 15]
    assert torch.equal(call["cu_seq_k"], call["cu_seq_q"]) and call["max_q"] == call["max_k"] == 9
    assert (out - per_text_sdpa(q[0], k[0], v[0], lengths).transpose(0, 1)[None]).abs().max() < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available() or unpadded.varlen_attn is None,
                    reason="varlen_attn (FlashAttention) runs on a CUDA GPU only")
@pytest.mark.parametrize("real_model", [False, True], ids=["tiny", "minilm"])
def test_varlen_attn_on_the_gpu_encodes_as_the_padded_model(real_model, tiny_model_dir, tokenizer, monkeypatch):
    """The real kernel, as training on a GPU calls it (bf16 autocast, no attention dropout), against
    the padded model: each text's pooled encoding, which the classifier head reads. The logits of a
    random head are too small (~0.05) for bf16's rounding to be told from an error there."""
    if real_model:
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(resolve_model("minilm"), num_labels=3)
    else:
        model = tiny_classifier(tiny_model_dir)
    model = model.cuda().eval()
    kernel, calls, pooled = unpadded.varlen_attn, [], []

    def counted(*args, **kwargs):  # the real kernel, counted: the per-text SDPA path would pass as well
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(unpadded, "varlen_attn", counted)
    batch = examples(tokenizer)
    padded_batch = {k: v.cuda() for k, v in DataCollatorWithPadding(tokenizer)(batch).items()}
    packed_batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in unpadded.collate(batch).items()}
    model.bert.pooler.register_forward_hook(lambda module, args, out: pooled.append(out.float()))
    with torch.no_grad():
        with first_token.full_fp32_matmuls():  # fp32 without TF32: what both bf16 paths approximate
            model(**padded_batch)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(**padded_batch)
            packed_logits = unpadded.UnpaddedClassifier(model)(**packed_batch).logits
    assert len(calls) == model.config.num_hidden_layers, "varlen_attn was not used in every layer"
    assert packed_logits.shape == (len(batch), 3)
    reference, padded, packed = pooled[0], pooled[1], pooled[-1]  # the wrapper pools each text's [CLS] last
    assert packed.shape == reference.shape == (len(batch), model.config.hidden_size)
    # bf16 rounds at the 3rd significant digit, in another order in each path: the packed encodings must
    # be as close to fp32 as the padded ones (measured on a CPU with the per-text path standing in for the
    # kernel: 0.3-0.5% both; attention leaking across texts: 1.4% tiny, 60% MiniLM)
    padded_error, packed_error = (float(torch.linalg.norm(x - reference) / torch.linalg.norm(reference))
                                  for x in (padded, packed))
    assert packed_error <= 2 * padded_error + 1e-3, (packed_error, padded_error)


@pytest.mark.parametrize("real_model", [False, True], ids=["tiny", "minilm"])
def test_logits_equal_the_padded_models(real_model, tiny_model_dir, tokenizer):
    if real_model:
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(resolve_model("minilm"), num_labels=3)
    else:
        model = tiny_classifier(tiny_model_dir)
    model.eval()
    batch = examples(tokenizer)
    with torch.no_grad():
        padded = padded_output(model, tokenizer, batch)
        packed = unpadded.UnpaddedClassifier(model)(**unpadded.collate(batch))
        padded_after = padded_output(model, tokenizer, batch)  # the wrapped model still takes padded batches
    assert packed.logits.shape == (len(batch), 3)
    assert (packed.logits - padded.logits).abs().max() < 1e-5
    assert (packed.loss - padded.loss).abs() < 1e-5
    assert (padded_after.logits - padded.logits).abs().max() < 1e-5


def test_a_training_step_gives_the_padded_loss_and_gradients(tiny_model_dir, tokenizer):
    model = tiny_classifier(tiny_model_dir, dropout=0.0).train()
    reference = copy.deepcopy(model)
    batch = examples(tokenizer)
    padded_output(reference, tokenizer, batch).loss.backward()
    wrapper = unpadded.UnpaddedClassifier(model).train()
    wrapper(**unpadded.collate(batch)).loss.backward()
    gradients = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert (p.grad - gradients[name].grad).abs().max() <= 1e-5 * (1 + gradients[name].grad.abs().max()), name


def test_the_wrapper_shares_the_models_weights(tiny_model_dir, tokenizer, tmp_path):
    model = tiny_classifier(tiny_model_dir)
    wrapper = unpadded.UnpaddedClassifier(model)
    assert {id(p) for p in wrapper.parameters()} == {id(p) for p in model.parameters()}
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.1)
    wrapper(**unpadded.collate(examples(tokenizer))).loss.backward()
    optimizer.step()
    model.save_pretrained(tmp_path)
    saved = BertForSequenceClassification.from_pretrained(tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved.parameters()))
    assert saved.config._attn_implementation != unpadded.ATTENTION  # a private setting, not saved


def test_unsupported_models_are_reported():
    config = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 32}
    assert unpadded.supports(BertForSequenceClassification(BertConfig(**config, num_labels=3)))
    unsupported = [RobertaForSequenceClassification(RobertaConfig(**config, num_labels=3)),
                   BertForTokenClassification(BertConfig(**config, num_labels=3)),
                   BertForSequenceClassification(BertConfig(**config, num_labels=1)),  # regression
                   BertForSequenceClassification(BertConfig(**config, num_labels=3,
                                                            problem_type="multi_label_classification"))]
    for model in unsupported:
        assert not unpadded.supports(model), type(model).__name__
    with pytest.raises(ValueError, match="not supported"):
        unpadded.UnpaddedClassifier(unsupported[0])


def test_trainer_trains_and_evaluates_the_wrapper(tiny_model_dir, tokenizer, tmp_path):
    model = tiny_classifier(tiny_model_dir)
    before = model.classifier.weight.detach().clone()
    data = examples(tokenizer) * 2
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             max_steps=2, learning_rate=1e-2, use_cpu=True, report_to="none", save_strategy="no",
                             logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=unpadded.UnpaddedClassifier(model), args=args, train_dataset=data, eval_dataset=data,
                      data_collator=unpadded.collate)
    trainer.train()
    assert not torch.equal(model.classifier.weight, before)  # trained the model itself
    predictions = trainer.predict(data)
    assert predictions.predictions.shape == (len(data), 3)
    assert predictions.label_ids.tolist() == [e["labels"] for e in data]  # in order: nothing dropped


def test_timing_runs_both_modes_and_leaves_the_weights(tiny_model_dir, tokenizer):
    model = tiny_classifier(tiny_model_dir)
    before = [p.detach().clone() for p in model.parameters()]
    batches = {"padded": 0, "unpadded": 0}

    def count(module, args, kwargs):  # both modes run the encoder; a packed row carries cu_seq_lens_q
        batches["unpadded" if "cu_seq_lens_q" in kwargs else "padded"] += 1

    model.bert.register_forward_pre_hook(count, with_kwargs=True)
    rates = time_training_steps(model, examples(tokenizer), batch_size=3, steps=2,
                                padded_collator=DataCollatorWithPadding(tokenizer), warmup=1)
    assert set(rates) == {"padded", "unpadded", "attention"}
    assert batches == {"padded": 3, "unpadded": 3}, batches  # 1 warmup + 2 timed steps in each mode
    assert rates["attention"] == "per-text SDPA"  # CPU, fp32, attention dropout 0.1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
