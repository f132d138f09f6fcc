"""From a model's files to a catalog entry: the adapter family and its settings, each
value with the file (and key) it came from.

Only what the files state is taken as stated; where they leave a choice open (a plain
encoder without sentence-transformers files says nothing about pooling) the other
plausible values are listed as `alternatives`, for parity and the pooling probe to
decide between (`app.onboard.onboard`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.onboard.files import ModelFiles, OnboardError, tensor_shape

# Label names that make a sequence classifier an NLI model, served as zero-shot.
_NLI_LABELS = {"entailment", "contradiction", "neutral", "not_entailment"}
_CLIP_TYPES = {"clip", "siglip", "siglip2"}
_QUERY_PROMPTS = ("query",)
_DOCUMENT_PROMPTS = ("document", "passage", "corpus", "doc")
_HUGE = 100_000  # tokenizers that know no limit say 1e30


@dataclass
class Setting:
    """One entry field: its value and where it was read."""

    value: Any
    source: str  # "config.json hidden_size", "1_Pooling/config.json pooling_mode_mean_tokens"


@dataclass
class Detection:
    """What the files say the model is, as entry fields with their sources."""

    adapter: str
    why: str  # the files that made it this family
    settings: dict[str, Setting] = field(default_factory=dict)
    # Other values of the open choices: field -> values to try, in order.
    alternatives: dict[str, list[Any]] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)  # a classifier's id2label, in order
    notes: list[str] = field(default_factory=list)  # what a reader should know

    def value(self, name: str, default: Any = None) -> Any:
        setting = self.settings.get(name)
        return default if setting is None else setting.value

    def choices(self) -> list[str]:
        return [f"{name}={s.value} ({s.source})" for name, s in self.settings.items()]


def detect(files: ModelFiles) -> Detection:
    """The family and settings the files state; OnboardError when no family fits."""
    arch = files.architecture
    if arch.endswith("ForSequenceClassification"):
        # sentence-transformers >= 5 saves a CrossEncoder with a modules.json too.
        detection = _sequence_classifier(files)
    elif files.modules:
        detection = _from_sentence_transformers(files)
    elif files.config.get("model_type") in _CLIP_TYPES:
        detection = _clip(files)
    elif arch == "HF_ColBERT":
        detection = _stanford_colbert(files)
    elif arch.endswith("ForTokenClassification"):
        detection = Detection("token-classification", f"config.json architectures {arch}")
        detection.labels = _labels(files)
    elif arch.endswith(("ForCausalLM", "LMHeadModel")):
        detection = _causal_lm(files)
    elif arch.endswith("ForMaskedLM"):
        if "splade" not in files.folder.name.lower():
            raise OnboardError(f"{files.folder.name} is a masked LM ({arch}) with no "
                               "sentence-transformers files: a base model to fine-tune, or a "
                               "SPLADE encoder? Save it with sentence_transformers.SparseEncoder "
                               "so its files say which")
        detection = Detection("sparse", f"config.json architectures {arch}, 'splade' in the "
                              "folder name")
    elif arch.endswith("Model") or not arch:
        detection = _plain_encoder(files)
    else:
        raise OnboardError(f"{files.folder.name}: architecture {arch} is not one shoal's "
                           "adapters serve (encoders, sequence/token classifiers, CLIP/SigLIP, "
                           "causal LMs; shoal models adapters)")
    _add_length(files, detection)
    return detection


def _from_sentence_transformers(files: ModelFiles) -> Detection:
    kinds = " + ".join(str(m.get("type", "?")).rsplit(".", 1)[-1] for m in files.modules)
    why = f"modules.json: {kinds}"
    if files.module(".SpladePooling"):
        return Detection("sparse", why)
    pooling_module = files.module(".Pooling")
    dense_module = files.module(".Dense")
    if pooling_module is None:
        if dense_module is not None:
            return _dims_from_dense(files, Detection("multivector", why), dense_module)
        raise OnboardError(f"{files.folder.name}: modules.json ({kinds}) has no Pooling, "
                           "SpladePooling or Dense module; shoal cannot tell how it embeds")
    detection = Detection("dense", why)
    detection.settings["pooling"] = _pooling(files, pooling_module)
    others = [p for p in ("mean", "cls", "lasttoken") if p != detection.value("pooling")]
    detection.alternatives["pooling"] = others
    detection.settings["normalize"] = Setting(
        files.module(".Normalize") is not None,
        "modules.json: a Normalize module" if files.module(".Normalize")
        else "modules.json: no Normalize module")
    if dense_module is not None:
        _dims_from_dense(files, detection, dense_module)
    else:
        detection.settings["dims"] = _hidden_size(files)
    _prompts(files, detection)
    return detection


def _pooling(files: ModelFiles, module: dict[str, Any]) -> Setting:
    from runtimes.families.st_config import pooling_mode

    path = f"{module.get('path', '')}/config.json"
    config = files.module_config(module)
    try:
        mode = pooling_mode(config, files.folder)
    except ValueError as exc:
        raise OnboardError(str(exc)) from None
    keys = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
    return Setting(mode, f"{path} {' '.join(keys)}")


def _dims_from_dense(files: ModelFiles, detection: Detection, module: dict[str, Any]
                     ) -> Detection:
    path = module.get("path", "")
    config = files.module_config(module)
    dims = config.get("out_features")
    if dims is None:
        raise OnboardError(f"{path}/config.json gives no out_features for the Dense module")
    detection.settings["dims"] = Setting(int(dims), f"{path}/config.json out_features")
    return detection


def _hidden_size(files: ModelFiles) -> Setting:
    for key in ("hidden_size", "d_model", "dim", "n_embd"):
        if key in files.config:
            return Setting(int(files.config[key]), f"config.json {key}")
    raise OnboardError("config.json gives no hidden_size: shoal cannot tell the vectors' "
                       "width (dims)")


def _prompts(files: ModelFiles, detection: Detection) -> None:
    prompts = files.st_config.get("prompts") or {}
    for field_name, keys in (("query", _QUERY_PROMPTS), ("document", _DOCUMENT_PROMPTS)):
        key = next((k for k in keys if prompts.get(k)), None)
        if key is not None:
            detection.settings[f"prompts.{field_name}"] = Setting(
                prompts[key], f"config_sentence_transformers.json prompts.{key}")


def _labels(files: ModelFiles) -> list[str]:
    id2label = files.config.get("id2label") or {}
    return [str(id2label[k]) for k in sorted(id2label, key=lambda k: int(k))]


def _sequence_classifier(files: ModelFiles) -> Detection:
    arch = files.architecture
    labels = _labels(files)
    lowered = {label.lower() for label in labels}
    saved_as_cross_encoder = ("sentence_transformers" in files.config
                              or files.st_config.get("model_type") == "CrossEncoder")
    if len(labels) <= 1 or saved_as_cross_encoder:
        detection = Detection("cross-encoder", f"config.json architectures {arch} with "
                              f"{max(len(labels), 1)} output" + (
                                  ", saved by sentence-transformers' CrossEncoder"
                                  if saved_as_cross_encoder else ""))
    elif lowered & _NLI_LABELS and "entailment" in lowered:
        detection = Detection("zero-shot", f"config.json architectures {arch}, NLI labels "
                              f"{labels} (id2label)")
    else:
        detection = Detection("sequence-classification",
                              f"config.json architectures {arch}, labels {labels} (id2label)")
    detection.labels = labels
    return detection


def _clip(files: ModelFiles) -> Detection:
    model_type = files.config["model_type"]
    detection = Detection("clip", f"config.json model_type {model_type}")
    if "projection_dim" in files.config:
        detection.settings["dims"] = Setting(int(files.config["projection_dim"]),
                                             "config.json projection_dim")
    else:
        text = files.config.get("text_config") or {}
        if "hidden_size" not in text:
            raise OnboardError("config.json gives neither projection_dim nor "
                               "text_config.hidden_size: the embeddings' width is unknown")
        detection.settings["dims"] = Setting(int(text["hidden_size"]),
                                             "config.json text_config.hidden_size")
    return detection


def _stanford_colbert(files: ModelFiles) -> Detection:
    detection = Detection("multivector", "config.json architectures HF_ColBERT")
    for path in files.weights:
        if path.suffix == ".safetensors" and (shape := tensor_shape(path, "linear.weight")):
            detection.settings["dims"] = Setting(int(shape[0]),
                                                 f"{path.name} linear.weight shape")
            return detection
    raise OnboardError("a ColBERT checkpoint without a linear.weight projection in safetensors")


def _causal_lm(files: ModelFiles) -> Detection:
    arch = files.architecture
    detection = Detection("causal-lm", f"config.json architectures {arch}")
    if not files.has_chat_template():
        detection.notes.append("no chat template: serves completions; chat requests are "
                               "refused")
    if files.generation_config:
        stated = ", ".join(f"{k}={v}" for k, v in files.generation_config.items()
                           if k in ("max_new_tokens", "do_sample", "temperature", "top_p"))
        detection.notes.append(f"generation_config.json: {stated or 'token ids only'} "
                               "(requests set their own sampling options)")
    return detection


def _plain_encoder(files: ModelFiles) -> Detection:
    """A bare transformer encoder: a dense embedder whose pooling the files do not state."""
    arch = files.architecture or files.config.get("model_type", "?")
    detection = Detection("dense", f"config.json architectures {arch}, no sentence-"
                          "transformers files")
    detection.settings["pooling"] = Setting("mean", "not stated by the files: mean first, "
                                            "cls tried too")
    detection.alternatives["pooling"] = ["cls"]
    detection.settings["normalize"] = Setting(False, "no Normalize module (no modules.json)")
    detection.settings["dims"] = _hidden_size(files)
    detection.notes.append("pooling is not in the files; the pooling probe chose it")
    return detection


def _add_length(files: ModelFiles, detection: Detection) -> None:
    if detection.adapter in ("causal-lm", "clip"):
        return
    positions = files.config.get("max_position_embeddings")
    if isinstance(positions, int):
        # RoBERTa-family position tables count the padding offset too.
        offset = 2 if files.config.get("model_type") in ("roberta", "xlm-roberta") else 0
        positions -= offset
    else:
        positions = None
    stated: Setting | None = None
    limit = files.tokenizer_config.get("model_max_length")
    if "max_seq_length" in files.bert_config:
        stated = Setting(int(files.bert_config["max_seq_length"]),
                         "sentence_bert_config.json max_seq_length")
    elif isinstance(limit, int | float) and 0 < limit < _HUGE:
        stated = Setting(int(limit), "tokenizer_config.json model_max_length")
    if positions is not None and (stated is None or stated.value > positions):
        why = "config.json max_position_embeddings" + (
            f" (below {stated.source}: {stated.value})" if stated else "")
        stated = Setting(positions, why)
    if stated is not None:
        detection.settings["max_seq_length"] = stated
