"""Checks on a distilled student before any work: smaller than its teacher, reading the same token ids."""
import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer

from pipeline.settings import PipelineError
from modeling.models import layer_count, layer_setting


def weight_count(source, layers=None, trust_remote_code=False):
    """(weights, encoder layers) of a model's encoder, built on the meta device: no memory, no download
    beyond its config."""
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **layer_setting(source, layers))
    with torch.device("meta"):
        model = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters()), layer_count(config)


def check_student(name, teacher, student, layers, trust_remote_code=False):
    """One line describing the student, or a PipelineError when it is not smaller than the teacher (both
    model sources; layers: the student keeps its first `layers`) or reads other token ids."""
    where = f"params.yaml: distill.students.{name}"
    teacher_weights, teacher_layers = weight_count(teacher, None, trust_remote_code)
    all_layers = weight_count(student, None, trust_remote_code)[1]
    if layers and layers > all_layers:
        raise PipelineError(f"{where}.layers {layers}: {student} has {all_layers} encoder layers; at most {all_layers}")
    student_weights, student_layers = weight_count(student, layers, trust_remote_code)
    if student_weights >= teacher_weights:
        raise PipelineError(f"{where}: the student ({student_weights / 1e6:.1f}M weights, {student_layers} layers) is "
                            f"not smaller than its teacher ({teacher_weights / 1e6:.1f}M, {teacher_layers} layers): "
                            "drop layers or name a smaller model")
    if student != teacher:
        vocab = AutoTokenizer.from_pretrained(student, trust_remote_code=trust_remote_code).get_vocab()
        if vocab != AutoTokenizer.from_pretrained(teacher, trust_remote_code=trust_remote_code).get_vocab():
            raise PipelineError(f"{where}.model: {student}'s tokenizer has another vocabulary than the teachers' "
                                f"({teacher}): a student reads the same token ids; pick one of the same family")
    return (f"distill@{name}: a student of {student_weights / 1e6:.1f}M weights ({student_layers} layers) learns "
            f"from teachers of {teacher_weights / 1e6:.1f}M ({teacher_layers} layers)")
