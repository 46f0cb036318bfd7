"""Padding-free batches (stages/unpadded.py) compute what padded batches compute: the same logits,
loss and gradients, on a tiny random BERT and on the embedded MiniLM, with texts of 1 token to
the longest. The GPU kernel (varlen_attn) cannot run here; its calling convention is checked
with a stand-in."""
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import (AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification,
                          BertForTokenClassification, DataCollatorWithPadding, RobertaConfig,
                          RobertaForSequenceClassification, Trainer, TrainingArguments)

from bench.benchmark import time_training_steps
from stages import unpadded
from stages.models import resolve_model

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


def test_varlen_path_calls_varlen_attn_as_documented(monkeypatch):
    """varlen_attn's contract: (T, heads, head_dim) tensors, int32 cumulative lengths for queries and
    keys, the longest length for each; a stand-in computes that contract with SDPA."""
    calls = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k):
        calls.append((q.shape, cu_q.dtype, max_q))
        assert cu_q is cu_k and max_q == max_k
        heads_first = (x.transpose(0, 1) for x in (q, k, v))
        return per_text_sdpa(*heads_first, cu_q.diff().tolist()).transpose(0, 1)

    monkeypatch.setattr(unpadded, "varlen_attn", stand_in)
    monkeypatch.setattr(unpadded, "uses_varlen", lambda q, dropout, scale: True)
    torch.manual_seed(1)
    lengths = [5, 1, 9]
    q, k, v = torch.randn(3, 1, 2, 15, 8).unbind(0)
    cu_seqlens = unpadded.collate([{"input_ids": [0] * n} for n in lengths])["cu_seq_lens_q"]
    out, _ = unpadded.packed_attention(None, q, k, v, None, cu_seq_lens_q=cu_seqlens, max_length_q=9)
    assert calls == [(torch.Size([15, 2, 8]), torch.int32, 9)]
    assert (out - per_text_sdpa(q[0], k[0], v[0], lengths).transpose(0, 1)[None]).abs().max() < 1e-6


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
    rates = time_training_steps(model, examples(tokenizer), batch_size=3, steps=2,
                                padded_collator=DataCollatorWithPadding(tokenizer), warmup=1)
    assert rates["padded"] > 0 and rates["unpadded"] > 0
    assert rates["attention"] == "per-text SDPA"  # CPU, fp32, attention dropout 0.1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
