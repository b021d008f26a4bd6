"""External components: OpenAI-compatible client, judges, PRMs, teachers, generative reward models."""

from trl_plugins.components.client import EndpointConfig, EndpointError, OpenAICompatibleClient
from trl_plugins.components.genrm import GenerativeRewardModel, GenRMParseError, GenRMTemplate
from trl_plugins.components.local_server import chat_response, serve_openai_compatible

__all__ = [
    "EndpointConfig", "EndpointError", "GenRMParseError", "GenRMTemplate", "GenerativeRewardModel",
    "OpenAICompatibleClient", "chat_response", "serve_openai_compatible",
]
