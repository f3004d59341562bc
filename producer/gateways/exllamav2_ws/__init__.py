"""The exllamav2 WebSocket gateway: ExLlamaV2WebSocketServer's protocol, served from an exlq
queue."""
