"""exlq: LLM generation served from a Redis Stream.

The SDK is what most code needs::

    from exlq import AsyncProducer

``exlq.producer`` is the client side, ``exlq.worker`` the server side and
``exlq.protocol`` the wire contract both of them speak.
"""

from pathlib import Path

# In a source checkout the producer/ and worker/ folders sit beside this package rather
# than inside it (the build maps them here): let `import exlq.worker` from the checkout
# find them, as it does in an installed copy.
_checkout = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "worker").is_dir() and (_checkout / "worker").is_dir():
    __path__.append(str(_checkout))

from exlq import producer as _sdk  # noqa: E402
from exlq._version import __version__  # noqa: E402
from exlq.producer import *  # noqa: E402, F403 - the SDK's names are the package's

__all__ = [*_sdk.__all__, "__version__"]
