"""The submission: its header (the sample submission's, checked against the shape) and its rows, from the
outputs chosen (probabilities, or values) and the task shape's decisions."""
import pandas as pd

from pipeline.settings import PipelineError


def check_header(columns, shape, classes, path):
    """A sample submission's columns: an id column, then one prediction column, or (classification and
    multi-label) one column per class, in any order."""
    values = columns[1:]
    if len(values) == 1 or (shape.kind != "regression" and sorted(values) == sorted(classes)):
        return list(columns)
    per_class = "" if shape.kind == "regression" else f", or one column per class ({', '.join(classes)})"
    raise PipelineError(f"{path}: columns {', '.join(map(repr, columns))}: expected the id column, then one "
                        f"prediction column{per_class}")


def submission_frame(shape, ids, outputs, classes, header, threshold, separator, probabilities):
    """The submission: header[0] holds the ids; then one column of decisions (a class, classes joined by
    the separator, a value), or one column per class holding probabilities (when the metric scores them:
    log loss, ROC AUC) or 0/1 decisions."""
    frame = pd.DataFrame({header[0]: list(ids)})
    if shape.kind != "regression" and sorted(header[1:]) == sorted(classes):
        values = outputs if probabilities else shape.indicators(outputs, threshold)
        for column in header[1:]:
            frame[column] = values[:, classes.index(column)]
    else:
        frame[header[1]] = shape.decide(outputs, classes, threshold, separator)
    return frame
