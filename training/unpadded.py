"""Padding-free ("unpadded") training batches for BERT classifiers, as in MosaicBERT and ModernBERT.

A padded batch of texts of 5 and 60 tokens computes 120 token positions for 65 real ones. Here a
batch is one row of all its texts end to end, (1, total_tokens): the linear layers, which take most
of the time on short texts, see only real tokens. Attention must still stay inside each text, so the
row carries its texts' boundaries as cumulative lengths (cu_seqlens, [0, 5, 65]) under the names
transformers itself uses for packed rows (DataCollatorWithFlattening's cu_seq_lens_q/k and
max_length_q/k). BertModel hands unknown keyword arguments down to its attention function, so a
function registered in transformers' AttentionInterface receives them in every layer. The classifier
then reads each text's first token ([CLS]) at its offset in the row.

- collate: examples -> a packed batch;
- packed_attention: the attention function (PyTorch's varlen_attn on a GPU in fp16/bf16, an exact
  per-text SDPA elsewhere), registered as ATTENTION;
- UnpaddedClassifier(model): a BertForSequenceClassification run on packed batches, for Trainer;
  supports(model) says whether a model can be wrapped (else keep padded batches).
bench/benchmark.py times padded against padding-free training steps (time_training_steps).
"""
import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, BertForSequenceClassification
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

try:  # PyTorch's FlashAttention over cumulative lengths: torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

ATTENTION = "unpadded_sdpa"  # the attention implementation name UnpaddedClassifier sets on the model


def collate(examples):
    """One packed row from unpadded examples {"input_ids": [...], "labels": ...} (and "token_type_ids" of
    text pairs): input_ids, position_ids (1, total_tokens), positions restarting at 0 in each text, and
    token_type_ids alike; cu_seq_lens_q/k (n + 1,) int32, the texts' start offsets then the total;
    max_length_q/k, the longest text; labels (n,) or (n, classes)."""
    ids = [torch.as_tensor(e["input_ids"], dtype=torch.long) for e in examples]
    lengths = torch.tensor([len(x) for x in ids])
    if not len(ids) or lengths.min() < 1:
        raise ValueError("every text needs at least one token (its [CLS])")
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # int32: what varlen kernels take
    longest = int(lengths.max())
    batch = {"input_ids": torch.cat(ids)[None], "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
             "cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": longest, "max_length_k": longest}
    if "token_type_ids" in examples[0]:
        batch["token_type_ids"] = torch.cat([torch.as_tensor(e["token_type_ids"], dtype=torch.long) for e in examples])[None]
    if "labels" in examples[0]:
        batch["labels"] = torch.tensor([e["labels"] for e in examples])
    return batch


def per_text_attention(q, k, v, cu_seqlens, max_len, dropout=0.0, scale=None):
    """Exact attention of every text to itself alone: (T, heads, head_dim) -> the same shape.
    Pads inside the attention only, (n, heads, max_len, head_dim), so it costs what padded attention
    costs (a block-diagonal mask over the whole row would cost n times more) and keeps dropout."""
    offsets = torch.arange(max_len, device=q.device)
    real = offsets < cu_seqlens.diff()[:, None]  # (n, max_len): which padded slots hold a token
    index = (cu_seqlens[:-1, None] + offsets).clamp(max=q.shape[0] - 1)  # slot -> token; pad slots masked
    padded = [x[index].transpose(1, 2) for x in (q, k, v)]  # (n, heads, max_len, head_dim)
    out = F.scaled_dot_product_attention(*padded, attn_mask=real[:, None, None, :], dropout_p=dropout, scale=scale)
    return out.transpose(1, 2)[real]  # the real tokens, in row order


def uses_varlen(q, dropout, scale):
    """Whether varlen_attn can compute this: a GPU, half precision (FlashAttention's), no attention
    dropout (varlen_attn has none) and the default 1/sqrt(head_dim) scale (so none is passed: 2.10's
    varlen_attn takes no scale, 2.11's takes it by keyword only)."""
    return (varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dropout == 0
            and (scale is None or math.isclose(scale, q.shape[-1] ** -0.5)))


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers' attention function signature: query/key/value (batch, heads, tokens, head_dim)
    -> ((batch, tokens, heads, head_dim), no weights). A packed row (cu_seq_lens_q given) attends
    within each text; a padded batch through the same model gets plain SDPA with its padding mask."""
    if cu_seq_lens_q is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, **kwargs)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # the row's (T, heads, head_dim)
    if uses_varlen(q, dropout, scaling):
        out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q)
    else:
        out = per_text_attention(q, k, v, cu_seq_lens_q, max_length_q, dropout, scaling)
    return out[None], None


# Registered at import: the name must exist before a model is set to it. The mask entry makes padded
# batches get SDPA's padding mask; a packed row has no attention_mask, so it gets none.
AttentionInterface.register(ATTENTION, packed_attention)
AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def supports(model):
    """Whether UnpaddedClassifier computes what this model computes: a single-label
    BertForSequenceClassification (BERT, MiniLM and other model_type "bert" checkpoints; single texts or
    text pairs), an encoder with a pooler, whose attention goes through transformers' registry. Others
    (multi-label and regression heads too): padded batches."""
    config = model.config
    return (isinstance(model, BertForSequenceClassification) and model.bert.pooler is not None
            and not config.is_decoder and not config.add_cross_attention
            and config.num_labels > 1 and config.problem_type in (None, "single_label_classification"))


class UnpaddedClassifier(torch.nn.Module):
    """A BertForSequenceClassification run on collate's packed batches, returning what its own
    forward returns (logits, and the cross-entropy loss with labels). It holds the model itself,
    so training it trains the model: save the model, not this wrapper. Padded batches still work
    through the model (its attention falls back to SDPA without cu_seq_lens)."""

    def __init__(self, model):
        super().__init__()
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not supported by padding-free batches; check supports()")
        model.set_attn_implementation(ATTENTION)
        self.model = model
        self.config = model.config  # Trainer reads a few settings from model.config

    def forward(self, input_ids, position_ids, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                labels=None, token_type_ids=None):
        # no **kwargs: Trainer then averages the loss over accumulated micro-batches itself
        hidden = self.model.bert(input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                                 cu_seq_lens_q=cu_seq_lens_q,
                                 cu_seq_lens_k=cu_seq_lens_k, max_length_q=max_length_q,
                                 max_length_k=max_length_k).last_hidden_state  # (1, T, hidden)
        first = hidden[0, cu_seq_lens_q[:-1].long()]  # (n, hidden): each text's [CLS]
        pooled = self.model.bert.pooler(first[:, None])  # the pooler reads position 0 of each row
        logits = self.model.classifier(self.model.dropout(pooled))
        loss = None
        if labels is not None:
            self.config.problem_type = "single_label_classification"  # as the model's forward records it
            loss = F.cross_entropy(logits.view(-1, self.config.num_labels), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)
