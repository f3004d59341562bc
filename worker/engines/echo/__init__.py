"""The echo engine: streams the prompt back, word by word; runs the whole system without a GPU."""
