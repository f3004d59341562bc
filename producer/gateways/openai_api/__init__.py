"""The OpenAI-compatible HTTP gateway: models, completions, chat completions, files and
batches, served from exlq queues (one queue per model name)."""
