"""External components: OpenAI-compatible client, judges, PRMs, teachers."""

from trl_plugins.components.client import EndpointConfig, EndpointError, OpenAICompatibleClient
from trl_plugins.components.local_server import chat_response, serve_openai_compatible

__all__ = ["EndpointConfig", "EndpointError", "OpenAICompatibleClient", "chat_response", "serve_openai_compatible"]
