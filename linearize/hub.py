"""Whether the Hugging Face hub answers: asked before anything would download from it, because on a
machine that cannot reach it the hub's client retries each file for up to a minute before failing."""

from __future__ import annotations

import urllib.error
import urllib.request


def hub_reachable(timeout: float = 5.0) -> bool:
    """True when the hub's endpoint (`HF_ENDPOINT`, default huggingface.co) answers within `timeout` seconds."""
    import huggingface_hub

    try:
        urllib.request.urlopen(huggingface_hub.constants.ENDPOINT, timeout=timeout).close()
    except urllib.error.HTTPError:
        return True  # it answered, if only with an error
    except OSError:
        return False
    return True
