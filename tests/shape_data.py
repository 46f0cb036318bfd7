"""Small datasets of each task shape, made here, that the tiny test model can learn in a few epochs:
- pairs: two texts that each hold positive or negative words; the label says how many of the two are
  positive (neither, one, both), so a model that reads only one text is right half the time;
- multi-label: a title and a body holding one keyword of each of the row's topics (none, one or
  several), the topics written both as "sports|music" and as one 0/1 column per topic;
- regression: a text whose target grows with the number of positive words in it (0 to 3), plus a
  little noise, on a scale far from the unit one the model trains in (mean about 50, standard
  deviation about 22): values left standardised, or scaled back wrongly, are far off in RMSE.
"""
import random

import pandas as pd

POSITIVE = ["great", "love", "wonderful", "happy", "best"]
NEGATIVE = ["awful", "terrible", "hate", "broken", "worst"]
FILLER = ["the", "car", "phone", "flight", "today", "my", "new", "really", "this", "is", "was"]
TOPICS = {"food": ["pizza", "bread", "cheese"], "music": ["guitar", "piano", "song"],
          "sports": ["football", "tennis", "goal"]}


def filler(rng, n):
    return rng.sample(FILLER, n)


def pair_rows(n, seed):
    """A third of each label, each text with two words of its polarity."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = ["neither", "one", "both"][i % 3]
        polarities = {"neither": [NEGATIVE, NEGATIVE], "one": rng.sample([POSITIVE, NEGATIVE], 2),
                      "both": [POSITIVE, POSITIVE]}[label]
        texts = []
        for words in polarities:
            words = filler(rng, 3) + rng.sample(words, 2)
            rng.shuffle(words)
            texts.append(" ".join(words))
        rows.append({"id": f"p{i}", "premise": texts[0], "hypothesis": texts[1], "label": label})
    return pd.DataFrame(rows)


def multilabel_rows(n, seed):
    """Rows with 0, 1, 2 or 3 topics, each topic drawn on its own, every row of 7 words: a row's length
    says nothing of its topics (the train stage batches texts of similar length together)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topics = [t for t in sorted(TOPICS) if rng.random() < 0.4]
        words = filler(rng, 7 - len(topics)) + [rng.choice(TOPICS[t]) for t in topics]
        rng.shuffle(words)
        rows.append({"id": f"m{i}", "title": " ".join(words[:3]), "body": " ".join(words[3:]), "tags": "|".join(topics),
                     **{t: int(t in topics) for t in TOPICS}})
    return pd.DataFrame(rows)


def regression_rows(n, seed):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(0, 3)
        words = filler(rng, 4) + rng.sample(POSITIVE, k)
        rng.shuffle(words)
        rows.append({"id": f"r{i}", "text": " ".join(words), "score": round(20 + 20 * (k + rng.uniform(-0.2, 0.2)), 3)})
    return pd.DataFrame(rows)


def write_data(folder, make, n_train, n_test, drop=()):
    """train.csv and a labelled test.csv (with ids) of one shape in a new folder."""
    folder.mkdir(parents=True, exist_ok=True)
    make(n_train, seed=1).drop(columns=["id", *drop]).to_csv(folder / "train.csv", index=False)
    make(n_test, seed=2).drop(columns=list(drop)).to_csv(folder / "test.csv", index=False)
    return folder
