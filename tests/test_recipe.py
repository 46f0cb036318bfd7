"""train.dropout and train.freeze_embeddings: what they change in the model that is trained."""
import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    DebertaV2Config,
    DistilBertConfig,
    ElectraConfig,
    ModernBertConfig,
    RobertaConfig,
)

from modeling.models import dropout_settings, load_model

TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64)
CONFIGS = {
    "bert": lambda: BertConfig(**TINY),
    "roberta": lambda: RobertaConfig(**TINY, pad_token_id=1),
    "electra": lambda: ElectraConfig(**TINY, embedding_size=32),
    "deberta-v2": lambda: DebertaV2Config(**TINY),
    "distilbert": lambda: DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                           max_position_embeddings=64),
    # ModernBERT's dropouts default to 0, where a setting missed would go unnoticed: 0.1 like the others
    "modernbert": lambda: ModernBertConfig(**TINY, pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2,
                                           sep_token_id=3, attention_dropout=0.1, embedding_dropout=0.1,
                                           mlp_dropout=0.1, classifier_dropout=0.1),
}


def two_training_passes(model, seed=0):
    """The logits of two forward passes in training mode over the same batch."""
    torch.manual_seed(seed)
    input_ids = torch.randint(4, 100, (4, 12))
    model.train()
    with torch.no_grad():
        return model(input_ids=input_ids).logits, model(input_ids=input_ids).logits


@pytest.mark.parametrize("architecture", CONFIGS)
def test_dropout_reaches_every_dropout_of_the_model(architecture):
    config = CONFIGS[architecture]()
    settings = dropout_settings(config, 0.5)
    assert settings, config
    config.update(settings)
    torch.manual_seed(0)
    first, second = two_training_passes(AutoModelForSequenceClassification.from_config(config))
    assert not torch.equal(first, second)  # dropout at 0.5 draws other masks each pass

    config.update(dropout_settings(config, 0.0))
    torch.manual_seed(0)
    first, second = two_training_passes(AutoModelForSequenceClassification.from_config(config))
    # any dropout the settings missed would still drop (at 0.5) and make the passes differ
    assert torch.equal(first, second)


def test_load_model_sets_dropout_and_freezes_only_the_token_embeddings(tiny_model_dir, tmp_path):
    _, model = load_model(str(tiny_model_dir), ["a", "b", "c"], dropout=0.0, freeze_embeddings=True)
    first, second = two_training_passes(model)
    assert torch.equal(first, second)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"bert.embeddings.word_embeddings.weight"}
    model.save_pretrained(tmp_path)  # the dropout trained with is recorded with the model
    assert '"hidden_dropout_prob": 0.0' in (tmp_path / "config.json").read_text()

    _, model = load_model(str(tiny_model_dir), ["a", "b", "c"])  # the defaults of load_model: as the model has it
    first, second = two_training_passes(model)
    assert not torch.equal(first, second)
    assert model.config.hidden_dropout_prob == 0.1
    assert all(p.requires_grad for p in model.parameters())
