"""What LangChain is told ChatFreeToken's model can do: its `ModelProfile` (langchain-core's
model profiles: context limits, modalities, tool calling, structured and reasoning output)."""

from __future__ import annotations

from typing import Any

from langchain_core.language_models import ModelProfile


def model_profile(service: Any) -> ModelProfile:
    """The profile of the model behind `service` (an EngineService): the context less the one
    token a reply needs, text in and out, reasoning where the chat template thinks."""
    sources = getattr(service.tokenizer, "chat_template_sources", {}) or {}
    thinks = any("<think>" in s or "enable_thinking" in s for s in sources.values())
    limit = int(service.engine.max_model_len)
    return ModelProfile(
        max_input_tokens=limit - 1,  # at least one token must be generated
        max_output_tokens=limit - 1,
        text_inputs=True,
        text_outputs=True,
        image_inputs=False,
        audio_inputs=False,
        video_inputs=False,
        pdf_inputs=False,
        reasoning_output=thinks,
        tool_calling=True,
        tool_choice=True,
        tool_call_streaming=True,
        structured_output=True,
        temperature=True,
    )
