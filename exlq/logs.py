"""How every exlq program logs: one function sets the level and the format (text lines, or one
JSON object per line for log collectors), so the worker, its engine process and the gateways
write alike. Every module logs to ``logging.getLogger(__name__)``, so a logger's name is the
module's (``exlq.worker.runner``, ``exlq.producer.client``): a level set on ``exlq.worker``
reaches the whole worker."""

from __future__ import annotations

import logging
from typing import Literal, get_args

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The JSON lines' standard keys; a record's `extra` fields are added beside them.
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(message)s"


def parse_log_format(value: str) -> LogFormat:
    """``value`` as a log format, or ValueError naming the ones there are."""
    lowered = value.strip().lower()
    if lowered == "text":
        return "text"
    if lowered == "json":
        return "json"
    raise ValueError(f"log format {value!r} is not known: use {' or '.join(LOG_FORMATS)}")


def formatter(fmt: LogFormat) -> logging.Formatter:
    """The formatter of ``fmt``. JSON lines carry each record's `extra` fields as keys of
    their own, which a text line leaves to its message."""
    if fmt == "json":
        # Imported here: the SDK, which never configures logging, does not load it.
        from pythonjsonlogger.json import JsonFormatter

        return JsonFormatter(JSON_FIELDS)
    return logging.Formatter(TEXT_FORMAT)


def configure_logging(level: str | int = "INFO", fmt: LogFormat = "text") -> None:
    """Log to stderr at ``level`` in ``fmt``: a handler on the root logger, as
    logging.basicConfig makes it, so libraries' lines (uvicorn's, redis-py's) come out alike.
    As with basicConfig, a process whose root logger has handlers already (a test's, an
    application's that embeds exlq) is left as it is."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(fmt))
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
