"""Operators' tools: what a queue holds, read from Redis alone (queue_stats), exported to
Prometheus whether or not a worker runs (exporter), shown live (top), and its dead letters
listed, shown, replayed and purged (dead_letters). A queue split in partitions is one queue
to each of them: its numbers and dead letters are every partition's. Nothing here imports
the worker."""
