"""Where users extend the pipeline, each change is made in one place: a head of their own is the model class
in modeling/models.py (training loads it with a new head, predicting loads the trained folder with it); a
loss is a function and a line in training/losses.py (tests/test_techniques.py trains with one); a preprocessing
step is a function and a line in reading/cleaning.py (tests/test_clean_properties.py checks each one)."""
import numpy as np
import torch
from transformers import BertModel, BertPreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

from modeling import models
from predicting.inference import fold_outputs, load_fold
from tasks.shapes import SHAPES

LABELS = ["negative", "neutral", "positive"]


class MeanPooledClassifier(BertPreTrainedModel):
    """A head of one's own: the mean of the last layer's tokens (not the first token's pooled output) through
    one linear layer."""

    def __init__(self, config):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.score = torch.nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, **kwargs):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return SequenceClassifierOutput(logits=self.score((hidden * mask).sum(1) / mask.sum(1)))


def test_a_head_of_ones_own_is_the_model_class_for_training_and_predicting(monkeypatch, tiny_model_dir, tokenizer,
                                                                           tmp_path):
    monkeypatch.setattr(models, "MODEL_CLASS", MeanPooledClassifier)
    torch.manual_seed(0)
    _, model = models.load_model(str(tiny_model_dir), LABELS)
    assert type(model) is MeanPooledClassifier and model.config.num_labels == 3
    base = BertModel.from_pretrained(tiny_model_dir)  # the encoder comes from the checkpoint, the head is new
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, base.embeddings.word_embeddings.weight)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    run = {"kind": "classification", "precision": "float32", "target_scale": None, "predict_batch_size": 4,
           "labels": LABELS}
    _, trained = load_fold(tmp_path, run, "cpu")
    assert type(trained) is MeanPooledClassifier
    sequences = tokenizer(["great love", "awful broken phone today", "meeting"])["input_ids"]
    outputs = fold_outputs(tokenizer, trained, run, sequences, None, "cpu")
    with torch.no_grad():  # each text alone, no padding: the mean over its own tokens, by hand
        by_hand = [model.score(model.bert(torch.tensor([ids])).last_hidden_state.mean(1))[0] for ids in sequences]
    expected = SHAPES["classification"].activate(torch.stack(by_hand).numpy())
    assert np.abs(outputs - expected).max() < 1e-5
