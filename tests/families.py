"""Tiny random models of the families competitors bring, each saved with the kind of tokenizer that family
ships (no hub): WordPiece with [CLS]/[SEP] and segment ids (BERT, ELECTRA, DistilBERT, and RoBERTa with
a BERT tokenizer and one token type, as klue/roberta ships), SentencePiece-like Unigram (DeBERTa-v3 with
no token types, XLM-R with <s>/</s>, Gemma with <bos> and a <pad>), and byte-level BPE (ModernBERT, and the
decoders Qwen2, whose tokenizer has a pad token but whose config has none, and Llama 3, which has
neither). The tokenizers are trained here on the words the test data uses, so every family reads them
as whole tokens; the models are saved as their hub checkpoints are (an encoder with its masked-LM head,
a decoder with its causal-LM head), for the pipeline to put its own head on."""
import json
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (AutoModelForCausalLM, AutoModelForMaskedLM, BertConfig, DebertaV2Config, DistilBertConfig,
                          ElectraConfig, Gemma2Config, Gemma3TextConfig, LlamaConfig, ModernBertConfig,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen3Config, RobertaConfig, XLMRobertaConfig)

from tests.shape_data import FILLER, NEGATIVE, POSITIVE, TOPICS

WORDS = sorted({*FILLER, *POSITIVE, *NEGATIVE, *(w for ws in TOPICS.values() for w in ws),
                "tuesday", "report", "schedule", "meeting", "average", "user", "http", "t", "co", "x", "amp"})
# every word of the test data, several times, in both cases: a tokenizer trained on it keeps them whole
CORPUS = [" ".join(WORDS)] * 20 + [" ".join(w.capitalize() for w in WORDS)] * 5 + ["@ / : . & ; 0 1 2 3 4 5 6 7 8 9"] * 5
SIZE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def trained(model, pre_tokenizer, special, decoder=None, normalizer=None):
    """A `tokenizers` Tokenizer of `model` trained on CORPUS, its special tokens first (ids 0, 1, ...)."""
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer:
        tokenizer.normalizer = normalizer
    if decoder:
        tokenizer.decoder = decoder
    kind = {models.WordPiece: trainers.WordPieceTrainer, models.BPE: trainers.BpeTrainer,
            models.Unigram: trainers.UnigramTrainer}[type(model)]
    options = {"unk_token": special[-1]} if kind is trainers.UnigramTrainer else {}
    extra = ({"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()}
             if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else {})
    tokenizer.train_from_iterator(CORPUS, kind(vocab_size=400, special_tokens=special, show_progress=False,
                                               **options, **extra))
    return tokenizer


def wordpiece():
    return trained(models.WordPiece(unk_token="[UNK]"), pre_tokenizers.BertPreTokenizer(),
                   ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], decoders.WordPiece(), normalizers.BertNormalizer())


def unigram(special):
    return trained(models.Unigram(), pre_tokenizers.Metaspace(), special, decoders.Metaspace())


def byte_level(special):
    return trained(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), special, decoders.ByteLevel())


def template(tokenizer, single, pair):
    names = {t for part in (single, pair) for t in part.split() if not t.startswith("$")}
    tokens = [(name.split(":")[0], tokenizer.token_to_id(name.split(":")[0])) for name in sorted(names)]
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=sorted(set(tokens)))
    return tokenizer


@dataclass
class Family:
    """How to build one family's tiny model and tokenizer: the config (given the tokenizer's ids), and the
    tokenizer with its special tokens as transformers names them."""
    name: str
    config: object  # (ids: {token: id}, vocab size) -> a transformers config
    tokenizer: object  # () -> (tokenizers.Tokenizer, {bos_token: ..., pad_token: ...})
    input_names: list = field(default_factory=lambda: ["input_ids", "attention_mask"])
    decoder: bool = False
    remote_code: bool = False  # its classes are Python files in its folder, named by config.json's auto_map


def bert_tokenizer():
    tok = template(wordpiece(), "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1")
    return tok, dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def deberta_tokenizer():
    tok = template(unigram(["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]), "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1")
    return tok, dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def modernbert_tokenizer():
    tok = template(byte_level(["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]), "[CLS] $A [SEP]", "[CLS] $A [SEP] $B [SEP]")
    return tok, dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def xlmr_tokenizer():
    tok = template(unigram(["<s>", "<pad>", "</s>", "<mask>", "<unk>"]), "<s> $A </s>", "<s> $A </s> </s> $B </s>")
    return tok, dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", cls_token="<s>",
                     sep_token="</s>", mask_token="<mask>")


def qwen_tokenizer():
    """Qwen2's: no special token added to a text; <|endoftext|> is its end of text and its pad token."""
    tok = byte_level(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return tok, dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def llama_tokenizer():
    """Llama 3's: <|begin_of_text|> before each text, no pad token at all."""
    tok = template(byte_level(["<|begin_of_text|>", "<|end_of_text|>"]), "<|begin_of_text|> $A",
                   "<|begin_of_text|> $A <|begin_of_text|>:1 $B:1")
    return tok, dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


def gemma_tokenizer():
    tok = template(unigram(["<pad>", "<eos>", "<bos>", "<mask>", "<unk>"]), "<bos> $A", "<bos> $A <bos>:1 $B:1")
    return tok, dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")


DECODER_SIZE = dict(SIZE, num_key_value_heads=2, max_position_embeddings=256)

FAMILIES = {f.name: f for f in [
    Family("bert", lambda ids, n: BertConfig(vocab_size=n, max_position_embeddings=128, **SIZE), bert_tokenizer,
           ["input_ids", "token_type_ids", "attention_mask"]),
    Family("electra", lambda ids, n: ElectraConfig(vocab_size=n, embedding_size=32, max_position_embeddings=128, **SIZE),
           bert_tokenizer, ["input_ids", "token_type_ids", "attention_mask"]),
    Family("distilbert", lambda ids, n: DistilBertConfig(vocab_size=n, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                                         max_position_embeddings=128), bert_tokenizer),
    # DeBERTa-v3: relative positions only, no token-type embedding (type_vocab_size 0) though its
    # tokenizer makes segment ids
    Family("deberta-v3", lambda ids, n: DebertaV2Config(
        vocab_size=n, max_position_embeddings=128, type_vocab_size=0, position_biased_input=False,
        relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=32, norm_rel_ebd="layer_norm",
        share_att_key=True, pad_token_id=ids["[PAD]"], **SIZE), deberta_tokenizer,
        ["input_ids", "token_type_ids", "attention_mask"]),
    Family("modernbert", lambda ids, n: ModernBertConfig(
        vocab_size=n, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128, global_attn_every_n_layers=2, local_attention=16, pad_token_id=ids["[PAD]"],
        cls_token_id=ids["[CLS]"], sep_token_id=ids["[SEP]"], bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"]),
        modernbert_tokenizer),
    # klue/roberta: RoBERTa's one token type, under a BERT tokenizer that gives a pair's second text type 1
    Family("klue-roberta", lambda ids, n: RobertaConfig(vocab_size=n, type_vocab_size=1, max_position_embeddings=130,
                                                        pad_token_id=ids["[PAD]"], bos_token_id=ids["[CLS]"],
                                                        eos_token_id=ids["[SEP]"], **SIZE),
           bert_tokenizer, ["input_ids", "token_type_ids", "attention_mask"]),
    Family("xlm-roberta", lambda ids, n: XLMRobertaConfig(vocab_size=n, type_vocab_size=1, max_position_embeddings=130,
                                                          pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"],
                                                          eos_token_id=ids["</s>"], **SIZE), xlmr_tokenizer),
    # Qwen2's base configs name no pad token
    Family("qwen2", lambda ids, n: Qwen2Config(vocab_size=n, eos_token_id=ids["<|endoftext|>"], pad_token_id=None,
                                               bos_token_id=None, tie_word_embeddings=True, **DECODER_SIZE),
           qwen_tokenizer, decoder=True),
    Family("llama", lambda ids, n: LlamaConfig(vocab_size=n, bos_token_id=ids["<|begin_of_text|>"], pad_token_id=None,
                                               eos_token_id=ids["<|end_of_text|>"], **DECODER_SIZE),
           llama_tokenizer, decoder=True),
    Family("gemma2", lambda ids, n: Gemma2Config(vocab_size=n, head_dim=16, pad_token_id=ids["<pad>"],
                                                 bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
                                                 sliding_window=64, query_pre_attn_scalar=16, **DECODER_SIZE),
           gemma_tokenizer, decoder=True),
    # Qwen3 (the MAP and Jigsaw winners' classifiers): Qwen2's tokenizer, q/k norms, an explicit head_dim
    Family("qwen3", lambda ids, n: Qwen3Config(vocab_size=n, eos_token_id=ids["<|endoftext|>"], pad_token_id=None,
                                               bos_token_id=None, head_dim=16, tie_word_embeddings=True,
                                               **DECODER_SIZE), qwen_tokenizer, decoder=True),
    # Gemma 3's text model: local and global attention layers, Gemma's tokenizer
    Family("gemma3", lambda ids, n: Gemma3TextConfig(vocab_size=n, head_dim=16, pad_token_id=ids["<pad>"],
                                                     bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
                                                     sliding_window=16, sliding_window_pattern=2,
                                                     query_pre_attn_scalar=16, **DECODER_SIZE),
           gemma_tokenizer, decoder=True),
    # a model whose classes ship as Python files beside its weights (model.trust_remote_code), a BERT inside
    Family("remote-code", lambda ids, n: BertConfig(vocab_size=n, max_position_embeddings=128, **SIZE),
           bert_tokenizer, ["input_ids", "token_type_ids", "attention_mask"], remote_code=True),
]}

REMOTE_CONFIG = '''from transformers import BertConfig


class TinyRemoteConfig(BertConfig):
    model_type = "tiny-remote"
'''
REMOTE_MODELING = '''from transformers import BertForSequenceClassification, BertModel

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteModel(BertModel):
    config_class = TinyRemoteConfig


class TinyRemoteForSequenceClassification(BertForSequenceClassification):
    config_class = TinyRemoteConfig
'''


def as_remote_code(folder):
    """The BERT saved in `folder` made a model of remote code, as a hub repository with custom classes is:
    its config names a model type transformers does not know and, in auto_map, the files that define it."""
    (folder / "configuration_tiny_remote.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_tiny_remote.py").write_text(REMOTE_MODELING)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny-remote", architectures=["TinyRemoteForSequenceClassification"], auto_map={
        "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig", "AutoModel": "modeling_tiny_remote.TinyRemoteModel",
        "AutoModelForSequenceClassification": "modeling_tiny_remote.TinyRemoteForSequenceClassification"})
    (folder / "config.json").write_text(json.dumps(config))


def build(name, folder, seed=0):
    """Family `name`'s tiny random model and its tokenizer, saved in `folder` as a hub checkpoint is."""
    family = FAMILIES[name]
    tok, special = family.tokenizer()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=family.input_names, **special)
    config = family.config(tok.get_vocab(), tok.get_vocab_size())
    torch.manual_seed(seed)
    model = (AutoModelForCausalLM if family.decoder else AutoModelForMaskedLM).from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if family.remote_code:
        as_remote_code(folder)
    return folder
