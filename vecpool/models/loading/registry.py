"""Native classes by the `architectures[0]` entry of config.json, imported lazily. Which class
serves a folder, native or the transformers fallback, is `loader.model_class`'s choice."""

from __future__ import annotations

import importlib

from vecpool.models.base import PoolingModel

# architecture name -> (module under vecpool.models.architectures, class name)
_REGISTRY: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "BertForTokenClassification": ("bert", "BertForTokenClassification"),
    "BertForMaskedLM": ("bert", "BertForMaskedLM"),
    "HF_ColBERT": ("bert", "ColBERTModel"),
    "RobertaModel": ("bert", "RobertaModel"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "RobertaForTokenClassification": ("bert", "RobertaForTokenClassification"),
    "RobertaForMaskedLM": ("bert", "RobertaForMaskedLM"),
    "XLMRobertaModel": ("bert", "RobertaModel"),
    "XLMRobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "XLMRobertaForTokenClassification": ("bert", "RobertaForTokenClassification"),
    "XLMRobertaForMaskedLM": ("bert", "RobertaForMaskedLM"),
    "Qwen3Model": ("qwen3", "Qwen3Model"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForSequenceClassification"),
    "Qwen3ForTokenClassification": ("qwen3", "Qwen3ForTokenClassification"),
    "LlamaModel": ("llama", "LlamaModel"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "LlamaForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "LlamaForTokenClassification": ("llama", "LlamaForTokenClassification"),
    "MistralModel": ("llama", "MistralModel"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "MistralForSequenceClassification": ("llama", "MistralForSequenceClassification"),
    "MistralForTokenClassification": ("llama", "MistralForTokenClassification"),
    "Gemma2Model": ("gemma2", "Gemma2Model"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma2ForSequenceClassification": ("gemma2", "Gemma2ForSequenceClassification"),
    "Gemma2ForTokenClassification": ("gemma2", "Gemma2ForTokenClassification"),
    # -- MPNet, DistilBERT, ALBERT, ELECTRA --
    "MPNetModel": ("mpnet", "MPNetModel"),
    "MPNetForMaskedLM": ("mpnet", "MPNetForMaskedLM"),
    "MPNetForSequenceClassification": ("mpnet", "MPNetForSequenceClassification"),
    "MPNetForTokenClassification": ("mpnet", "MPNetForTokenClassification"),
    "DistilBertModel": ("distilbert", "DistilBertModel"),
    "DistilBertForMaskedLM": ("distilbert", "DistilBertForMaskedLM"),
    "DistilBertForSequenceClassification": ("distilbert", "DistilBertForSequenceClassification"),
    "DistilBertForTokenClassification": ("distilbert", "DistilBertForTokenClassification"),
    "AlbertModel": ("albert", "AlbertModel"),
    "AlbertForMaskedLM": ("albert", "AlbertForMaskedLM"),
    "AlbertForSequenceClassification": ("albert", "AlbertForSequenceClassification"),
    "AlbertForTokenClassification": ("albert", "AlbertForTokenClassification"),
    "ElectraModel": ("electra", "ElectraModel"),
    "ElectraForPreTraining": ("electra", "ElectraModel"),  # discriminators: the encoder
    "ElectraForMaskedLM": ("electra", "ElectraForMaskedLM"),
    "ElectraForSequenceClassification": ("electra", "ElectraForSequenceClassification"),
    "ElectraForTokenClassification": ("electra", "ElectraForTokenClassification"),
    # -- T5 encoder, DeBERTa-v2, Jina BERT v2 --
    "T5EncoderModel": ("t5", "T5EncoderModel"),
    "T5Model": ("t5", "T5EncoderModel"),
    "T5ForConditionalGeneration": ("t5", "T5EncoderModel"),
    "MT5EncoderModel": ("t5", "T5EncoderModel"),
    "MT5Model": ("t5", "T5EncoderModel"),
    "MT5ForConditionalGeneration": ("t5", "T5EncoderModel"),
    "DebertaV2Model": ("deberta_v2", "DebertaV2Model"),
    "DebertaV2ForSequenceClassification": ("deberta_v2", "DebertaV2ForSequenceClassification"),
    "DebertaV2ForTokenClassification": ("deberta_v2", "DebertaV2ForTokenClassification"),
    "DebertaV2ForMaskedLM": ("deberta_v2", "DebertaV2ForMaskedLM"),
    "JinaBertModel": ("jina_bert", "JinaBertModel"),
    "JinaBertForMaskedLM": ("jina_bert", "JinaBertModel"),
    "JinaBertForSequenceClassification": ("jina_bert", "JinaBertForSequenceClassification"),
    # -- ModernBERT, NomicBERT, GTE --
    "ModernBertModel": ("modernbert", "ModernBertModel"),
    "ModernBertForMaskedLM": ("modernbert", "ModernBertForMaskedLM"),
    "ModernBertForSequenceClassification": ("modernbert", "ModernBertForSequenceClassification"),
    "ModernBertForTokenClassification": ("modernbert", "ModernBertForTokenClassification"),
    "NomicBertModel": ("nomic_bert", "NomicBertModel"),
    "NewModel": ("gte", "NewModel"),
    "NewForSequenceClassification": ("gte", "NewForSequenceClassification"),
    # -- Qwen2, Gemma, Gemma3 --
    "Qwen2Model": ("qwen2", "Qwen2Model"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen2ForSequenceClassification": ("qwen2", "Qwen2ForSequenceClassification"),
    "Qwen2ForTokenClassification": ("qwen2", "Qwen2ForTokenClassification"),
    "GemmaModel": ("gemma", "GemmaModel"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "GemmaForSequenceClassification": ("gemma", "GemmaForSequenceClassification"),
    "GemmaForTokenClassification": ("gemma", "GemmaForTokenClassification"),
    "Gemma3TextModel": ("gemma3", "Gemma3TextModel"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3TextForSequenceClassification": ("gemma3", "Gemma3TextForSequenceClassification"),
    # -- jina-reranker-v3 (listwise) --
    "JinaForRanking": ("jina_reranker", "JinaForRanking"),
    # -- dual encoders (texts and images into one space) --
    "CLIPModel": ("clip", "CLIPModel"),
    "SiglipModel": ("siglip", "SiglipModel"),
    "Siglip2Model": ("siglip", "Siglip2Model"),
    # -- vision-language models (images into the prompt) --
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2VLModel": ("qwen2_vl", "Qwen2VLModel"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen2_5_VLModel": ("qwen2_vl", "Qwen2_5_VLModel"),
    # -- multi-vector retrieval over page images --
    "ColQwen2ForRetrieval": ("colqwen2", "ColQwen2ForRetrieval"),
    "ColPaliForRetrieval": ("colpali", "ColPaliForRetrieval"),
    "JinaVLForRanking": ("jina_vl", "JinaVLForRanking"),  # jina-reranker-m0
}


def supported_architectures() -> list[str]:
    """The architectures with a native class, sorted."""
    return sorted(_REGISTRY)


def native_class(architecture: str) -> type[PoolingModel] | None:
    """The native class of `architecture` (its module imported on first use), or None."""
    entry = _REGISTRY.get(architecture)
    if entry is None:
        return None
    module = importlib.import_module(f"vecpool.models.architectures.{entry[0]}")
    cls: type[PoolingModel] = getattr(module, entry[1])
    return cls
