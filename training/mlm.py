"""Masked-language-model pretraining on the competition's own texts (Sun et al. 2019, within-task
pretraining), the parts the pretrain stage calls: the corpus (the processed train and test texts, and
unlabelled texts of pretrain.extra_file, which reading/extra.py reads), the held-out split, the held-out
texts masked once, the MLM loss on them, and the encoder to save."""
import hashlib
import math

import numpy as np
import torch
from transformers import DataCollatorForLanguageModeling, Trainer

from pipeline.settings import PipelineError


def corpus(frames, extra=()):
    """The distinct texts to pretrain on, in the order first seen: the `text` and, for pairs, `text_pair`
    column of each processed frame, then the extra texts. Blank texts are left out."""
    texts = [text for frame in frames for column in ("text", "text_pair") if column in frame for text in frame[column]]
    return list(dict.fromkeys(text for text in [*texts, *extra] if text.strip()))


def texts_digest(texts):
    """sha256 of the texts in order: a checkpoint is resumed only by a run on the same texts."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8") + b"\0")
    return digest.hexdigest()


def held_out_split(n, fraction, seed):
    """(positions trained on, positions held out) of n texts, both sorted: round(fraction * n) held out,
    at least 1 and leaving at least 1, drawn by seed."""
    order = np.random.default_rng(seed).permutation(n)
    held = min(max(1, round(fraction * n)), n - 1)
    return np.sort(order[held:]), np.sort(order[:held])


class BatchSeededMasking(DataCollatorForLanguageModeling):
    """transformers' masked-LM collator (BERT's rule: of the tokens chosen with mlm_probability, 80% become
    [MASK], 10% a random token, 10% stay; special tokens never), its masks drawn from `seed` and the batch's
    own token ids instead of the global RNG. Trainer restores the global RNG of a checkpoint only after it
    has collated the first batch it resumes with: so a resumed run masks every batch as the stopped run
    did. Shuffled, an epoch's batches are new, and so are their masks."""

    def __init__(self, tokenizer, mlm_probability, seed):
        super().__init__(tokenizer, mlm_probability=mlm_probability)
        self.base_seed = seed

    def torch_call(self, examples):
        digest = hashlib.sha256(str(self.base_seed).encode())
        for example in examples:
            digest.update(np.asarray(example["input_ids"], dtype=np.int64).tobytes() + b"/")
        self.generator = torch.Generator().manual_seed(int.from_bytes(digest.digest()[:8], "little"))
        return super().torch_call(examples)


def masked_once(tokenizer, sequences, probability, seed, batch_size):
    """Batches of the token ids `sequences`, padded and masked once as in training (BatchSeededMasking):
    the same masks for the model before and after training."""
    collator = BatchSeededMasking(tokenizer, probability, seed)
    return [collator([{"input_ids": ids} for ids in sequences[i:i + batch_size]])
            for i in range(0, len(sequences), batch_size)]


def masked_count(batches):
    return sum(int((batch["labels"] != -100).sum()) for batch in batches)


@torch.no_grad()
def held_out_scores(model, batches, device="cpu", dtype=None):
    """{"loss": cross-entropy per masked token over all the batches, "perplexity": exp(loss)}: each
    masked token counts once, whatever the size of its batch."""
    model.eval()
    total = 0.0
    for batch in batches:
        batch = {key: value.to(device) for key, value in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(**batch).logits
        total += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                   ignore_index=-100, reduction="sum").item()
    loss = total / masked_count(batches)
    return {"loss": round(loss, 4), "perplexity": round(math.exp(loss), 2)}


def masked_lm_head(model):
    """The one module besides the encoder that turns its hidden states into the vocabulary's scores (BERT's
    `cls`, RoBERTa's `lm_head`), or None where the model has more or none (ModernBERT's head and decoder)."""
    heads = [module for module in model.children() if module is not model.base_model]
    return heads[0] if len(heads) == 1 else None


def masked_token_scores(model, head, batch):
    """(the head's scores at the masked tokens of `batch`, their labels): the encoder runs on every token, the
    head on the masked ones only."""
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    masked = batch["labels"] != -100
    return head(model.base_model(**inputs)[0][masked]), batch["labels"][masked]


@torch.no_grad()
def head_reads_each_token_alone(model, head, batch):
    """Whether the head's scores at the masked tokens alone are the model's own logits there: true of a
    head that scores each position by itself (a dense layer, LayerNorm, the decoder), which is what scoring
    only the masked tokens assumes. Checked once on a real batch before training."""
    model.eval()
    scores, _ = masked_token_scores(model, head, batch)
    logits = model(**{key: value for key, value in batch.items() if key != "labels"}).logits[batch["labels"] != -100]
    return scores.shape == logits.shape and torch.allclose(scores, logits, rtol=1e-4, atol=1e-4)


class MaskedTokensTrainer(Trainer):
    """Trainer whose masked-LM loss scores only the masked tokens: the model's own forward scores all
    30,522 words of BERT's vocabulary at every token, and 85% of those scores are thrown away by the loss
    (labels -100). The loss is the model's own (the mean cross-entropy over the batch's masked tokens), so
    the gradients are too, at a fraction of the head's work. head None: the model's own forward."""

    def __init__(self, *args, head, **kwargs):
        super().__init__(*args, **kwargs)
        self.head = head

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.head is None or return_outputs or model is not self.model:  # wrapped (several processes)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with self.accelerator.autocast():  # accelerate autocasts the model's forward, not its parts
            scores, labels = masked_token_scores(model, self.head, inputs)
        return torch.nn.functional.cross_entropy(scores.float(), labels)


def with_pooler(mlm_model, base):
    """`base`, the model loaded as AutoModel from the same source, holding the trained encoder of mlm_model.
    A masked-LM model is built without the pooler (BertForMaskedLM, RobertaForMaskedLM) that BERT's sequence
    classifier reads: saved as it is, the train stage would start from a random pooler instead of the
    checkpoint's own. The MLM head is left out: nothing after pretraining uses it."""
    unexpected = base.load_state_dict(mlm_model.base_model.state_dict(), strict=False).unexpected_keys
    if unexpected:  # the pooler is what base may have more of; the encoder must be all there
        raise PipelineError(f"{type(mlm_model).__name__}'s encoder does not fit {type(base).__name__} "
                            f"(unexpected weights: {', '.join(unexpected[:3]) or 'none'}): this model cannot "
                            "be pretrained here; set pretrain.epochs: 0")
    return base
