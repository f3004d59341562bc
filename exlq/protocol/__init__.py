"""The wire contract both sides speak: request and event models, key names, the Lua
scripts' shared parts, the connection classes and the backoff while Redis is away.
Imports neither the SDK nor the worker."""
