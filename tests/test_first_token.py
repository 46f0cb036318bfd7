"""The last layer computing the first token only (training/first_token.py) gives the model's own logits and
gradients, checked against the model's own forward with its full last layer; it is taken only where
that holds, and the layer then really computes one token."""
import pytest
import torch
import torch.nn.functional as F
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from training import attention, first_token, lora

TEXTS = ["great", "", "the flight was late and the crew were rude", "really happy with my new phone today",
         "awful", "the report is due on tuesday, said the schedule of the meeting"]


def tiny_bert(implementation="sdpa", cls=BertForSequenceClassification, config=BertConfig, **kwargs):
    torch.manual_seed(0)
    settings = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
                    max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, **kwargs)
    model = cls(config(**settings))
    model.set_attn_implementation(implementation)
    return model


@pytest.fixture
def batch(tokenizer):
    """Texts of 2 to 17 tokens padded to the longest: most rows hold padding."""
    encoded = DataCollatorWithPadding(tokenizer)([{"input_ids": x} for x in tokenizer(TEXTS)["input_ids"]])
    assert (encoded["attention_mask"] == 0).any()
    return {**encoded, "labels": torch.tensor([0, 1, 2, 0, 1, 2])}


def logits_and_gradients(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def full_and_first_token(model, batch):
    """(the model's own logits and gradients, the same with its last layer computing the first token)."""
    layer = first_token.last_layer(model)
    assert layer is not None
    full = logits_and_gradients(model, batch)
    first_token.enable(layer)
    return full, logits_and_gradients(model, batch)


def assert_same(full, cut):
    (full_logits, full_grads), (cut_logits, cut_grads) = full, cut
    torch.testing.assert_close(cut_logits, full_logits, rtol=1e-5, atol=1e-6)
    assert cut_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(cut_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_logits_and_gradients_are_the_full_layers(batch, implementation):
    model = tiny_bert(implementation).train()
    assert_same(*full_and_first_token(model, batch))


def test_the_same_with_gradient_checkpointing_lora_and_fp32_attention(batch):
    model = tiny_bert().train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.set_attn_implementation(attention.NAME)
    assert_same(*full_and_first_token(lora.wrap(model, 4, 8, ["query", "value"]), batch))


def test_roberta_too(batch):
    model = tiny_bert(cls=RobertaForSequenceClassification, config=RobertaConfig, pad_token_id=0).train()
    assert_same(*full_and_first_token(model, batch))


def test_the_last_layers_feed_forward_sees_one_token_per_text(batch, tokenizer):
    model = tiny_bert()
    shapes = []
    for layer in model.bert.encoder.layer:
        layer.intermediate.register_forward_hook(lambda module, inputs, output: shapes.append(tuple(inputs[0].shape[:2])))
    checked = first_token.check_batch(DataCollatorWithPadding(tokenizer), tokenizer(TEXTS)["input_ids"])
    assert first_token.choose(model, checked).startswith("last layer: the first token only")
    shapes.clear()
    model(**batch)
    tokens = batch["input_ids"].shape[1]
    assert shapes == [(6, tokens), (6, tokens), (6, 1)]


def test_training_steps_reach_the_weights_of_the_full_model(batch):
    """Five AdamW steps of each reach the same weights."""
    weights = []
    for cut in (False, True):
        model = tiny_bert().train()
        if cut:
            first_token.enable(first_token.last_layer(model))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(5):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        weights.append(model.state_dict())
    assert weights[0].keys() == weights[1].keys()  # the saved model is the model's own
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_the_check_batch_is_real_rows_cut_short_and_padded(tokenizer):
    sequences = [tokenizer(text)["input_ids"] for text in [" ".join(["word"] * 40)] * 10]
    checked = first_token.check_batch(DataCollatorWithPadding(tokenizer), sequences)
    assert checked["input_ids"].shape == (8, 32)
    assert checked["attention_mask"].sum(1).tolist() == [4, 8, 12, 16, 20, 24, 28, 32]
    assert (checked["input_ids"][:, 0] == tokenizer.cls_token_id).all()
    assert first_token.check_batch(DataCollatorWithPadding(tokenizer), []) is None


def test_a_head_that_reads_every_token_keeps_the_full_layer(batch):
    model = tiny_bert()
    pooler = model.bert.pooler
    pooler.forward = lambda hidden: pooler.activation(pooler.dense(hidden.mean(1)))  # mean pooling
    note = first_token.choose(model, batch)
    assert "head reads more than the first token" in note
    assert "forward" not in vars(first_token.last_layer(model))
    assert model.training  # left as it was


def test_other_layers_and_packed_batches_keep_the_full_layer(batch):
    torch.manual_seed(0)
    distil = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=4,
                                                                  hidden_dim=48, num_labels=3))
    assert first_token.last_layer(distil) is None
    assert "are not BERT's" in first_token.choose(distil, batch)
    model = tiny_bert()
    assert "padding-free" in first_token.choose(model, batch, packed=True)
    assert "forward" not in vars(first_token.last_layer(model))


def test_choosing_again_checks_against_the_full_layer(batch):
    model = tiny_bert()
    layer = first_token.last_layer(model)
    assert first_token.choose(model, batch).startswith("last layer: the first token only")
    pooler = model.bert.pooler
    pooler.forward = lambda hidden: pooler.activation(pooler.dense(hidden.mean(1)))
    # with the layer already cut, its logits would agree with themselves; the full layer's do not
    assert "head reads more" in first_token.choose(model, batch)
    assert "forward" not in vars(layer)
    assert F.softmax(model(**batch).logits, -1).shape == (6, 3)


def test_choosing_after_transformers_set_tf32(batch):
    """transformers sets TF32 through torch's fp32_precision (TrainingArguments' tf32, train.tf32 true as the
    benchmark's defaults set it before choosing); the check then still runs, and puts the setting back."""
    from transformers.utils.import_utils import enable_tf32
    before = torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    try:
        enable_tf32.__wrapped__(True)  # lru_cached: once per process otherwise
        with pytest.raises(RuntimeError):  # what the H200 run met: the older flag cannot be read now
            torch.backends.cuda.matmul.allow_tf32
        assert first_token.choose(tiny_bert(), batch).startswith("last layer: the first token only")
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = before
