"""Which models vLLM serves, judged from config.json alone, for an InferenceService with runtime vllm:
the operator asks this (not tandem.contracts.model_support, Tandem's own engine's list) before any
pod downloads weights. Pure and torch-free.

vLLM picks its model class by config.json's `architectures`. The lists are vLLM's own registry at
the version Tandem renders for (tandem.contracts.vllm_serve.VLLM_VERSION:
vllm/model_executor/models/registry.py): what it serves natively, and what it served once and
dropped. An architecture on neither list is not refused: vLLM may still run it through its
Transformers backend, and says so itself at start. MLA models (DeepSeek-V2/V3, Kimi K2, ...), which
Tandem's engine refuses, are vLLM's to serve.
"""

from __future__ import annotations

from typing import Any

from tandem.contracts.vllm_serve import VLLM_VERSION

TEXT_GENERATION_ARCHITECTURES = frozenset({
    "AXK1ForCausalLM", "AfmoeForCausalLM", "ApertusForCausalLM", "BailingMoeForCausalLM",
    "BailingMoeV2ForCausalLM", "BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM", "BloomForCausalLM",
    "ChatGLMForConditionalGeneration", "ChatGLMModel", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM",
    "CohereForCausalLM", "DbrxForCausalLM", "DeciLMForCausalLM", "DeepseekForCausalLM", "DeepseekV2ForCausalLM",
    "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM", "Exaone4ForCausalLM", "ExaoneForCausalLM", "ExaoneMoEForCausalLM",
    "ExaoneMoeForCausalLM", "FalconForCausalLM", "FalconH1ForCausalLM", "FalconMambaForCausalLM",
    "GPT2LMHeadModel", "GPTJForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3nForCausalLM",
    "Gemma4ForCausalLM", "GemmaForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM",
    "Glm5NextForCausalLM", "GlmMoeDsaForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM",
    "GraniteMoeForCausalLM", "GraniteMoeHybridForCausalLM", "GraniteMoeSWAForCausalLM",
    "GraniteMoeSharedForCausalLM", "GraniteSWAForCausalLM", "HCXVisionV2ForCausalLM", "HYV3ForCausalLM",
    "HYV4ForCausalLM", "HrmTextForCausalLM", "HyperCLOVAXForCausalLM", "IQuestCoderForCausalLM",
    "IQuestLoopCoderForCausalLM", "InklingForCausalLM", "InklingForConditionalGeneration",
    "InternLM2ForCausalLM", "InternLM3ForCausalLM", "JambaForCausalLM", "K2HorizonForCausalLM",
    "KimiLinearForCausalLM", "LLaMAForCausalLM", "LagunaForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM",
    "Llama4ForCausalLM", "LlamaForCausalLM", "LongcatFlashForCausalLM", "LongcatFlashNgramForCausalLM",
    "Mamba2ForCausalLM", "MambaForCausalLM", "MiMoForCausalLM", "MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM",
    "MiniCPM3ForCausalLM", "MiniCPMForCausalLM", "MiniMaxM2ForCausalLM", "MiniMaxM3SparseForCausalLM",
    "Ministral3ForCausalLM", "MistralForCausalLM", "MistralLarge3ForCausalLM", "MixtralForCausalLM",
    "MuseGlimmerForCausalLM", "NemotronForCausalLM", "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM",
    "OPTForCausalLM", "OlmoHybridForCausalLM", "OlmoeForCausalLM", "OrionForCausalLM",
    "PanguEmbeddedForCausalLM", "PanguProMoEV2ForCausalLM", "PanguUltraMoEForCausalLM", "Param2MoEForCausalLM",
    "Phi3ForCausalLM", "PhiMoEForCausalLM", "Plamo3ForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM", "Qwen4ExpForCausalLM", "Rnj1ForCausalLM", "SarvamMLAForCausalLM",
    "SarvamMoEForCausalLM", "SolarForCausalLM", "StableLmForCausalLM", "Step1ForCausalLM",
    "Step3TextForCausalLM", "Step3p5ForCausalLM", "TeleChat2ForCausalLM", "TeleChat3ForCausalLM",
    "TeleFLMForCausalLM", "Zamba2ForCausalLM"
})
DROPPED_ARCHITECTURES: dict[str, str] = {
    "MotifForCausalLM": "0.10.2", "Phi3SmallForCausalLM": "0.9.2", "Phi4FlashForCausalLM": "0.10.2",
    "Phi4MultimodalForCausalLM": "0.12.0", "JAISLMHeadModel": "0.22.0", "ErnieModel": "0.23.0",
    "ErnieForSequenceClassification": "0.23.0", "ErnieForTokenClassification": "0.23.0",
    "InternLM2VEForCausalLM": "0.23.0", "QWenLMHeadModel": "0.23.0", "QwenVLForConditionalGeneration": "0.23.0",
    "InternLMForCausalLM": "0.23.0", "DonutForConditionalGeneration": "0.10.2",
    "MllamaForConditionalGeneration": "0.10.2", "XverseForCausalLM": "0.23.0", "Dots1ForCausalLM": "0.23.0",
    "BambaForCausalLM": "0.23.0", "MiniMaxForCausalLM": "0.23.0", "MiniMaxText01ForCausalLM": "0.23.0",
    "MiniMaxM1ForCausalLM": "0.23.0", "MiniMaxVL01ForConditionalGeneration": "0.23.0", "BaiChuanForCausalLM":
    "0.23.0", "BaichuanForCausalLM": "0.23.0", "AquilaModel": "0.24.0", "AquilaForCausalLM": "0.24.0",
    "Grok1ModelForCausalLM": "0.24.0", "Grok1ForCausalLM": "0.24.0", "TarsierForConditionalGeneration":
    "0.24.0", "Tarsier2ForConditionalGeneration": "0.23.0", "MantisForConditionalGeneration": "0.24.0",
    "MusicFlamingoForConditionalGeneration": "0.24.0", "AyaVisionForConditionalGeneration": "0.24.0",
    "TeleChatForCausalLM": "0.25.0", "PersimmonForCausalLM": "0.25.0", "FuyuForCausalLM": "0.25.0",
    "Plamo2ForCausalLM": "0.26.0", "OuroForCausalLM": "0.26.0", "ArcticForCausalLM": "0.28.0",
    "ChameleonForConditionalGeneration": "0.28.0", "Cheers": "0.28.0", "CheersForConditionalGeneration":
    "0.28.0", "Fairseq2LlamaForCausalLM": "0.28.0", "FireRedLIDForConditionalGeneration": "0.28.0", "GritLM":
    "0.28.0", "HCXVisionForCausalLM": "0.28.0", "MPTForCausalLM": "0.28.0", "MptForCausalLM": "0.28.0",
    "RWForCausalLM": "0.28.0", "StableLMEpochForCausalLM": "0.28.0", "PrithviGeoSpatialMAE": "0.28.0"
}


def architectures(config_json: dict[str, Any]) -> list[str]:
    names = config_json.get("architectures")
    return [a for a in names if isinstance(a, str)] if isinstance(names, list) else []


def check_vllm_model_config(config_json: dict[str, Any], tensor_parallel: int = 1) -> str | None:
    """None when vLLM can serve this model at this tensor-parallel size (as far as config.json
    tells); else the reason, in words a person acts on."""
    if not isinstance(config_json, dict):
        return "config.json is not a JSON object"
    names = architectures(config_json)
    if not names:
        return "config.json names no architectures: vLLM chooses its model class by them"
    dropped = [a for a in names if a in DROPPED_ARCHITECTURES]
    if dropped:
        return (f"architecture {dropped[0]} is not served by vLLM {VLLM_VERSION} (vLLM dropped it after "
                f"{DROPPED_ARCHITECTURES[dropped[0]]}): use runtime tandem if it serves the model, or another model")
    heads = config_json.get("num_attention_heads")
    if isinstance(heads, int) and heads > 0 and tensor_parallel > 1 and heads % tensor_parallel:
        return (f"tensor_parallel {tensor_parallel} does not divide the model's {heads} attention heads "
                "(vLLM splits them evenly across ranks)")
    return None


def served_how(config_json: dict[str, Any]) -> str:
    """How vLLM runs a model this module accepts: natively, or through its Transformers backend."""
    names = architectures(config_json)
    native = [a for a in names if a in TEXT_GENERATION_ARCHITECTURES]
    if native:
        return f"vLLM {VLLM_VERSION} serves {native[0]} natively"
    return (f"{names[0] if names else 'the architecture'} is not in vLLM {VLLM_VERSION}'s text-generation "
            "list: vLLM runs it through its Transformers backend or refuses it when the server starts")
