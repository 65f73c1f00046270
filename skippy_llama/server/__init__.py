"""The OpenAI-compatible server (``skippy-llama serve``), its metrics and status page.

Built on llama_cpp.server (its ``server`` extra: FastAPI, uvicorn, SSE): only the model
constructor and the completion routes differ. Importing this package needs that extra.
"""

from .app import ServeConfig, create_app
from .proxy import ModelSource, ServedLlama

__all__ = ["ModelSource", "ServeConfig", "ServedLlama", "create_app"]
