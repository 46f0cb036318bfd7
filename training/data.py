"""The training rows as Trainer takes them: token ids, labels (a regression target standardised) and
segment ids of text pairs."""
import torch


class TokenizedDataset(torch.utils.data.Dataset):
    """Unpadded token ids and labels (lists), and segment ids for text pairs, e.g. some rows of a split
    the tokenize stage saved."""

    def __init__(self, sequences, labels, token_types=None):
        self.sequences, self.labels, self.token_types = sequences, labels, token_types

    @classmethod
    def rows(cls, sequences, labels, rows, token_types=None):
        return cls([sequences[i] for i in rows], [labels[i] for i in rows],
                   None if token_types is None else [token_types[i] for i in rows])

    def __len__(self):
        return len(self.sequences)

    def __getitem__(self, i):
        example = {"input_ids": self.sequences[i], "labels": self.labels[i]}
        if self.token_types is not None:
            example["token_type_ids"] = self.token_types[i]
        return example


def standardised(labels, scale):
    """Targets as the model learns them: (y - mean) / std, scale from the task shape's target_scale."""
    mean, std = scale
    # None: a row outside the job's training and validation rows (a distilled student's row that no
    # teacher validated on) has no target, and is never read
    return [None if y is None else (y - mean) / std for y in labels]
