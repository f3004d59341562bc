"""Gateways: producers that speak a protocol clients already use (OpenAI's HTTP API,
exllamav2's WebSocket server) and turn each request into queue jobs."""
