"""The reference side of a parity check: each family's own library on the probes
(fp32, CPU), following the entry's settings."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from app.onboard import probes
from app.onboard.files import optional_json
from app.onboard.parity.common import (
    NEW_TOKENS,
    Outputs,
    Reference,
    capped_length,
    library_version,
    prompt_kinds,
    prompt_of,
    settings_key,
    st_transformer_config,
    truncation_limit,
)
from app.onboard.parity.ours import aggregation, generation_items, label_scores

if TYPE_CHECKING:
    from tasks.catalog import ModelEntry


def _st_pooling(model: Any) -> tuple[int, Any | None, bool]:
    """(index of the Pooling module, it, whether a Normalize follows) of a SentenceTransformer."""
    from sentence_transformers.base.modules import Normalize
    from sentence_transformers.sentence_transformer.modules import Pooling

    modules = list(model)
    index = next((i for i, m in enumerate(modules) if isinstance(m, Pooling)), -1)
    return index, modules[index] if index >= 0 else None, any(
        isinstance(m, Normalize) for m in modules)


def _dense_model(entry: ModelEntry, folder: Path) -> tuple[Any, str]:
    """The SentenceTransformer the entry's settings describe, and how it was made."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    library = f"{library_version('sentence-transformers')} SentenceTransformer"
    if (folder / "modules.json").is_file():
        model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
        index, pooling, normalized = _st_pooling(model)
        want_pooling = entry.pooling or (pooling.pooling_mode if pooling else "mean")
        want_normalize = normalized if entry.normalize is None else entry.normalize
        if pooling is not None and pooling.pooling_mode == want_pooling and \
                normalized == want_normalize:
            return model, library
        # The user chose another pooling or normalisation than the files: the model they
        # mean is the same modules with that Pooling (and a Normalize or none).
        modules = [m for m in model if not isinstance(m, Normalize | Pooling)]
        width = modules[0].get_embedding_dimension()
        modules.insert(index if index >= 0 else 1, Pooling(width, pooling_mode=want_pooling))
        if want_normalize:
            modules.append(Normalize())
        how = f" rebuilt with Pooling({want_pooling}){' + Normalize' if want_normalize else ''}"
        return SentenceTransformer(modules=modules, device="cpu"), library + how
    transformer = Transformer(str(folder), max_seq_length=entry.max_seq_length)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(),
                                    pooling_mode=entry.pooling or "mean")]
    if entry.normalize:
        modules.append(Normalize())
    how = f" from Transformer + Pooling({entry.pooling or 'mean'})" + \
        (" + Normalize" if entry.normalize else "")
    return SentenceTransformer(modules=modules, device="cpu"), library + how


def _reference_dense(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    model, library = _dense_model(entry, folder)
    if entry.max_seq_length:
        model.max_seq_length = capped_length(entry.max_seq_length, st_transformer_config(model))
    # An explicit prompt, "" included, so no default_prompt_name of the files applies.
    return {kind: model.encode(list(probes.TEXTS), prompt=prompt_of(entry, kind),
                               convert_to_numpy=True, batch_size=4)
            for kind in prompt_kinds(entry)}, library


def _splade_manual(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    """SPLADE by hand on the masked LM: log(1 + relu(logits)), max over the real tokens."""
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForMaskedLM.from_pretrained(str(folder), local_files_only=True,
                                                 dtype=torch.float32).eval()
    limit = truncation_limit(tokenizer, model.config, entry.max_seq_length)
    out: Outputs = {}
    for kind in prompt_kinds(entry):
        rows = []
        for text in probes.TEXTS:
            inputs = tokenizer(prompt_of(entry, kind) + text, truncation=True, max_length=limit,
                               return_tensors="pt")
            with torch.inference_mode():
                logits = model(**inputs).logits[0]
            rows.append(torch.log1p(torch.relu(logits)).amax(dim=0).numpy())
        out[kind] = np.stack(rows)
    return out, (f"{library_version('transformers')} AutoModelForMaskedLM + SPLADE max "
                 "pooling (by hand)")


def _reference_sparse(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    if not (folder / "modules.json").is_file():
        return _splade_manual(entry, folder)
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(str(folder), device="cpu", local_files_only=True)
    if entry.max_seq_length:
        model.max_seq_length = capped_length(entry.max_seq_length, st_transformer_config(model))
    out = {kind: model.encode(list(probes.TEXTS), prompt=prompt_of(entry, kind),
                              convert_to_tensor=True, convert_to_sparse_tensor=False,
                              batch_size=4).cpu().numpy()
           for kind in prompt_kinds(entry)}
    return out, f"{library_version('sentence-transformers')} SparseEncoder"


def _activation(entry: ModelEntry, num_labels: int) -> str:
    """The activation shoal's scores carry: the entry's default, else sigmoid for one
    logit and the last class's softmax for several (runtimes.families.classifiers)."""
    chosen = entry.defaults.get("activation")
    return str(chosen) if chosen else ("sigmoid" if num_labels == 1 else "softmax")


def _activated(logits: np.ndarray, activation: str) -> np.ndarray:
    logits = logits.reshape(len(logits), -1).astype(np.float64)
    if activation == "softmax":
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (shifted / shifted.sum(axis=1, keepdims=True))[:, -1]
    if activation == "sigmoid":
        return 1 / (1 + np.exp(-logits[:, -1]))
    return logits[:, -1]


def _reference_cross_encoder(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    model = CrossEncoder(str(folder), device="cpu", local_files_only=True,
                         max_length=capped_length(entry.max_seq_length, config))
    # Raw logits, then the activation shoal applies: a model saved with another activation
    # (Identity, say) is compared on the quantity shoal serves.
    logits = model.predict(list(probes.PAIRS), activation_fn=torch.nn.Identity(),
                           convert_to_numpy=True, batch_size=4)
    activation = _activation(entry, int(model.config.num_labels))
    return ({"scores": _activated(np.asarray(logits), activation)},
            f"{library_version('sentence-transformers')} CrossEncoder.predict + {activation}")


def _pipeline(task: str, entry: ModelEntry, folder: Path, **kwargs: Any) -> Any:
    """A transformers pipeline whose tokenizer truncates at the entry's limit."""
    from transformers import AutoConfig, AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    tokenizer.model_max_length = truncation_limit(tokenizer, config, entry.max_seq_length)
    return pipeline(task, model=str(folder), tokenizer=tokenizer, device="cpu",
                    dtype="float32", **kwargs)


def _reference_classify(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    classifier = _pipeline("text-classification", entry, folder, top_k=None)
    labels = [str(classifier.model.config.id2label[i])
              for i in range(int(classifier.model.config.num_labels))]
    rows = classifier(list(probes.TEXTS), truncation=True, batch_size=1)
    return ({"labels": labels, "scores": label_scores(rows, labels)},
            f"{library_version('transformers')} pipeline('text-classification', top_k=None)")


def _reference_zero_shot(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    from tasks.options import DEFAULT_HYPOTHESIS

    classifier = _pipeline("zero-shot-classification", entry, folder)
    labels = list(probes.ZERO_SHOT_LABELS)
    answers = classifier(list(probes.TEXTS), candidate_labels=labels,
                         hypothesis_template=DEFAULT_HYPOTHESIS, multi_label=False)
    rows = [[{"label": label, "score": score} for label, score in
             zip(a["labels"], a["scores"], strict=True)] for a in answers]
    return ({"labels": labels, "scores": label_scores(rows, labels)},
            f"{library_version('transformers')} pipeline('zero-shot-classification', "
            f"hypothesis_template={DEFAULT_HYPOTHESIS!r})")


def _reference_extract(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    strategy = aggregation(entry)
    tagger = _pipeline("token-classification", entry, folder, aggregation_strategy=strategy)
    key = "entity" if strategy == "none" else "entity_group"
    spans = [[(int(e["start"]), int(e["end"]), str(e[key]), float(e["score"]))
              for e in tagger(text)] for text in probes.TEXTS]
    return ({"spans": spans}, f"{library_version('transformers')} pipeline('token-classification', "
            f"aggregation_strategy={strategy!r})")


def _image_processor(folder: Path) -> Any:
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
        return getattr(processor, "image_processor", processor)
    except (OSError, ValueError, TypeError):  # no processor config: the image one alone
        return AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)


def _features(output: Any) -> Any:
    # transformers 5 returns an output whose pooler_output is the projected vector.
    return output if hasattr(output, "numpy") else output.pooler_output


def _reference_clip(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(folder), local_files_only=True,
                                      dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    processor = _image_processor(folder)
    limit = truncation_limit(tokenizer, model.config.text_config, entry.max_seq_length)
    # SigLIP was trained on texts padded to full length, as its model card says to pad.
    padding = "max_length" if "siglip" in model.config.model_type else True
    out: Outputs = {}
    with torch.inference_mode():
        for kind in prompt_kinds(entry):
            texts = [prompt_of(entry, kind) + t for t in probes.TEXTS]
            inputs = tokenizer(texts, padding=padding, truncation=True, max_length=limit,
                               return_tensors="pt", return_token_type_ids=False)
            out[kind] = _features(model.get_text_features(**inputs)).float().numpy()
        pixels = processor(images=probes.probe_images(), return_tensors="pt")["pixel_values"]
        out["image"] = _features(model.get_image_features(pixel_values=pixels)).float().numpy()
    if entry.normalize is not False:  # CLIP vectors are compared by cosine: unit length
        out = {k: v / np.linalg.norm(v, axis=1, keepdims=True) for k, v in out.items()}
    return out, (f"{library_version('transformers')} {type(model).__name__}.get_text_features/"
                 f"get_image_features + {type(processor).__name__}")


def _completion_ids(tokenizer: Any, text: str) -> list[int]:
    """A text prompt's ids as the text-generation pipeline makes them, with the BOS token
    where the tokenizer puts one before the text, but without the end tokens a tokenizer
    appends (they would tell the model the text is over) or other special tokens (a BERT
    tokenizer's [CLS] is no BOS)."""
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    full = tokenizer(text)["input_ids"]
    start = next((k for k in range(len(full) - len(plain) + 1)
                  if full[k : k + len(plain)] == plain), 0)
    bos = tokenizer.bos_token_id
    return [t for t in full[:start] if bos is not None and t == bos] + plain


def _reference_generate(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                 dtype=torch.float32).eval()
    eos = {i for i in (model.generation_config.eos_token_id, tokenizer.eos_token_id)
           for i in (i if isinstance(i, list) else [i]) if isinstance(i, int)}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    # Plain greedy decoding: the files' repetition penalties and the like are not applied,
    # as shoal applies only the request's options.
    greedy = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS,
                              eos_token_id=sorted(eos) or None, pad_token_id=pad)
    texts = []
    for item in generation_items(bool(tokenizer.chat_template)):
        if "text" in item:
            ids = _completion_ids(tokenizer, item["text"])
        else:
            rendered = tokenizer.apply_chat_template(item["messages"], tokenize=False,
                                                     add_generation_prompt=True)
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), generation_config=greedy)
        new = out[0, len(ids):].tolist()
        cut = next((k for k, t in enumerate(new) if t in eos), len(new))
        texts.append(tokenizer.decode(new[:cut], skip_special_tokens=True))
    return {"texts": texts}, (f"{library_version('transformers')} AutoModelForCausalLM.generate "
                              f"(greedy, {NEW_TOKENS} tokens, chat template)")


def _linear(path: Path) -> tuple[np.ndarray, np.ndarray | None] | None:
    from safetensors.numpy import load_file

    if not path.is_file():
        return None
    tensors = load_file(str(path))
    if "linear.weight" not in tensors:
        return None
    return tensors["linear.weight"].astype(np.float32), tensors.get("linear.bias")


def _colbert_layout(folder: Path) -> tuple[Path, list[tuple[np.ndarray, np.ndarray | None]]]:
    """(the encoder's folder, the projection layers) from the model's files; safetensors
    only (a pickled projection is not read here)."""
    modules_file = folder / "modules.json"
    modules = json.loads(modules_file.read_text()) if modules_file.is_file() else []
    encoder, layers = folder, []
    for module in modules:
        kind, path = module.get("type", ""), module.get("path", "")
        if kind.endswith("Transformer"):
            encoder = folder / path
        elif kind.endswith(".Dense"):
            layer = _linear(folder / path / "model.safetensors")
            if layer is None:
                return encoder, []
            layers.append(layer)
    if not layers:  # the Stanford layout: linear.weight beside the encoder's weights
        layer = _linear(folder / "model.safetensors")
        layers = [layer] if layer is not None else []
    return encoder, layers


def _reference_multivector(entry: ModelEntry, folder: Path) -> tuple[Outputs, str]:
    """ColBERT document vectors by hand: the encoder's token states through the saved
    linear projection, each L2-normalised. Queries (padded with [MASK] to a fixed length)
    are not probed: no library computes them the same way for every checkpoint layout."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    encoder, layers = _colbert_layout(folder)
    if not layers:
        return {}, ""
    tokenizer = AutoTokenizer.from_pretrained(str(encoder), local_files_only=True)
    model = AutoModel.from_pretrained(str(encoder), local_files_only=True,
                                      dtype=torch.float32).eval()
    st = optional_json(encoder / "sentence_bert_config.json")
    saved = (optional_json(folder / "config_sentence_transformers.json").get("document_length")
             or optional_json(folder / "artifact.metadata").get("doc_maxlen")
             or st.get("max_seq_length"))
    limit = truncation_limit(tokenizer, model.config, entry.max_seq_length or saved)
    rows = []
    for text in probes.TEXTS:
        text = entry.prompts.document + text
        inputs = tokenizer(text.lower() if st.get("do_lower_case") else text,
                           truncation=True, max_length=limit, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**inputs).last_hidden_state[0].numpy()
        for weight, bias in layers:
            hidden = hidden @ weight.T + (bias if bias is not None else 0)
        rows.append(hidden / np.linalg.norm(hidden, axis=1, keepdims=True))
    return {"document": rows}, (f"{library_version('transformers')} AutoModel + the saved linear "
                                "projection, per token L2-normalised (by hand, documents)")


_REFERENCES: dict[str, Callable[[ModelEntry, Path], tuple[Outputs, str]]] = {
    "dense": _reference_dense,
    "sparse": _reference_sparse,
    "clip": _reference_clip,
    "multivector": _reference_multivector,
    "cross-encoder": _reference_cross_encoder,
    "sequence-classification": _reference_classify,
    "zero-shot": _reference_zero_shot,
    "token-classification": _reference_extract,
    "causal-lm": _reference_generate,
}


def reference_outputs(entry: ModelEntry, folder: Path) -> Reference:
    """The reference library's outputs on the probes, as the entry's settings ask (fp32,
    CPU)."""
    if entry.adapter not in _REFERENCES:
        raise ValueError(f"no reference library for adapter {entry.adapter!r}")
    outputs, library = _REFERENCES[entry.adapter](entry, Path(folder))
    note = "" if library else f"no reference library for {entry.adapter} (no safetensors " \
        "projection to compute one from)"
    return Reference(entry.adapter, library, outputs, settings_key(entry), note)
