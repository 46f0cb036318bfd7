"""Masked-language-model pretraining on the competition's own texts (Sun et al. 2019, within-task
pretraining), the parts the pretrain stage calls: the corpus (the processed train and test texts, and
unlabelled texts of pretrain.extra_file), the held-out split, the held-out texts masked once, the MLM loss
on them, and the encoder to save."""
import hashlib
import math
from pathlib import Path

import numpy as np
import torch
from transformers import DataCollatorForLanguageModeling

from pipeline.settings import PipelineError
from reading.csvfiles import read_csv


def extra_files(path):
    """The files of pretrain.extra_file: the file itself, or the .csv and .txt files in a folder (sorted)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise PipelineError(f"params.yaml: pretrain.extra_file {path} does not exist: name a CSV file or a "
                            "folder of .csv/.txt files of unlabelled texts, or null")
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix.lower() in (".csv", ".txt") and p.is_file())
    if not files:
        raise PipelineError(f"params.yaml: pretrain.extra_file {path} is a folder without .csv or .txt files")
    return files


def extra_texts(files, column):
    """The texts of the extra files: column `column` of each CSV, each line of each .txt file."""
    texts = []
    for path in files:
        if path.suffix.lower() == ".txt":
            texts += path.read_text(encoding="utf-8", errors="replace").splitlines()
            continue
        frame = read_csv(path)
        if column not in frame:
            raise PipelineError(f"{path} has no column {column!r} (pretrain.extra_column); its columns: "
                                f"{', '.join(map(repr, frame.columns))}")
        texts += frame[column].tolist()
    return texts


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
