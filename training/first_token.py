"""The last encoder layer computes only the first token ([CLS]): the one a BERT-style classifier reads.

A sequence classifier of the BERT family (BERT, RoBERTa, ELECTRA, XLM-R: the layers transformers writes
as BertLayer) reads one vector of the last layer, its first token's. The layers below must compute every
token, because the last layer's keys and values are all of them; but in the last layer every other token's
query, attention output and feed-forward pass is computed and thrown away: 10 of its 12 weight products
per token (q, k, v, out: 4; feed-forward: 8; in units of hidden_size squared). With MiniLM's 6
layers that is a seventh of the encoder's arithmetic, forward and backward.

So the last layer here computes its keys and values for every token and its query, attention output and
feed-forward for the first token only, with the layer's own modules and the attention function the model
is set to use. Its output is (batch, 1, hidden): the classifier's input unchanged, so the logits and the
gradients are the model's own (a test compares both with the full layer's). Checked on real rows before
use (reads_first_token_only); a model whose head reads more than the first token (another pooling) or
whose layer is not BERT's keeps its full last layer, and the log says which.
Not for padding-free batches (training/unpadded.py): there a row holds many texts, each with its [CLS].
"""
import contextlib
import functools
import sys
import types

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# what first_token_forward uses of a layer: BertLayer's parts
PARTS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output",
         "intermediate", "output")
CHECK_ROWS = 8  # rows of the check batch, cut to 4, 8, ... 32 tokens: padding in it, cheap for any model


def last_layer(model):
    """The last layer of the model's encoder (a module list named ...encoder.layer, as BERT's, also
    inside a LoRA wrapper) when it has BertLayer's parts; else None."""
    stacks = [module for name, module in model.named_modules()
              if name.split(".")[-2:] == ["encoder", "layer"] and isinstance(module, torch.nn.ModuleList)]
    if len(stacks) != 1 or not len(stacks[0]):
        return None
    layer = stacks[0][-1]
    if not hasattr(layer, "feed_forward_chunk") or getattr(layer, "is_decoder", False):
        return None
    try:
        for part in PARTS:
            layer.get_submodule(part)
    except AttributeError:
        return None
    return layer


def first_token_forward(layer, hidden_states, attention_mask=None, encoder_hidden_states=None,
                        encoder_attention_mask=None, cache=None, **kwargs):
    """BertLayer.forward for the first token only: (batch, tokens, hidden) -> (batch, 1, hidden), the
    first token's output of the full layer. Keys and values of every token; the attention mask's row of
    the first query (a 4-d mask (batch, 1, queries, keys)); the attention function the config names.
    With gradient checkpointing on, it is checkpointed as transformers checkpoints the layer's own forward."""
    if encoder_hidden_states is not None or cache is not None:  # a decoder's: not what this is for
        return type(layer).forward(layer, hidden_states, attention_mask, encoder_hidden_states,
                                   encoder_attention_mask=encoder_attention_mask, cache=cache, **kwargs)
    if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
        return layer._gradient_checkpointing_func(functools.partial(first_token_output, layer, **kwargs),
                                                  hidden_states, attention_mask)
    return first_token_output(layer, hidden_states, attention_mask, **kwargs)


def first_token_output(layer, hidden_states, attention_mask, **kwargs):
    attention = layer.attention.self
    batch = hidden_states.shape[0]
    first = hidden_states[:, :1]

    def heads(x):  # (batch, n, hidden) -> (batch, heads, n, head_dim)
        return x.view(batch, x.shape[1], -1, attention.attention_head_size).transpose(1, 2)

    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[2] > 1:
        attention_mask = attention_mask[:, :, :1]
    # "eager" is the model file's own function, as in its attention's forward
    eager = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, eager)
    out, _ = attend(attention, heads(attention.query(first)), heads(attention.key(hidden_states)),
                    heads(attention.value(hidden_states)), attention_mask, scaling=attention.scaling,
                    dropout=attention.dropout.p if attention.training else 0.0, **kwargs)
    out = layer.attention.output(out.reshape(batch, 1, -1), first)
    return layer.feed_forward_chunk(out)


def enable(layer):
    """The layer computes its first token only (its own forward, as an attribute of this module only:
    the weights, their names and what save_pretrained writes stay the model's)."""
    layer.forward = types.MethodType(first_token_forward, layer)


def disable(layer):
    layer.__dict__.pop("forward", None)


def check_batch(collator, sequences, token_types=None):
    """A few real rows cut to 4, 8, ... tokens (each keeps its first, the [CLS]) and padded by the stage's
    collator: padding in the batch, and a few hundred tokens, so the check costs little on any model. None
    for no rows."""
    if not len(sequences):
        return None
    rows = range(min(CHECK_ROWS, len(sequences)))
    cut = [4 * (i + 1) for i in rows]
    examples = [{"input_ids": list(sequences[i][:cut[i]])} for i in rows]
    if token_types is not None:
        for i, example in zip(rows, examples):
            example["token_type_ids"] = list(token_types[i][:cut[i]])
    return collator(examples)


@torch.no_grad()
def reads_first_token_only(model, layer, batch):
    """Whether the model's logits on `batch` with `layer` computing its first token only are its own
    logits (fp32, TF32 off, eval mode: dropout off): true of a head that reads the first token, and of a
    layer that is BERT's. The model is left as it was (its mode, the layer's full forward)."""
    training = model.training
    device = next(model.parameters()).device
    batch = {key: value.to(device) for key, value in batch.items() if key != "labels"}
    model.eval()
    try:
        with full_fp32_matmuls():  # both sides in full fp32 precision
            full = model(**batch).logits
            enable(layer)
            try:
                cut = model(**batch).logits
            except (AttributeError, RuntimeError, TypeError, ValueError):  # a part, mask or attention it cannot use
                return False
            finally:
                disable(layer)
    finally:
        model.train(training)
    return cut.shape == full.shape and torch.allclose(cut, full, rtol=1e-4, atol=1e-5)


@contextlib.contextmanager
def full_fp32_matmuls():
    """CUDA's fp32 matmuls without TF32 inside, restored after. Through torch's fp32_precision where torch
    has it (2.9 on): once anything set that (transformers' tf32 setting does), reading the older
    allow_tf32 raises a RuntimeError, while fp32_precision reads either."""
    matmul = torch.backends.cuda.matmul
    name, full = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    before = getattr(matmul, name)
    setattr(matmul, name, full)
    try:
        yield
    finally:
        setattr(matmul, name, before)


def choose(model, batch, packed=False):
    """Makes the model's last layer compute its first token only where that gives the model's own logits
    on `batch` (check_batch's); returns a line for the log saying whether it did, and why not."""
    if packed:
        return "last layer: every token (padding-free batches hold many texts in a row)"
    layer = last_layer(model)
    if batch is None:
        return "last layer: every token (no rows to check it on)"
    if layer is None:
        return f"last layer: every token ({type(model).__name__}'s layers are not BERT's)"
    disable(layer)  # checked against the full layer, also when chosen before
    if not reads_first_token_only(model, layer, batch):
        return (f"last layer: every token ({type(model).__name__}'s head reads more than the first token: "
                "the logits differ)")
    enable(layer)
    return "last layer: the first token only, the one the classifier reads (the same logits, checked)"
