"""Task heads (``--head``): which Hugging Face ``AutoModelFor...`` class sits on the layer stack.

A language-model head (``causal-lm``, ``masked-lm``) projects every token onto the vocabulary; for 128k–256k
vocabularies its logits are the largest single term of a step. A classification head has no vocabulary-sized
logits at all, and no vocabulary-sized head weight (the token table is then only an embedding):

* ``seq-cls`` — decoders (transformers ``modeling_layers.py`` ``GenericForSequenceClassification``, and GPT-2's
  ``GPT2ForSequenceClassification``): ``score = Linear(h, num_labels, bias=False)`` over *every* token, then the
  logits of the last non-pad token per row (``logits[arange(b), last_non_pad_token]``) and cross-entropy over
  ``b × num_labels``. BERT (``BertForSequenceClassification``): the pooler (dense ``h × h`` + tanh) on the [CLS]
  token, dropout, ``classifier = Linear(h, num_labels)``.
* ``token-cls`` — ``GenericForTokenClassification`` / ``BertForTokenClassification``: dropout
  (``classifier_dropout``, else the model's hidden dropout, else 0.1) then ``Linear(h, num_labels)`` with bias
  over every token; the loss upcasts the ``t × num_labels`` logits (``loss_utils.py`` ``ForTokenClassification``).
* ``none`` — ``AutoModel``: the base model with no head. The loss is the caller's; trainfit assumes
  ``last_hidden_state.mean()`` (a scalar reduction that saves nothing for backward).

The default head follows the config's architecture (``BertForMaskedLM`` → ``masked-lm``, ``*ForCausalLM`` →
``causal-lm``, ``*ForSequenceClassification`` → ``seq-cls``, ...).
"""

from __future__ import annotations

import dataclasses

from trainfit.arch.spec import ModelKind, ModelSpec, ParamTensor
from trainfit.errors import ConfigError

#: BERT's masked-LM head tensors live in ``extra_tensors`` under this prefix (trainfit.arch.config ``_bert``).
_MLM_PREFIX = "cls."

_ARCH_SUFFIX = {
    "ForCausalLM": ModelKind.CAUSAL_LM,
    "LMHeadModel": ModelKind.CAUSAL_LM,
    "ForMaskedLM": ModelKind.MASKED_LM,
    "ForSequenceClassification": ModelKind.SEQ_CLS,
    "ForTokenClassification": ModelKind.TOKEN_CLS,
}


_CLASS_SUFFIX = {
    ModelKind.CAUSAL_LM: "ForCausalLM",
    ModelKind.MASKED_LM: "ForMaskedLM",
    ModelKind.SEQ_CLS: "ForSequenceClassification",
    ModelKind.TOKEN_CLS: "ForTokenClassification",
    ModelKind.BASE: "Model",
}


def _arch_name(spec: ModelSpec, kind: ModelKind) -> str:
    """``LlamaForCausalLM`` → ``LlamaForSequenceClassification`` (what the report's header names)."""
    stem = spec.architecture
    for suffix in (*_ARCH_SUFFIX, "Model"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    return stem + _CLASS_SUFFIX[kind]


def default_head(spec: ModelSpec) -> ModelKind:
    """The head the config's ``architectures`` names, else the family's language-model head."""
    archs = spec.hf_config.get("architectures") if spec.hf_config else None
    name = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else spec.architecture
    for suffix, kind in _ARCH_SUFFIX.items():
        if name.endswith(suffix):
            if kind.has_vocab_logits:
                return spec.kind  # the family decides between causal and masked LM
            return kind
    return spec.kind


def is_encoder(spec: ModelSpec) -> bool:
    """BERT-style encoders: pooler for sequence classification, masked-LM instead of causal-LM."""
    return spec.model_type == "bert"


def classifier_dropout(spec: ModelSpec) -> float:
    """The classification head's dropout probability as transformers picks it: ``classifier_dropout``, else the
    hidden dropout (``hidden_dropout`` for decoders, ``hidden_dropout_prob`` for BERT), else 0.1
    (``GenericForTokenClassification.__init__``)."""
    cfg = spec.hf_config or {}
    for key in ("classifier_dropout", "hidden_dropout_prob" if is_encoder(spec) else "hidden_dropout"):
        v = cfg.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return 0.1


def head_tensors(spec: ModelSpec) -> tuple[ParamTensor, ...]:
    """The parameters of a classification head (none for the language-model heads, which the inventory counts)."""
    h, n = spec.hidden_size, spec.num_labels
    if spec.kind is ModelKind.SEQ_CLS and is_encoder(spec):
        return (
            ParamTensor(name="pooler.dense.weight", shape=(h, h), matmul=True),
            ParamTensor(name="pooler.dense.bias", shape=(h,), matmul=False),
            ParamTensor(name="classifier.weight", shape=(n, h), matmul=True),
            ParamTensor(name="classifier.bias", shape=(n,), matmul=False),
        )
    if spec.kind is ModelKind.SEQ_CLS:
        return (ParamTensor(name="score.weight", shape=(n, h), matmul=True),)
    if spec.kind is ModelKind.TOKEN_CLS:
        return (
            ParamTensor(name="score.weight", shape=(n, h), matmul=True),
            ParamTensor(name="score.bias", shape=(n,), matmul=False),
        )
    if spec.kind is ModelKind.BASE and is_encoder(spec):
        # BertModel keeps its pooler (add_pooling_layer=True); a loss on last_hidden_state leaves it gradient-free.
        return (
            ParamTensor(name="pooler.dense.weight", shape=(h, h), matmul=True),
            ParamTensor(name="pooler.dense.bias", shape=(h,), matmul=False),
        )
    return ()


def with_head(spec: ModelSpec, head: ModelKind | str | None = None, num_labels: int | None = None) -> ModelSpec:
    """``spec`` with the task head ``head`` (default: :func:`default_head`) and ``num_labels`` classes.

    Refuses a language-model head the family does not have (BERT has no causal LM here; decoders no masked LM),
    ``num_labels`` < 1, and ``num_labels`` without a classification head."""
    if head is None:
        kind = default_head(spec)
    else:
        try:
            kind = ModelKind(head)
        except ValueError:
            choices = ", ".join(k.value for k in ModelKind)
            raise ConfigError(f"unknown head '{head}'; choose one of: {choices}") from None
    if kind is ModelKind.MASKED_LM and not is_encoder(spec):
        raise ConfigError(f"{spec.name} is a decoder: it has no masked-LM head; use --head causal-lm")
    if kind is ModelKind.CAUSAL_LM and is_encoder(spec):
        raise ConfigError(f"{spec.name} is an encoder: trainfit models its masked-LM head; use --head masked-lm")
    labels = num_labels
    if labels is None:
        cfg_labels = (spec.hf_config or {}).get("num_labels")
        id2label = (spec.hf_config or {}).get("id2label")
        if isinstance(cfg_labels, int) and not isinstance(cfg_labels, bool):
            labels = cfg_labels
        elif isinstance(id2label, dict) and id2label:
            labels = len(id2label)
        else:
            labels = spec.num_labels
    elif kind not in (ModelKind.SEQ_CLS, ModelKind.TOKEN_CLS):
        raise ConfigError(f"--num-labels needs a classification head (seq-cls or token-cls), not {kind.value}")
    if isinstance(labels, bool) or not isinstance(labels, int) or labels < 1:
        raise ConfigError(f"num-labels must be a whole number ≥ 1, got {labels!r}")
    if kind is spec.kind and labels == spec.num_labels:
        return spec
    extra = spec.extra_tensors
    if not kind.has_vocab_logits:
        extra = tuple(t for t in extra if not t.name.startswith(_MLM_PREFIX))
    out = dataclasses.replace(
        spec, kind=kind, num_labels=labels, extra_tensors=extra, architecture=_arch_name(spec, kind)
    )
    return dataclasses.replace(out, extra_tensors=extra + head_tensors(out))
