"""What differs between model families, in one place: which inputs a model takes, how its batches are
padded, and how a decoder is read as a classifier.

- Segment ids (token_type_ids) go to a model only where its tokenizer makes them and the model has more
  than one token type: BERT and ELECTRA take them; RoBERTa and XLM-R have one type, so klue/roberta's
  BERT tokenizer, which gives a pair's second text type 1, would index past RoBERTa's single row;
  DeBERTa-v3 has none (type_vocab_size 0).
- Every batch is padded on the right. A decoder (Qwen, Llama, Gemma) reads a text as a classifier at its
  last token: transformers' ForSequenceClassification heads take the last token that is not padding,
  which needs config.pad_token_id. Padded on the right, each text's positions start at 0 whatever the
  batch, so a row's output does not depend on the rows batched with it.
- A tokenizer without a pad token (Llama 3, Mistral) pads with its end-of-text token, as transformers'
  own examples do; the padding positions are masked, so which token pads them does not matter.
"""
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from pipeline.settings import PipelineError


def takes_segment_ids(tokenizer, config, pair):
    """Whether the token ids of text pairs go with their segment ids (token_type_ids) to this model."""
    return pair and "token_type_ids" in tokenizer.model_input_names and getattr(config, "type_vocab_size", 2) > 1


def is_decoder(config):
    """A decoder-only language model (GPT, Llama, Qwen, Gemma, Mistral, ...): a causal LM that has no masked
    LM (BERT and RoBERTa have both)."""
    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def pad_token_for(tokenizer, name):
    """The tokenizer, padding on the right with a pad token: its own, else its end-of-text token. A one-line
    error naming the model when it has neither."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise PipelineError(f"model.name {name!r}: its tokenizer has no pad token and no end-of-text token to pad "
                                "with; add one (tokenizer.add_special_tokens({'pad_token': ...})) and save it with the model")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def set_pad_token(config, tokenizer):
    """config.pad_token_id from the tokenizer where the config names none (Qwen2's and Llama's base configs),
    and a decoder's always: its head finds each text's last token as the last one that is not this id, so it
    must be the id the batches are padded with. An encoder's is kept (RoBERTa numbers positions by it)."""
    if config.pad_token_id is None or is_decoder(config):
        config.pad_token_id = tokenizer.pad_token_id
    return config
