"""exlq's server side: the worker that serves one queue from Redis on one engine."""
