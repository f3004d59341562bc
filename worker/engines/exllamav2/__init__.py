"""The exllamav2 engine: exllamav2's dynamic generator with exlq's paged attention, decode graphs,
batched prefill and GPU sampling. Only this folder imports exllamav2."""
